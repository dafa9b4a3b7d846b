import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";
import {
  AtCapacity, BodyTooLarge, Client, ConnectionError, ERROR_CLASSES, FileNotFound, InvalidPath, QuotaExceeded,
  RateLimited, Sandbox, SandboxError, SessionNotFound, errorFromBody,
} from "../dist/index.js";
import { client, fileSandbox } from "./_helpers.mjs";

// --- The mapping and the retry policy, against a fake fetch (no daemon). ---

test("every code has its class, named after it, carrying status, code, message", () => {
  for (const [code, Class] of Object.entries(ERROR_CLASSES)) {
    const e = errorFromBody(418, { error: { code, message: `m ${code}` } }, 2);
    assert.ok(e instanceof Class && e instanceof SandboxError && e instanceof Error, code);
    assert.equal(e.name, Class.name);
    assert.equal(e.code, code);
    assert.equal(e.status, 418);
    assert.equal(e.message, `m ${code}`);
    assert.equal(e.retryAfter, 2);
  }
  // The seed routes' shape, and a code this SDK does not know.
  const seed = errorFromBody(404, { error: 'no session "x"', code: "session_not_found" });
  assert.ok(seed instanceof SessionNotFound);
  assert.equal(seed.message, 'no session "x"');
  const other = errorFromBody(500, { error: { code: "brand_new", message: "?" } });
  assert.equal(other.constructor, SandboxError);
  assert.equal(new RateLimited("slow down", 429, "rate_limited").retryAfter, 1);
});

