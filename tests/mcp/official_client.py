"""Drives agent-sandbox's MCP server with the OFFICIAL Python SDK (`mcp`),
unmodified. Run by tests/mcp_clients.rs.

usage: official_client.py stdio MODE -- CMD ARGS...
       official_client.py http MODE URL KEY
MODE: legacy (initialize handshake) | auto | 2026-07-28 (stateless)
Prints `OK <n> checks` on success; any failure raises.
"""
import base64
import os
import random
import sys
import time

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

EXPECTED_TOOLS = [
    "create_session", "execute", "run_code", "list_templates", "write_file", "read_file",
    "list_files", "ping", "reset_session", "list_sessions", "destroy_session",
    "start_process", "read_process", "write_process", "kill_process", "kill_all_processes",
    "get_process", "pause_session", "resume_session", "checkpoint_session", "fork_session",
    "list_snapshots", "delete_snapshot", "expose_port",
]
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def sleepers(marker):
    """Live `sleep <marker>` processes on this host (the local-process
    backend runs the guest agent here; with VMs the test skips this)."""
    want = f"sleep\0{marker}\0".encode()
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == want:
                    n += 1
        except OSError:
            pass
    return n


# Counts `sleep MARKER` in the sandbox's own process table (the guest's under
# a VM backend): tests/common count_sleepers_cmd, passed by the harness.
COUNT_SLEEPERS = os.environ["MCP_TEST_COUNT_SLEEPERS"]


async def in_sandbox(client, sid, marker, want):
    """Polls (bounded: a cold sandbox under TCG is slow) until `want`
    processes `sleep <marker>` run inside session `sid`, counted there by
    another call."""
    deadline = time.time() + 120
    while True:
        r = await client.call_tool("execute", {"sessionId": sid,
                                               "command": COUNT_SLEEPERS.replace("MARKER", marker)})
        if int(r.structured_content["stdout"].strip()) == want:
            return True
        if time.time() > deadline:
            return False
        await anyio.sleep(0.1)


