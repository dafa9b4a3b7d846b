// A seed client, written against docs/api.md "Seed compatibility": only
// `fetch` (as the seed's TypeScript SDK uses it), JSON bodies, NDJSON
// streaming of execute read line by line from the response body.
//
// Usage: node seed_client.js <base URL> <admin API key>
// Exits 0 when every check held; prints the failed check and exits 1 else.

declare const process: { argv: string[]; exit(code: number): never };

const [base, adminKey] = process.argv.slice(2);
const SESSION = "ts-session";
let checks = 0;

function check(cond: unknown, what: string, seen?: unknown): void {
  checks++;
  if (!cond) {
    throw new Error(`check failed: ${what}${seen === undefined ? "" : `: ${JSON.stringify(seen)}`}`);
  }
}

interface ErrorBody {
  error: string;
  code?: string;
}

interface OutputEntry {
  stream: "stdout" | "stderr";
  data: string;
  ts: number;
}

interface ExecResult {
  exitCode: number;
  timedOut: boolean;
  output: OutputEntry[];
}

interface KeyRecord {
  id: string;
  name: string;
  keyPrefix: string;
  scopes: string[];
  rateLimit: { requestsPerSecond: number; burst: number };
  createdAt: number;
  expiresAt: number | null;
  enabled: boolean;
}

interface SessionInfo {
  id: string;
  state: "creating" | "active" | "destroying";
  createdAt: number;
  lastActivityAt: number;
  ownerId?: string;
  templateName?: string;
}

