import assert from "node:assert/strict";
import { test } from "node:test";
import { Client, EgressNotApplied, KeyNotFound, KeyRevoked, Keys, Sandbox, Unauthorized, run } from "../dist/index.js";
import { client, fileSandbox } from "./_helpers.mjs";

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
