import assert from "node:assert/strict";
import { test } from "node:test";
import { Client, EgressNotApplied, KeyNotFound, KeyRevoked, Keys, Sandbox, SessionNotFound, Unauthorized, run } from "../dist/index.js";
import { TEMPLATE, client, fileSandbox } from "./_helpers.mjs";

test("keys: create, list, use, rotate, revoke, delete", async () => {
  const keys = new Keys(client);
  const made = await keys.create({ name: `sdk-ts-${process.pid}`, scopes: ["exec"], rateLimit: { requestsPerSecond: 50, burst: 100 } });
  assert.match(made.key, /^asbx_/);
  assert.equal(made.record.name, `sdk-ts-${process.pid}`);
  assert.deepEqual(made.record.scopes, ["exec"]);
  assert.equal(made.record.rateLimit.requestsPerSecond, 50);
  assert.ok((await keys.list()).some((k) => k.id === made.record.id && k.enabled));
  const own = new Client({ url: client.url, apiKey: made.key });
  assert.deepEqual(await Sandbox.list(own), []); // its own (empty) namespace
  const rotated = await keys.rotate(made.record.id);
  assert.notEqual(rotated.key, made.key);
  assert.equal(rotated.record.id, made.record.id);
  await assert.rejects(Sandbox.list(own), Unauthorized);
  const revoked = await keys.revoke(made.record.id);
  assert.equal(revoked.enabled, false);
  await assert.rejects(keys.rotate(made.record.id), KeyRevoked);
  await keys.delete(made.record.id);
  await assert.rejects(keys.delete(made.record.id), KeyNotFound);
  assert.ok(!(await keys.list()).some((k) => k.id === made.record.id));
});

test("an admin key reaches another key's session with owner", async () => {
  const keys = new Keys(client);
  const other = await keys.create({ name: `sdk-ts-owner-${process.pid}` });
  try {
    const theirs = await Sandbox.create({ url: client.url, apiKey: other.key, template: TEMPLATE });
    await theirs.files.write("mine.txt", "theirs");
    await assert.rejects(Sandbox.connect(theirs.id, { client }), SessionNotFound); // not ours without owner
    const listed = (await Sandbox.list(client)).find((s) => s.id === theirs.id);
    assert.equal(listed?.owner, other.record.id);
    const asAdmin = await Sandbox.connect(theirs.id, { client, owner: other.record.id });
    assert.equal(await asAdmin.files.read("mine.txt"), "theirs");
    assert.equal(await asAdmin.kill(), true);
    assert.equal(await theirs.kill(), false);
  } finally {
    await keys.delete(other.record.id);
  }
});

test("run: one program in a sandbox of its own", async () => {
  const r = await run("python", "import sys; print(6 * 7); print('e', file=sys.stderr); sys.exit(2)", { timeoutMs: 60_000 }, client);
  assert.equal(r.exitCode, 2);
  assert.equal(r.stdout, "42\n");
  assert.equal(r.stderr, "e\n");
  assert.equal(r.language, "python");
  assert.match(r.sandboxId, /^run-/);
  assert.equal(r.timedOut, false);
  assert.ok(r.resourceUsage);
  await assert.rejects(Sandbox.connect(r.sandboxId, { client })); // gone
});

const ref = fileSandbox();

test("network: get the policy; a set that cannot be applied keeps the old one", async () => {
  const sb = ref.sb;
  const before = await sb.network.get();
  assert.equal(before.mode, "internet");
  if (process.env.AGENT_SANDBOX_TEST_NETWORK === "on") {
    const now = await sb.network.set({ mode: "none" });
    assert.equal(now.mode, "none");
    assert.equal((await sb.network.get()).mode, "none");
  } else {
    // Test daemons run --network off: the daemon refuses any change (409).
    await assert.rejects(sb.network.set({ mode: "none" }), (e) => e instanceof EgressNotApplied && e.status === 409);
    assert.deepEqual(await sb.network.get(), before);
  }
});