async def scenario(client, local_procs):
    names = [t.name for t in (await client.list_tools()).tools]
    check(names == EXPECTED_TOOLS, f"tool order: {names}")

    r = await client.call_tool("create_session", {})
    check(not r.is_error, f"create_session: {r.content}")
    sid = r.structured_content["sessionId"]
    check(bool(sid), "sessionId")

    progress = []

    async def on_progress(p, total, message):
        progress.append((p, message))

    r = await client.call_tool(
        "execute",
        {"sessionId": sid, "command": "sh", "args": ["-c", "echo hello; echo oops >&2; exit 3"]},
        progress_callback=on_progress,
    )
    check(not r.is_error, f"execute: {r.content}")
    s = r.structured_content
    check(s["stdout"] == "hello\n" and s["stderr"] == "oops\n" and s["exitCode"] == 3, f"execute result {s}")
    check(len(progress) >= 1, f"progress notifications: {progress}")

    r = await client.call_tool("execute", {"sessionId": sid, "command": "echo $((6*7))"})
    check(r.structured_content["stdout"] == "42\n", f"shell command: {r.structured_content}")

    r = await client.call_tool("write_file", {"sessionId": sid, "path": "dir/a.txt", "content": "héllo\n"})
    check(not r.is_error and r.structured_content["bytes"] == 7, f"write_file: {r.content}")
    r = await client.call_tool("read_file", {"sessionId": sid, "path": "dir/a.txt"})
    check(r.structured_content["content"] == "héllo\n", f"read_file: {r.structured_content}")

    blob = bytes(range(256))
    r = await client.call_tool("write_file", {"sessionId": sid, "path": "bin.dat",
                                              "content": base64.b64encode(blob).decode(), "encoding": "base64"})
    check(not r.is_error, f"write binary: {r.content}")
    r = await client.call_tool("read_file", {"sessionId": sid, "path": "bin.dat"})
    check(r.structured_content["encoding"] == "base64", "binary read is base64")
    res = [c for c in r.content if c.type == "resource"]
    check(len(res) == 1 and base64.b64decode(res[0].resource.blob) == blob, "binary as a resource blob")

    r = await client.call_tool("list_files", {"sessionId": sid, "recursive": True})
    paths = sorted(f["path"] for f in r.structured_content["files"])
    check("dir/a.txt" in paths and "bin.dat" in paths, f"list_files: {paths}")

    r = await client.call_tool("read_file", {"sessionId": sid, "path": "missing.txt"})
    check(r.is_error and "missing.txt" in r.content[0].text, "missing file is a tool error")
    r = await client.call_tool("execute", {"sessionId": sid})
    check(r.is_error and "command" in r.content[0].text, "missing argument is a tool error")

    # Background process: start, write stdin, read output, kill.
    r = await client.call_tool("start_process", {"sessionId": sid, "command": "cat"})
    check(not r.is_error, f"start_process: {r.content}")
    proc = r.structured_content["procId"]
    await client.call_tool("write_process", {"sessionId": sid, "procId": proc, "input": "ping\n"})
    out = ""
    for _ in range(20):
        r = await client.call_tool("read_process", {"sessionId": sid, "procId": proc, "waitMs": 200})
        out = r.structured_content["stdout"]
        if "ping" in out:
            break
    check(out == "ping\n" and r.structured_content["running"], f"read_process: {r.structured_content}")
    off = r.structured_content["nextOffset"]
    r = await client.call_tool("kill_process", {"sessionId": sid, "procId": proc, "signal": "KILL"})
    check(not r.is_error, f"kill_process: {r.content}")
    for _ in range(20):
        r = await client.call_tool("read_process", {"sessionId": sid, "procId": proc, "offset": off})
        if not r.structured_content["running"]:
            break
    check(not r.structured_content["running"] and r.structured_content["signal"] == "SIGKILL",
          f"killed: {r.structured_content}")

    # Kill everything: a background process ends as SIGKILLed.
    r = await client.call_tool("start_process", {"sessionId": sid, "command": "sleep", "args": ["600"]})
    check(not r.is_error, f"start_process: {r.content}")
    proc = r.structured_content["procId"]
    r = await client.call_tool("kill_all_processes", {"sessionId": sid})
    check(not r.is_error and r.structured_content["killed"] >= 1
          and r.structured_content["remaining"] == 0, f"kill_all_processes: {r.content}")
    for _ in range(50):
        r = await client.call_tool("read_process", {"sessionId": sid, "procId": proc})
        if not r.structured_content["running"]:
            break
        await anyio.sleep(0.1)
    check(not r.structured_content["running"] and r.structured_content["signal"] == "SIGKILL",
          f"after kill_all_processes: {r.structured_content}")

    # Cancel a long execute: the process must be gone afterwards.
    marker = str(random.randint(200000, 900000))
    with anyio.move_on_after(150) as scope:
        async with anyio.create_task_group() as tg:
            async def long_call():
                await client.call_tool("execute", {"sessionId": sid, "command": "sleep", "args": [marker]})
            tg.start_soon(long_call)
            check(await in_sandbox(client, sid, marker, 1), "long command running in the sandbox")
            if local_procs:
                check(sleepers(marker) == 1, "long command running on the host")
            tg.cancel_scope.cancel()
    check(not scope.cancelled_caught, "cancel did not hang")
    if local_procs:
        deadline = time.time() + 10
        while sleepers(marker) and time.time() < deadline:
            await anyio.sleep(0.05)
        check(sleepers(marker) == 0, "cancelled command is gone")
    # Seen from inside the sandbox (the check that counts with a VM
    # backend, where the host cannot see guest processes).
    check(await in_sandbox(client, sid, marker, 0), "cancelled command gone from the sandbox")
    r = await client.call_tool("execute", {"sessionId": sid, "command": "echo still-here"})
    check(r.structured_content["stdout"] == "still-here\n", "session usable after a cancel")

    r = await client.call_tool("list_sessions", {})
    check(sid in [x["sessionId"] for x in r.structured_content["sessions"]], "list_sessions")
    r = await client.call_tool("destroy_session", {"sessionId": sid})
    check(r.structured_content["destroyed"], "destroy_session")
    r = await client.call_tool("list_sessions", {})
    check(sid not in [x["sessionId"] for x in r.structured_content["sessions"]], "gone after destroy")
    r = await client.call_tool("execute", {"sessionId": "bad id!", "command": "true"})
    check(r.is_error, "invalid session id is a tool error")
    # Left running on purpose: the server must clean it up when this
    # client goes (the Rust test checks).
    r = await client.call_tool("create_session", {})
    check(not r.is_error, "leftover session")


async def main():
    kind, mode = sys.argv[1], sys.argv[2]
    if kind == "stdio":
        cmd = sys.argv[sys.argv.index("--") + 1:]
        server = StdioServerParameters(command=cmd[0], args=cmd[1:], env=dict(os.environ))
        local_procs = os.environ.get("MCP_TEST_LOCAL_PROCS") == "1"
        async with Client(server, mode=mode) as c:
            await scenario(c, local_procs)
            proto = c.protocol_version
    else:
        url, key = sys.argv[3], sys.argv[4]
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                  timeout=httpx2.Timeout(30, read=300))
        local_procs = os.environ.get("MCP_TEST_LOCAL_PROCS") == "1"
        async with http:
            async with Client(streamable_http_client(url, http_client=http), mode=mode) as c:
                await scenario(c, local_procs)
                proto = c.protocol_version
    print(f"OK {checks} checks, protocol {proto}")


anyio.run(main)
