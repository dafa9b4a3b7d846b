"""Prints MCP round-trip latency: `execute` of `true` (and `ping`) over
stdio and over Streamable HTTP, p50/p99 of N calls. A benchmark, not a test.

usage: bench.py stdio N -- CMD ARGS...   |   bench.py http N BASE KEY
(start serve with a high --rate-limit/--rate-burst for the HTTP run)
"""
import http.client
import json
import subprocess
import sys
import time
import urllib.parse


def stats(name, xs):
    xs = sorted(xs)
    p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1000
    print(f"{name}: n={len(xs)} p50={p(0.5):.2f} ms p99={p(0.99):.2f} ms")


def call_args(i, name, args):
    return {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": name, "arguments": args}}


def run_stdio(n, cmd):
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def rpc(msg):
        p.stdin.write(json.dumps(msg).encode() + b"\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    rpc({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "b", "version": "1"}}})
    rpc(call_args(1, "create_session", {"sessionId": "bench"}))
    for name, args in [("ping", {}), ("execute", {"sessionId": "bench", "command": "true", "args": []})]:
        xs = []
        for i in range(n):
            t = time.perf_counter()
            r = rpc(call_args(i + 10, name, args))
            xs.append(time.perf_counter() - t)
            assert not r["result"]["isError"], r
        stats(f"stdio {name}", xs)
    p.stdin.close()
    p.wait()


def run_http(n, base, key):
    u = urllib.parse.urlparse(base)
    c = http.client.HTTPConnection(u.hostname, u.port)
    h = {"Content-Type": "application/json", "Accept": "application/json",
         "Authorization": f"Bearer {key}", "MCP-Protocol-Version": "2026-07-28"}
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {}}

    def rpc(msg):
        msg["params"]["_meta"] = meta
        c.request("POST", "/mcp", body=json.dumps(msg), headers=h)
        r = c.getresponse()
        body = r.read()
        return json.loads(body)

    rpc(call_args(1, "create_session", {"sessionId": "bench-http"}))
    for name, args in [("ping", {}), ("execute", {"sessionId": "bench-http", "command": "true", "args": []})]:
        xs = []
        for i in range(n):
            t = time.perf_counter()
            r = rpc(call_args(i + 10, name, args))
            xs.append(time.perf_counter() - t)
            assert not r["result"]["isError"], r
        stats(f"http {name}", xs)
    rpc(call_args(2, "destroy_session", {"sessionId": "bench-http"}))


if sys.argv[1] == "stdio":
    run_stdio(int(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:])
else:
    run_http(int(sys.argv[2]), sys.argv[3], sys.argv[4])
