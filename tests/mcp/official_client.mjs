// Drives agent-sandbox's MCP server with the OFFICIAL TypeScript SDK
// (@modelcontextprotocol/sdk), unmodified. Run by tests/mcp_clients.rs.
//
// usage: node official_client.mjs http URL KEY
//        node official_client.mjs stdio -- CMD ARGS...
// Prints `OK <n> checks` on success; exits non-zero on any failure.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { readdirSync, readFileSync } from "node:fs";

let checks = 0;
function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
  checks++;
}

function sleepers(marker) {
  const want = `sleep\0${marker}\0`;
  let n = 0;
  for (const pid of readdirSync("/proc")) {
    if (!/^\d+$/.test(pid)) continue;
    try {
      if (readFileSync(`/proc/${pid}/cmdline`, "latin1") === want) n++;
    } catch {}
  }
  return n;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const localProcs = process.env.MCP_TEST_LOCAL_PROCS === "1";
// Counts `sleep MARKER` in the sandbox's own process table (the guest's
// under a VM backend): tests/common count_sleepers_cmd, from the harness.
const countSleepers = process.env.MCP_TEST_COUNT_SLEEPERS;

// Polls (bounded: a cold sandbox under TCG is slow) until `want` processes
// `sleep <marker>` run inside session `sid`, counted there by another call.
async function inSandbox(client, sid, marker, want) {
  const end = Date.now() + 120000;
  let n;
  do {
    const r = await client.callTool({
      name: "execute",
      arguments: { sessionId: sid, command: countSleepers.replace("MARKER", marker) },
    });
    n = Number(r.structuredContent.stdout.trim());
    if (n === want) return true;
    await sleep(100);
  } while (Date.now() < end);
  return false;
}

async function scenario(client) {
  const tools = (await client.listTools()).tools.map((t) => t.name);
  check(tools[0] === "create_session" && tools[1] === "execute" && tools.length === 24, `tools ${tools}`);

  let r = await client.callTool({ name: "create_session", arguments: {} });
  check(!r.isError, `create_session ${JSON.stringify(r)}`);
  const sid = r.structuredContent.sessionId;

  const progress = [];
  r = await client.callTool(
    // The SDK hands notifications to handlers asynchronously: a response in
    // the same read would overtake them, so the command lingers a moment.
    { name: "execute", arguments: { sessionId: sid, command: "sh", args: ["-c", "echo hi there; sleep 0.5"] } },
    undefined,
    { onprogress: (p) => progress.push(p) },
  );
  check(r.structuredContent.stdout === "hi there\n" && r.structuredContent.exitCode === 0, `execute ${JSON.stringify(r)}`);
  check(progress.length >= 1, "progress notification");

  r = await client.callTool({ name: "write_file", arguments: { sessionId: sid, path: "x/y.txt", content: "data 1\n" } });
  check(!r.isError, `write_file ${JSON.stringify(r)}`);
  r = await client.callTool({ name: "read_file", arguments: { sessionId: sid, path: "x/y.txt" } });
  check(r.structuredContent.content === "data 1\n", `read_file ${JSON.stringify(r)}`);

  // Cancel a long execute with an AbortSignal (sends notifications/cancelled).
  const marker = String(200000 + Math.floor(Math.random() * 700000));
  const ac = new AbortController();
  const pending = client
    .callTool({ name: "execute", arguments: { sessionId: sid, command: "sleep", args: [marker] } }, undefined, {
      signal: ac.signal,
      timeout: 120000,
    })
    .then(() => "finished", (e) => `rejected: ${e}`);
  check(await inSandbox(client, sid, marker, 1), "long command running in the sandbox");
  if (localProcs) check(sleepers(marker) === 1, "long command running on the host");
  ac.abort("test cancels");
  const outcome = await pending;
  check(outcome.startsWith("rejected"), `aborted call: ${outcome}`);
  check(await inSandbox(client, sid, marker, 0), "cancelled command gone from the sandbox");
  if (localProcs) {
    for (let i = 0; i < 200 && sleepers(marker) > 0; i++) await sleep(50);
    check(sleepers(marker) === 0, "cancelled command gone from the host");
  }

  r = await client.callTool({ name: "destroy_session", arguments: { sessionId: sid } });
  check(r.structuredContent.destroyed === true, "destroy_session");
  r = await client.callTool({ name: "list_sessions", arguments: {} });
  check(!r.structuredContent.sessions.some((s) => s.sessionId === sid), "session gone");
}

const [kind, ...rest] = process.argv.slice(2);
let transport;
if (kind === "http") {
  const [url, key] = rest;
  transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${key}` } },
  });
} else {
  const cmd = rest.slice(rest.indexOf("--") + 1);
  transport = new StdioClientTransport({ command: cmd[0], args: cmd.slice(1), env: process.env, stderr: "inherit" });
}
const client = new Client({ name: "agent-sandbox-test", version: "1.0.0" });
await client.connect(transport);
try {
  await scenario(client);
  const v = transport.protocolVersion ?? "(stdio)";
  console.log(`OK ${checks} checks, protocol ${v}`);
} finally {
  await client.close();
}
