"""Drive agent-sandbox's stdio MCP server with the official Python SDK.

Usage: mcp-check COMMAND [ARG...]   (the MCP server command, e.g. agent-sandbox-mcp)
The server inherits this process's environment (AGENT_SANDBOX_API_KEY).
Creates a session, runs a command in it, checks the output, destroys it.
"""
import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def result_text(res):
    if res.structuredContent:
        return json.dumps(res.structuredContent)
    return "".join(c.text for c in res.content if c.type == "text")


async def main(argv):
    params = StdioServerParameters(command=argv[0], args=argv[1:], env=dict(os.environ))
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            tools = {t.name for t in (await s.list_tools()).tools}
            want = {"create_session", "execute", "destroy_session"}
            assert want <= tools, f"missing tools: {want - tools}"

            res = await s.call_tool("create_session", {"template": "base"})
            assert not res.isError, result_text(res)
            if res.structuredContent:
                sid = res.structuredContent["sessionId"]
            else:
                sid = json.loads(result_text(res))["sessionId"]

            res = await s.call_tool(
                "execute",
                {"sessionId": sid, "command": "sh", "args": ["-c", "echo hello-from-mcp; uname -r"]},
            )
            out = result_text(res)
            assert not res.isError, out
            assert "hello-from-mcp" in out, out
            assert "agent-sandbox" in out, f"guest kernel is not ours: {out}"

            res = await s.call_tool("destroy_session", {"sessionId": sid})
            assert not res.isError, result_text(res)
    print("mcp-check: ok")


asyncio.run(main(sys.argv[1:]))