test("the codes the daemon documents all have a class", () => {
  // docs/api.md and the daemon's error table (src/api/errors.rs), where present.
  const src = new URL("../../../src/api/errors.rs", import.meta.url);
  let text;
  try {
    text = readFileSync(src, "utf8");
  } catch {
    return; // installed outside the repository
  }
  const codes = new Set([...text.matchAll(/\(\d{3}, "([a-z_]+)"\)|"\d{3} ([a-z_]+) /g)].map((m) => m[1] ?? m[2]));
  assert.ok(codes.size > 20, `found ${codes.size} codes`);
  for (const c of codes) assert.ok(ERROR_CLASSES[c], `no class for ${c}`);
});

/** A fetch answering `answers` in turn, counting calls. */
function fakeFetch(answers) {
  const calls = [];
  const f = async (url, init) => {
    calls.push({ url: String(url), init });
    const [status, body, headers = {}] = answers[Math.min(calls.length - 1, answers.length - 1)];
    return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json", ...headers } });
  };
  return { f, calls };
}

const limited = [429, { error: { code: "rate_limited", message: "slow" } }, { "retry-after": "0" }];
const ok = [200, { sessions: [] }];

test("retries 429 and 503 on idempotent calls, with the key and backoff", async () => {
  const { f, calls } = fakeFetch([limited, [503, { error: { code: "at_capacity", message: "full" } }], ok]);
  const c = new Client({ url: "http://sdk.test/", apiKey: "k1", fetch: f, retry: { baseDelayMs: 1 } });
  assert.deepEqual(await Sandbox.list(c), []);
  assert.equal(calls.length, 3);
  assert.equal(calls[0].url, "http://sdk.test/v1/sessions");
  assert.equal(calls[0].init.headers.authorization, "Bearer k1");
});

test("does not retry a non-idempotent call, a quota error, or with retry: false", async () => {
  let fake = fakeFetch([limited, ok]);
  let c = new Client({ url: "http://sdk.test", fetch: fake.f, retry: { baseDelayMs: 1 } });
  const sb = new Sandbox(c, { id: "s1" });
  await assert.rejects(sb.commands.run("true"), (e) => e instanceof RateLimited && e.retryAfter === 0 && e.status === 429);
  assert.equal(fake.calls.length, 1);

  fake = fakeFetch([[429, { error: { code: "quota_exceeded", message: "1 session" } }], ok]);
  c = new Client({ url: "http://sdk.test", fetch: fake.f, retry: { baseDelayMs: 1 } });
  await assert.rejects(Sandbox.list(c), QuotaExceeded);
  assert.equal(fake.calls.length, 1);

  fake = fakeFetch([[503, { error: { code: "at_capacity", message: "full" } }, { "retry-after": "5" }], ok]);
  c = new Client({ url: "http://sdk.test", fetch: fake.f, retry: false });
  await assert.rejects(Sandbox.list(c), (e) => e instanceof AtCapacity && e.retryAfter === 5);
  assert.equal(fake.calls.length, 1);
});

test("a create is retried only with an id; a streamed upload never", async () => {
  const busy = [503, { error: { code: "at_capacity", message: "full" } }, { "retry-after": "0" }];
  const session = [201, { id: "fixed", state: "ready" }];
  let fake = fakeFetch([busy, session]);
  const c = (f) => new Client({ url: "http://sdk.test", fetch: f, retry: { baseDelayMs: 1 } });
  assert.equal((await Sandbox.create({ client: c(fake.f), id: "fixed" })).id, "fixed");
  assert.equal(fake.calls.length, 2);
  fake = fakeFetch([busy, session]);
  await assert.rejects(Sandbox.create({ client: c(fake.f) }), AtCapacity);
  assert.equal(fake.calls.length, 1);
  fake = fakeFetch([busy, [201, { path: "/x", bytes: 1 }]]);
  const sb = new Sandbox(c(fake.f), { id: "s1" });
  assert.deepEqual(await sb.files.write("/x", new Uint8Array([1])), { path: "/x", bytes: 1 }); // bytes: retried
  assert.equal(fake.calls.length, 2);
  fake = fakeFetch([busy, [201, { path: "/x", bytes: 1 }]]);
  const stream = new ReadableStream({ start: (ctl) => (ctl.enqueue(new Uint8Array([1])), ctl.close()) });
  await assert.rejects(new Sandbox(c(fake.f), { id: "s1" }).files.write("/x", stream), AtCapacity);
  assert.equal(fake.calls.length, 1);
  assert.equal(fake.calls[0].init.duplex, "half");
});

test("gives up after `retries`, and when Retry-After is over maxDelayMs", async () => {
  let fake = fakeFetch([limited]);
  await assert.rejects(Sandbox.list(new Client({ url: "http://sdk.test", fetch: fake.f, retry: { retries: 2, baseDelayMs: 1 } })), RateLimited);
  assert.equal(fake.calls.length, 3);
  fake = fakeFetch([[429, { error: { code: "rate_limited", message: "slow" } }, { "retry-after": "60" }]]);
  await assert.rejects(Sandbox.list(new Client({ url: "http://sdk.test", fetch: fake.f, retry: { maxDelayMs: 1000 } })), RateLimited);
  assert.equal(fake.calls.length, 1);
});

test("config from AGENT_SANDBOX_URL / AGENT_SANDBOX_API_KEY, options first; no daemon is ConnectionError", async () => {
  const saved = { url: process.env.AGENT_SANDBOX_URL, key: process.env.AGENT_SANDBOX_API_KEY };
  try {
    process.env.AGENT_SANDBOX_URL = "http://env.test:1/";
    process.env.AGENT_SANDBOX_API_KEY = "envkey";
    const { f, calls } = fakeFetch([ok]);
    await Sandbox.list({ fetch: f });
    assert.equal(calls[0].url, "http://env.test:1/v1/sessions");
    assert.equal(calls[0].init.headers.authorization, "Bearer envkey");
    assert.equal(new Client({ url: "http://opt.test" }).url, "http://opt.test");
  } finally {
    process.env.AGENT_SANDBOX_URL = saved.url;
    process.env.AGENT_SANDBOX_API_KEY = saved.key;
  }
  await assert.rejects(Sandbox.list({ url: "http://127.0.0.1:9" }), (e) => e instanceof ConnectionError && e.status === 0);
});

// --- Against the daemon. ---

const ref = fileSandbox();

test("daemon: unknown session, bad path, missing file, over-limit body are their classes", async () => {
  const ghost = new Sandbox(client, { id: "no-such-session" });
  await assert.rejects(ghost.commands.run("true"), (e) => e instanceof SessionNotFound && e.status === 404 && e.code === "session_not_found" && /no-such-session/.test(e.message));
  await assert.rejects(Sandbox.connect("no-such-session", { client }), SessionNotFound);
  await assert.rejects(ref.sb.files.read("a\0b"), (e) => e instanceof InvalidPath && e.status === 400);
  await assert.rejects(ref.sb.files.read(""), InvalidPath);
  await assert.rejects(ref.sb.files.stat("/no/such/file"), (e) => e instanceof FileNotFound && e.status === 404);
  // A JSON body over --max-body (1 MiB): refused from its Content-Length.
  await assert.rejects(ref.sb.commands.run("cat", { stdin: "x".repeat(2 * 1024 * 1024) }), (e) => e instanceof BodyTooLarge && e.status === 413);
});

const rateUrl = process.env.AGENT_SANDBOX_RATE_URL;
test("daemon: over the rate limit is RateLimited with retryAfter; retried calls get through", { skip: !rateUrl && "AGENT_SANDBOX_RATE_URL (a daemon with a low --rate-limit) not set" }, async () => {
  const opts = { url: rateUrl, apiKey: process.env.AGENT_SANDBOX_RATE_KEY };
  const noRetry = new Client({ ...opts, retry: false });
  let err;
  for (let i = 0; i < 50 && !err; i++) {
    await Sandbox.list(noRetry).catch((e) => (err = e));
  }
  assert.ok(err instanceof RateLimited, `no 429 in 50 calls: ${err}`);
  assert.equal(err.status, 429);
  assert.equal(err.code, "rate_limited");
  assert.ok(err.retryAfter >= 1, `retryAfter ${err.retryAfter}`);
  // The bucket is empty now: a retrying client waits Retry-After and gets through.
  const retrying = new Client({ ...opts, retry: { retries: 5 } });
  assert.ok(Array.isArray(await Sandbox.list(retrying)));
});