async function call<T>(method: string, path: string, body?: unknown, key = adminKey): Promise<{ status: number; json: T }> {
  const res = await fetch(base + path, {
    method,
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  return { status: res.status, json: JSON.parse(text) as T };
}

function stdout(r: ExecResult): string {
  return r.output.filter((o) => o.stream === "stdout").map((o) => o.data).join("");
}

/// POST .../execute with Accept: application/x-ndjson; the objects as they arrive.
async function executeStream(session: string, body: unknown): Promise<Record<string, unknown>[]> {
  const res = await fetch(`${base}/exec/${session}/execute`, {
    method: "POST",
    headers: {
      "Content-Type": "application/json",
      Accept: "application/x-ndjson",
      Authorization: `Bearer ${adminKey}`,
    },
    body: JSON.stringify(body),
  });
  check(res.status === 200, "ndjson execute status", res.status);
  check((res.headers.get("content-type") ?? "").includes("application/x-ndjson"), "ndjson content type");
  const reader = res.body!.getReader();
  const decoder = new TextDecoder();
  const events: Record<string, unknown>[] = [];
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let nl: number;
    while ((nl = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, nl).trim();
      buf = buf.slice(nl + 1);
      if (line) events.push(JSON.parse(line) as Record<string, unknown>);
    }
  }
  check(buf.trim() === "", "stream ends with a newline", buf);
  return events;
}

async function main(): Promise<void> {
  // Operations.
  const health = await fetch(`${base}/health`).then((r) => r.json() as Promise<{ status: string; uptime: number }>);
  check(health.status === "ok" && typeof health.uptime === "number", "health", health);
  const readyRes = await fetch(`${base}/ready`);
  const ready = (await readyRes.json()) as { status: string; checks: Record<string, unknown> };
  check(readyRes.status === 200 && ready.status === "ready", "ready", ready);
  check(typeof ready.checks === "object" && Object.keys(ready.checks).length > 0, "ready checks", ready);

  // The README's first example: no template named.
  const first = await call<ExecResult>("POST", `/exec/${SESSION}/execute`, {
    command: "node",
    args: ["-e", "console.log(1+1)"],
  });
  check(first.status === 200, "execute status", first);
  check(first.json.exitCode === 0 && first.json.timedOut === false, "execute exit", first.json);
  check(stdout(first.json) === "2\n", "execute stdout", first.json);

  // Streaming.
  const events = await executeStream(SESSION, {
    command: "node",
    args: ["-e", "for (let i = 0; i < 3; i++) console.log('line' + i); console.error('err')"],
  });
  const streamed = events
    .filter((e) => e.type === "stream" && e.stream === "stdout")
    .map((e) => e.data as string)
    .join("");
  check(streamed === "line0\nline1\nline2\n", "streamed stdout", events);
  check(events.some((e) => e.type === "stream" && e.stream === "stderr" && e.data === "err\n"), "streamed stderr", events);
  const last = events[events.length - 1];
  check(last.type === "result" && last.exitCode === 0 && last.timedOut === false, "stream result line", last);

  // Files.
  const w = await call<{ bytesWritten: number }>("POST", `/exec/${SESSION}/write`, {
    path: "/workspace/hello.js",
    content: "console.log('hello from a file')\n",
  });
  check(w.status === 200 && w.json.bytesWritten === 33, "write", w);
  const ran = await call<ExecResult>("POST", `/exec/${SESSION}/execute`, { command: "node", args: ["/workspace/hello.js"] });
  check(stdout(ran.json) === "hello from a file\n", "run the written file", ran.json);
  const rd = await call<{ content: string }>("GET", `/exec/${SESSION}/read?path=/workspace/hello.js`);
  check(rd.status === 200 && rd.json.content === "console.log('hello from a file')\n", "read", rd);
  await call("POST", `/exec/${SESSION}/execute`, { command: "mkdir -p /workspace/src" });
  const ls = await call<{ files: { path: string; type: "file" | "dir"; size: number }[] }>(
    "GET",
    `/exec/${SESSION}/files?path=/workspace`,
  );
  check(ls.status === 200, "files status", ls);
  const hello = ls.json.files.find((f) => f.path.endsWith("hello.js"));
  check(hello?.type === "file" && hello.size === 33, "files: the file", ls.json);
  const dir = ls.json.files.find((f) => f.path.endsWith("src"));
  check(dir?.type === "dir" && typeof dir.size === "number", "files: the dir", ls.json);

  // Errors: a readable message in `error`.
  const missing = await call<ErrorBody>("GET", `/exec/${SESSION}/read?path=/workspace/nope.txt`);
  check(missing.status === 404 && typeof missing.json.error === "string" && missing.json.error.length > 0, "404 error", missing);
  const unauth = await call<ErrorBody>("GET", "/exec/", undefined, "not-a-key");
  check(unauth.status === 401 && typeof unauth.json.error === "string", "401 error", unauth);

  // Sessions.
  const list = await call<{ sessions: SessionInfo[] }>("GET", "/exec/");
  const mine = list.json.sessions.find((s) => s.id === SESSION);
  check(mine?.state === "active", "listed session", list.json);
  check(typeof mine?.createdAt === "number" && typeof mine?.lastActivityAt === "number", "session times", mine);
  check(mine!.lastActivityAt >= mine!.createdAt, "lastActivityAt after createdAt", mine);

  // Keys.
  const expiresAt = Date.now() + 3_600_000;
  const created = await call<{ key: string; record: KeyRecord }>("POST", "/admin/keys", {
    name: "ts-client",
    scopes: ["exec"],
    expiresAt,
  });
  check(created.status === 201 && typeof created.json.key === "string", "create key", created);
  const rec = created.json.record;
  check(rec.name === "ts-client" && rec.enabled === true && rec.expiresAt === expiresAt, "key record", rec);
  check(created.json.key.startsWith(rec.keyPrefix) && typeof rec.createdAt === "number", "key prefix", rec);
  check(Array.isArray(rec.scopes) && typeof rec.rateLimit === "object", "key scopes and rate", rec);
  const asNew = await call<{ sessions: SessionInfo[] }>("GET", "/exec/", undefined, created.json.key);
  check(asNew.status === 200 && asNew.json.sessions.length === 0, "the new key works", asNew);
  const keys = await call<{ keys: KeyRecord[] }>("GET", "/admin/keys");
  check(keys.json.keys.some((k) => k.id === rec.id && k.expiresAt === expiresAt), "key listed", keys.json);
  const rotated = await call<{ key: string; record: KeyRecord }>("POST", `/admin/keys/${rec.id}/rotate`);
  check(rotated.status === 200 && rotated.json.key !== created.json.key && rotated.json.record.id === rec.id, "rotate", rotated);
  const revoked = await call<{ revoked: boolean; record: KeyRecord }>("POST", `/admin/keys/${rec.id}/revoke`);
  check(revoked.status === 200 && revoked.json.revoked === true && revoked.json.record.enabled === false, "revoke", revoked);
  const deleted = await call<{ deleted: boolean }>("DELETE", `/admin/keys/${rec.id}`);
  check(deleted.status === 200 && deleted.json.deleted === true, "delete key", deleted);

  // Destroy, twice.
  const del = await call<{ destroyed: boolean }>("DELETE", `/exec/${SESSION}`);
  check(del.status === 200 && del.json.destroyed === true, "destroy", del);
  const again = await call<{ destroyed: boolean }>("DELETE", `/exec/${SESSION}`);
  check(again.status === 200 && again.json.destroyed === false, "destroy again", again);

  console.log(`OK seed client: all ${checks} checks held`);
}

main().catch((e: unknown) => {
  console.error(e instanceof Error ? e.message : e);
  process.exit(1);
});
