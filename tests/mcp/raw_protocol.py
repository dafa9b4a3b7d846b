"""Raw JSON-RPC checks of agent-sandbox's MCP server, on stdio and on
Streamable HTTP, for protocol versions 2025-06-18, 2025-11-25 and
2026-07-28. EVERY message the server sends is validated against the
matching official schema (shared/reference/mcp/schema-*.json), and every
structuredContent against its tool's outputSchema. Also bad input:
malformed JSON, batches, unknown methods, wrong params, oversized
messages, wrong versions and headers, clients that disconnect mid-execute.
Run by tests/mcp_protocol.rs.

usage: raw_protocol.py SCHEMA_DIR stdio -- CMD ARGS...
       raw_protocol.py SCHEMA_DIR http BASE_URL KEY
"""
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import jsonschema
from jsonschema.validators import validator_for

SCHEMA_DIR = sys.argv[1]
VERSIONS = ["2025-06-18", "2025-11-25", "2026-07-28"]
MODERN = "2026-07-28"
LOCAL = os.environ.get("MCP_TEST_LOCAL_PROCS") == "1"
checks = 0
validated = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


class Schemas:
    def __init__(self, version):
        with open(os.path.join(SCHEMA_DIR, f"schema-{version}.json")) as f:
            self.doc = json.load(f)
        self.key = "definitions" if "definitions" in self.doc else "$defs"
        self.cls = validator_for(self.doc)
        self.version = version

    def validate(self, value, name):
        global validated
        if name not in self.doc[self.key]:
            raise AssertionError(f"{self.version} schema has no {name}")
        schema = dict(self.doc)
        schema = {"$schema": self.doc["$schema"], self.key: self.doc[self.key],
                  "$ref": f"#/{self.key}/{name}"}
        errs = sorted(self.cls(schema).iter_errors(value), key=lambda e: e.path)
        if errs:
            raise AssertionError(f"{self.version} {name}: {errs[0].message} at {list(errs[0].path)}\n"
                                 f"{json.dumps(value)[:2000]}")
        validated += 1


SCHEMAS = {v: Schemas(v) for v in VERSIONS}
# Error answers without an id (parse errors) follow the newer schemas; the
# 2025-06-18 one requires an id that JSON-RPC says is unknown there.
ERROR_DEF = {"2025-06-18": "JSONRPCError", "2025-11-25": "JSONRPCErrorResponse",
             "2026-07-28": "JSONRPCErrorResponse"}
RESULT_DEF = {"initialize": "InitializeResult", "tools/list": "ListToolsResult",
              "tools/call": "CallToolResult", "server/discover": "DiscoverResult",
              "ping": "EmptyResult"}


def validate_message(version, msg, method=None):
    s = SCHEMAS[version]
    if "id" not in msg and "error" in msg:
        SCHEMAS["2025-11-25"].validate(msg, "JSONRPCErrorResponse")
        return
    s.validate(msg, "JSONRPCMessage")
    if "error" in msg:
        s.validate(msg, ERROR_DEF[version])
        code = msg["error"]["code"]
        if version == MODERN and code == -32022:
            s.validate(msg, "UnsupportedProtocolVersionError")
        if version == MODERN and code == -32020:
            s.validate(msg, "HeaderMismatchError")
    elif "method" in msg:
        s.validate(msg, "ServerNotification")
    elif method in RESULT_DEF:
        s.validate(msg["result"], RESULT_DEF[method])


def meta(version, extra=None):
    """The 2026-07-28 request envelope."""
    if version != MODERN:
        return dict(extra or {})
    m = {"io.modelcontextprotocol/protocolVersion": version,
         "io.modelcontextprotocol/clientCapabilities": {},
         "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"}}
    m.update(extra or {})
    return m


def req(rid, method, params=None, version=None, extra_meta=None):
    p = dict(params or {})
    m = meta(version, extra_meta)
    if m:
        p["_meta"] = m
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": p}


def sleepers(marker):
    want = f"sleep\0{marker}\0".encode()
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    n += f.read() == want
            except OSError:
                pass
    return n


def wait_for(pred, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# Counts `sleep MARKER` in the sandbox's own process table (the guest's under
# a VM backend): tests/common count_sleepers_cmd, passed by the harness.
COUNT_SLEEPERS = os.environ["MCP_TEST_COUNT_SLEEPERS"]
# Under TCG a cold sandbox and each exec are slow: generous, still bounded.
SANDBOX_WAIT = 120


def in_sandbox(run, marker, want):
    """Polls until `want` `sleep MARKER` processes run in the sandbox, counted
    there by `run(shell_command) -> stdout` (another execute)."""
    def count():
        out = run(COUNT_SLEEPERS.replace("MARKER", marker)).strip()
        return int(out)
    return wait_for(lambda: count() == want, SANDBOX_WAIT)


def procs_naming(text):
    """Live processes but this one whose command line contains `text` (a
    state dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except (OSError, IndexError):
                continue
            if text.encode() in cmd and not zombie:
                found.append(int(pid))
    return found


tool_outputs = {}


def check_tools(version, result):
    names = [t["name"] for t in result["tools"]]
    check(names[:2] == ["create_session", "execute"] and len(names) == 24, f"tools {names}")
    for t in result["tools"]:
        jsonschema.Draft202012Validator.check_schema(t["inputSchema"])
        jsonschema.Draft202012Validator.check_schema(t["outputSchema"])
        tool_outputs[t["name"]] = t["outputSchema"]


def check_structured(name, result):
    if not result.get("isError"):
        jsonschema.Draft202012Validator(tool_outputs[name]).validate(result["structuredContent"])


# ---- stdio ---------------------------------------------------------------------

class Stdio:
    def __init__(self, cmd):
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr)
        self.version = None
        self.lines = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            msg = json.loads(line)  # anything on stdout must be JSON-RPC
            with self.cv:
                self.lines.append(msg)
                self.cv.notify_all()

    def send_raw(self, data):
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def send(self, msg):
        self.send_raw(json.dumps(msg).encode() + b"\n")

    def recv(self, pred, timeout=30):
        end = time.time() + timeout
        with self.cv:
            while True:
                for i, m in enumerate(self.lines):
                    if pred(m):
                        return self.lines.pop(i)
                left = end - time.time()
                if left <= 0:
                    raise AssertionError(f"no matching message; have {self.lines}")
                self.cv.wait(left)

    def call(self, version, rid, method, params=None, extra_meta=None):
        self.send(req(rid, method, params, version, extra_meta))
        m = self.recv(lambda m: m.get("id") == rid)
        validate_message(version, m, method)
        return m

    def tool(self, version, rid, name, args, extra_meta=None):
        m = self.call(version, rid, "tools/call", {"name": name, "arguments": args}, extra_meta)
        check("result" in m, f"{name}: {m}")
        check_structured(name, m["result"])
        return m["result"]


def stdio_main(cmd):
    for version in VERSIONS:
        s = Stdio(cmd)
        if version != MODERN:
            m = s.call(version, 1, "initialize", {"protocolVersion": version, "capabilities": {},
                                                   "clientInfo": {"name": "raw", "version": "1"}})
            check(m["result"]["protocolVersion"] == version, f"negotiated {m}")
            s.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        else:
            m = s.call(version, 1, "server/discover", {})
            check(MODERN in m["result"]["supportedVersions"], f"discover {m}")
        m = s.call(version, 2, "tools/list", {})
        check_tools(version, m["result"])
        r = s.tool(version, 3, "create_session", {})
        sid = r["structuredContent"]["sessionId"]
        r = s.tool(version, 4, "execute", {"sessionId": sid, "command": "echo a; sleep 0.2; echo b"},
                   extra_meta={"progressToken": "tok"})
        check(r["structuredContent"]["stdout"] == "a\nb\n", f"execute {r}")
        prog = [m for m in s.lines if m.get("method") == "notifications/progress"]
        check(len(prog) >= 1, "progress notifications")
        for p in prog:
            validate_message(version, p)
            s.lines.remove(p)
        for name, args in [("write_file", {"sessionId": sid, "path": "f", "content": "x"}),
                           ("read_file", {"sessionId": sid, "path": "f"}),
                           ("list_files", {"sessionId": sid}),
                           ("list_templates", {}), ("ping", {"sessionId": sid}), ("ping", {}),
                           ("list_sessions", {}), ("reset_session", {"sessionId": sid})]:
            r = s.tool(version, 5, name, args)
            check(not r["isError"], f"{name}: {r}")
        big = s.tool(version, 60, "execute", {"sessionId": sid, "command": "head -c 3000000 /dev/zero"})
        check(big["structuredContent"]["truncated"] and len(big["structuredContent"]["stdout"]) == 2 << 20,
              "output capped at 2 MiB")
        r = s.tool(version, 6, "read_file", {"sessionId": sid, "path": "nope"})
        check(r["isError"], "tool error")
        # Signals are read as REST reads them: a string is a name ("9" is refused).
        for sig, want in [("9", "unknown signal"), (65, "out of range"), ("SIGBOGUS", "unknown signal")]:
            r = s.tool(version, 61, "kill_process", {"sessionId": sid, "procId": 1, "signal": sig})
            check(r["isError"] and want in r["content"][0]["text"], f"kill_process signal {sig!r}: {r}")
        # One process, as REST's GET .../processes/:proc shows it.
        r = s.tool(version, 62, "start_process", {"sessionId": sid, "command": "sleep", "args": ["30"],
                                                   "tag": "napper"})
        proc = r["structuredContent"]["procId"]
        r = s.tool(version, 63, "get_process", {"sessionId": sid, "procId": proc})
        p = r["structuredContent"]
        check(not r["isError"] and p["procId"] == proc and p["argv"] == ["sleep", "30"]
              and p["tag"] == "napper" and p["running"] and p["background"], f"get_process: {r}")
        r = s.tool(version, 64, "get_process", {"sessionId": sid, "procId": 999})
        check(r["isError"] and "no process 999" in r["content"][0]["text"], f"get_process unknown: {r}")
        s.tool(version, 65, "kill_process", {"sessionId": sid, "procId": proc, "signal": "KILL"})
        # Stateful-session tools (issue #21): the list validates against its
        # output schema; bad arguments are tool errors naming them.
        r = s.tool(version, 66, "list_snapshots", {})
        check(not r["isError"] and isinstance(r["structuredContent"]["snapshots"], list), f"list_snapshots: {r}")
        r = s.tool(version, 67, "fork_session", {"sessionId": sid, "count": 0})
        check(r["isError"] and "count 0 outside" in r["content"][0]["text"], f"fork_session count 0: {r}")
        r = s.tool(version, 68, "delete_snapshot", {"snapshotId": "junk"})
        check(r["isError"] and "snapshotId" in r["content"][0]["text"], f"delete_snapshot junk: {r}")
        # Protocol errors.
        s.send_raw(b'{"jsonrpc": "2.0", "id": 7, "method": \n')
        m = s.recv(lambda m: "error" in m and "id" not in m)
        validate_message(version, m)
        check(m["error"]["code"] == -32700, f"parse error {m}")
        s.send_raw(b'[{"jsonrpc":"2.0","id":8,"method":"ping"}]\n')
        m = s.recv(lambda m: "error" in m and "id" not in m)
        check(m["error"]["code"] == -32600, f"batch {m}")
        # Negotiation: a version we do not speak gets our newest handshake one.
        m = s.call("2025-11-25", 90, "initialize", {"protocolVersion": "2024-01-01", "capabilities": {},
                                                   "clientInfo": {"name": "raw", "version": "1"}})
        check(m["result"]["protocolVersion"] == "2025-11-25", f"counter-offer {m}")
        if version != MODERN:
            m = s.call(version, 91, "initialize", {"protocolVersion": version, "capabilities": {},
                                                    "clientInfo": {"name": "raw", "version": "1"}})
        m = s.call(version, 9, "no/such/method", {})
        check(m["error"]["code"] == -32601, f"unknown method {m}")
        m = s.call(version, 10, "tools/call", {"arguments": {}})
        check(m["error"]["code"] == -32602, f"missing name {m}")
        m = s.call(version, 11, "tools/call", {"name": "nope", "arguments": {}})
        check(m["error"]["code"] == -32602, f"unknown tool {m}")
        m = s.call(version, 12, "tools/call", {"name": "execute", "arguments": [1]})
        check(m["error"]["code"] == -32602, f"arguments not an object {m}")
        s.send({"jsonrpc": "2.0", "id": 13, "method": "tools/call", "params": "x"})
        m = s.recv(lambda m: m.get("id") == 13)
        validate_message(version, m)
        check(m["error"]["code"] == -32602, f"params not an object {m}")
        s.send_raw(b'{"jsonrpc":"2.0","id":14,"method":"ping","pad":"' + b"x" * (5 << 20) + b'"}\n')
        m = s.recv(lambda m: "error" in m and "id" not in m)
        check(m["error"]["code"] == -32600 and "limit" in m["error"]["message"], f"oversized {m}")
        bad = {"io.modelcontextprotocol/protocolVersion": "1999-01-01",
               "io.modelcontextprotocol/clientCapabilities": {}}
        s.send({"jsonrpc": "2.0", "id": 15, "method": "tools/list", "params": {"_meta": bad}})
        m = s.recv(lambda m: m.get("id") == 15)
        SCHEMAS[MODERN].validate(m, "UnsupportedProtocolVersionError")
        check(m["error"]["code"] == -32022 and MODERN in m["error"]["data"]["supported"], f"bad version {m}")
        # Still serving after all that.
        m = s.call(version, 16, "tools/list", {})
        check("result" in m, "still serving")
        rids = iter(range(1000, 100000))

        def run(command):
            r = s.tool(version, next(rids), "execute", {"sessionId": sid, "command": command})
            return r["structuredContent"]["stdout"]

        # notifications/cancelled for a running execute: its process goes
        # from the sandbox (counted there, by a concurrent call).
        marker = str(random.randint(200000, 900000))
        s.send(req(40, "tools/call", {"name": "execute", "arguments": {
            "sessionId": sid, "command": "sleep", "args": [marker]}}, version))
        check(in_sandbox(run, marker, 1), "long command running in the sandbox")
        s.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 40, "reason": "test"}})
        check(in_sandbox(run, marker, 0), "cancelled command gone from the sandbox")
        if LOCAL:
            check(wait_for(lambda: sleepers(marker) == 0), "cancelled command gone from the host")
        check(not any(m.get("id") == 40 and "result" in m for m in s.lines),
              "a cancelled call gets no result")
        # Disconnect mid-execute: the command and the sandbox must go.
        marker = str(random.randint(200000, 900000))
        s.send(req(17, "tools/call", {"name": "execute", "arguments": {
            "sessionId": sid, "command": "sleep", "args": [marker]}}, version))
        check(in_sandbox(run, marker, 1), "long command running in the sandbox")
        if LOCAL:
            check(sleepers(marker) == 1, "long command running on the host")
        s.p.stdin.close()
        check(s.p.wait(timeout=30) == 0, "server exits cleanly on EOF")
        if LOCAL:
            check(wait_for(lambda: sleepers(marker) == 0), "command gone after disconnect")
        # The sandbox went with the server (under a VM backend its VMM, and
        # with it the guest's process table): nothing names the state dir.
        state = cmd[cmd.index("--state-dir") + 1]
        check(wait_for(lambda: not procs_naming(state), 30),
              f"sandbox processes left after disconnect: {procs_naming(state)}")
        print(f"stdio {version}: ok")


# ---- HTTP ----------------------------------------------------------------------

class Http:
    def __init__(self, base, key):
        u = urllib.parse.urlparse(base)
        self.host, self.port, self.key = u.hostname, u.port, key
        self.sid = None

    def post(self, body, headers=None, raw=False):
        c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        if self.sid:
            h["Mcp-Session-Id"] = self.sid
        h.update(headers or {})
        h = {k: v for k, v in h.items() if v is not None}
        c.request("POST", "/mcp", body=body if raw else json.dumps(body), headers=h)
        r = c.getresponse()
        data = r.read()
        msgs = []
        if r.getheader("Content-Type", "").startswith("text/event-stream"):
            for block in data.decode().split("\n\n"):
                d = "\n".join(l[5:].lstrip() for l in block.split("\n") if l.startswith("data:"))
                if d:
                    msgs.append(json.loads(d))
        elif data:
            msgs.append(json.loads(data))
        return r, msgs

    def call(self, version, rid, method, params=None, extra_meta=None, headers=None):
        h = {"MCP-Protocol-Version": version}
        if version == MODERN:
            h["Mcp-Method"] = method
        h.update(headers or {})
        r, msgs = self.post(req(rid, method, params, version, extra_meta), h)
        for m in msgs:
            validate_message(version, m, method)
        final = [m for m in msgs if m.get("id") == rid or "error" in m]
        check(len(final) == 1, f"{method}: one answer, got {msgs}")
        return r, final[0], msgs

    def start_call(self, version, msg):
        """POSTs `msg` on a raw socket (Connection: close) and returns the
        socket, to read the SSE stream from or to drop mid-call."""
        body = json.dumps(msg).encode()
        sock = socket.create_connection((self.host, self.port), timeout=SANDBOX_WAIT)
        head = (f"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Accept: application/json, text/event-stream\r\nAuthorization: Bearer {self.key}\r\n"
                f"MCP-Protocol-Version: {version}\r\nConnection: close\r\n"
                + (f"Mcp-Session-Id: {self.sid}\r\n" if self.sid else "")
                + f"Content-Length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + body)
        return sock

    def request(self, method, headers=None):
        c = http.client.HTTPConnection(self.host, self.port, timeout=30)
        h = {"Authorization": f"Bearer {self.key}"}
        h.update(headers or {})
        c.request(method, "/mcp", headers=h)
        r = c.getresponse()
        r.read()
        return r


def http_main(base, key):
    for version in VERSIONS:
        h = Http(base, key)
        if version != MODERN:
            r, m, _ = h.call(version, 1, "initialize", {"protocolVersion": version, "capabilities": {},
                                                         "clientInfo": {"name": "raw", "version": "1"}},
                             headers={"MCP-Protocol-Version": None})
            check(m["result"]["protocolVersion"] == version, f"negotiated {m}")
            h.sid = r.getheader("Mcp-Session-Id")
            check(bool(h.sid), "Mcp-Session-Id header")
            r, _ = h.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
            check(r.status == 202, f"notification gets 202, not {r.status}")
        else:
            r, m, _ = h.call(version, 1, "server/discover", {})
            check(r.getheader("Mcp-Session-Id") is None, "stateless: no session id")
        _, m, _ = h.call(version, 2, "tools/list", {})
        check_tools(version, m["result"])
        _, m, _ = h.call(version, 3, "tools/call", {"name": "create_session", "arguments": {}},
                         headers={"Mcp-Name": "create_session"} if version == MODERN else None)
        sid = m["result"]["structuredContent"]["sessionId"]
        check_structured("create_session", m["result"])
        _, m, msgs = h.call(version, 4, "tools/call", {"name": "execute", "arguments": {
            "sessionId": sid, "command": "echo a; sleep 0.2; echo b"}}, extra_meta={"progressToken": 9})
        check(m["result"]["structuredContent"]["stdout"] == "a\nb\n", f"execute {m}")
        check(any(x.get("method") == "notifications/progress" for x in msgs), "progress over SSE")
        # Errors.
        r, msgs = h.post(b'{"jsonrpc": "2.0", "id": 5, "meth', raw=True)
        check(r.status == 400 and msgs[0]["error"]["code"] == -32700, f"parse error {r.status} {msgs}")
        validate_message(version, msgs[0])
        r, m, _ = h.call(version, 6, "no/such", {})
        check(m["error"]["code"] == -32601, f"unknown method {m}")
        check(r.status == (404 if version == MODERN else 200), f"unknown method status {r.status}")
        r, m, _ = h.call(version, 7, "tools/call", {"name": 5})
        check(m["error"]["code"] == -32602, f"bad name {m}")
        check(r.status == (400 if version == MODERN else 200), f"invalid params status {r.status}")
        r, msgs = h.post(b'{"jsonrpc":"2.0","id":8,"method":"ping","pad":"' + b"x" * (5 << 20) + b'"}',
                         raw=True)
        check(r.status == 413, f"oversized gets 413, not {r.status}")
        if version == MODERN:
            r, m, _ = h.call(version, 9, "tools/list", {}, headers={"MCP-Protocol-Version": "2025-11-25"})
            check(r.status == 400 and m["error"]["code"] == -32020, f"header mismatch {r.status} {m}")
            r, m, _ = h.call(version, 10, "tools/call", {"name": "ping", "arguments": {}},
                             headers={"Mcp-Name": "execute"})
            check(r.status == 400 and m["error"]["code"] == -32020, f"Mcp-Name mismatch {m}")
            bad = {"io.modelcontextprotocol/protocolVersion": "1999-01-01",
                   "io.modelcontextprotocol/clientCapabilities": {}}
            r, msgs = h.post({"jsonrpc": "2.0", "id": 11, "method": "tools/list", "params": {"_meta": bad}},
                             {"MCP-Protocol-Version": "1999-01-01"})
            check(r.status == 400 and msgs[0]["error"]["code"] == -32022, f"bad version {r.status} {msgs}")
            SCHEMAS[MODERN].validate(msgs[0], "UnsupportedProtocolVersionError")
        else:
            sid_saved, h.sid = h.sid, None
            r, msgs = h.post(req(12, "tools/list", {}))
            check(r.status == 400, f"missing session id gets 400, not {r.status}")
            h.sid = "0" * 32
            r, msgs = h.post(req(13, "tools/list", {}))
            check(r.status == 404, f"unknown session gets 404, not {r.status}")
            h.sid = sid_saved
        # Ownership: another key sees neither this MCP session nor its sandbox.
        c = http.client.HTTPConnection(h.host, h.port, timeout=30)
        c.request("POST", "/admin/keys", body=json.dumps({"name": "other", "scopes": ["exec"]}),
                  headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        r = c.getresponse()
        other_key = json.loads(r.read())["key"]
        other = Http(base, other_key)
        other.sid = h.sid
        if h.sid:
            r, _ = other.post(req(30, "tools/list", {}), {"MCP-Protocol-Version": version})
            check(r.status == 404, f"another key cannot use this MCP session ({r.status})")
        other.sid = None
        _, m, _ = other.call(MODERN, 31, "tools/call", {"name": "list_sessions", "arguments": {}})
        check(sid not in [x["sessionId"] for x in m["result"]["structuredContent"]["sessions"]],
              "another key does not see the sandbox")
        _, m, _ = other.call(MODERN, 32, "tools/call", {"name": "read_file", "arguments": {
            "sessionId": sid, "path": "x"}})
        check(m["result"]["isError"] and "no session" in m["result"]["content"][0]["text"],
              f"another key cannot touch the sandbox: {m}")
        # Auth, Origin, methods.
        r, _ = Http(base, None).post(req(14, "tools/list", {}, version), {"MCP-Protocol-Version": version})
        check(r.status == 401 and r.getheader("WWW-Authenticate"), f"no key gets 401, not {r.status}")
        r, _ = Http(base, "asbx_nope_nope").post(req(15, "tools/list", {}, version))
        check(r.status == 401, f"bad key gets 401, not {r.status}")
        r, _ = h.post(req(16, "tools/list", {}, version), {"Origin": "http://evil.example",
                                                           "MCP-Protocol-Version": version})
        check(r.status == 403, f"foreign origin gets 403, not {r.status}")
        check(h.request("GET").status == 405, "GET gets 405")
        # A client that disconnects mid-execute: the command dies, the
        # server keeps serving.
        marker = str(random.randint(200000, 900000))
        sock = h.start_call(version, req(17, "tools/call", {"name": "execute", "arguments": {
            "sessionId": sid, "command": "sleep", "args": [marker]}}, version))
        rids = iter(range(1000, 100000))

        def run(command):
            _, m, _ = h.call(version, next(rids), "tools/call", {"name": "execute", "arguments": {
                "sessionId": sid, "command": command}})
            return m["result"]["structuredContent"]["stdout"]

        check(in_sandbox(run, marker, 1), "long command running in the sandbox")
        if LOCAL:
            check(sleepers(marker) == 1, "long command running on the host")
        sock.close()
        check(in_sandbox(run, marker, 0), "command gone from the sandbox after the client left")
        if LOCAL:
            check(wait_for(lambda: sleepers(marker) == 0), "command gone after the client left")
        # notifications/cancelled (in the call's MCP session, or the key's
        # scope when stateless) stops a running execute: its process goes
        # from the sandbox and its stream ends without a result.
        marker = str(random.randint(200000, 900000))
        sock = h.start_call(version, req(22, "tools/call", {"name": "execute", "arguments": {
            "sessionId": sid, "command": "sleep", "args": [marker]}}, version))
        check(in_sandbox(run, marker, 1), "call to cancel running in the sandbox")
        note = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": 22, "reason": "test"}}
        if version == MODERN:
            note["params"]["_meta"] = meta(version)
        r, _ = h.post(note, {"MCP-Protocol-Version": version})
        check(r.status == 202, f"cancellation gets 202, not {r.status}")
        check(in_sandbox(run, marker, 0), "cancelled command gone from the sandbox")
        if LOCAL:
            check(wait_for(lambda: sleepers(marker) == 0), "cancelled command gone from the host")
        streamed = b""
        # To the end of the chunked stream (or the connection).
        while not streamed.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            streamed += chunk
        sock.close()
        check(b"200 OK" in streamed.split(b"\r\n", 1)[0], f"cancelled call's stream: {streamed[:200]}")
        check(b'"result"' not in streamed, f"a cancelled call gets no result: {streamed[-500:]}")
        _, m, _ = h.call(version, 18, "tools/call", {"name": "execute", "arguments": {
            "sessionId": sid, "command": "echo alive"}})
        check(m["result"]["structuredContent"]["stdout"] == "alive\n", "server and session still serve")
        if version != MODERN:
            check(h.request("DELETE", {"Mcp-Session-Id": h.sid}).status == 200, "DELETE session")
            r, _ = h.post(req(19, "tools/list", {}))
            check(r.status == 404, "deleted session is gone")
            # Its sandbox went with it.
            h2 = Http(base, key)
            _, m, _ = h2.call(MODERN, 20, "tools/call", {"name": "list_sessions", "arguments": {}})
            ids = [x["sessionId"] for x in m["result"]["structuredContent"]["sessions"]]
            check(sid not in ids, f"sandbox of a deleted MCP session destroyed: {ids}")
        else:
            _, m, _ = h.call(version, 21, "tools/call", {"name": "destroy_session", "arguments": {"sessionId": sid}})
            check(m["result"]["structuredContent"]["destroyed"], "destroy")
        print(f"http {version}: ok")


if __name__ == "__main__":
    kind = sys.argv[2]
    if kind == "stdio":
        stdio_main(sys.argv[sys.argv.index("--") + 1:])
    else:
        http_main(sys.argv[3], sys.argv[4])
    print(f"OK {checks} checks, {validated} schema validations")
