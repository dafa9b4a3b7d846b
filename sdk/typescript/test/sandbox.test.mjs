import assert from "node:assert/strict";
import { test } from "node:test";
import ts from "typescript";
import { InvalidSessionId, Sandbox, SessionNotFound, UnknownTemplate, health, metrics, ready, templates, withSandbox } from "../dist/index.js";
import { TEMPLATE, client } from "./_helpers.mjs";

test("create with options, list, connect, refresh, keepalive, kill", async () => {
  const sb = await Sandbox.create({
    client,
    template: TEMPLATE,
    vcpus: 1,
    memoryMib: 256,
    env: { GREETING: "hi" },
    ttl: "10m",
    idleTimeout: 120,
    onIdle: "destroy",
  });
  try {
    assert.equal(sb.info.state, "ready");
    assert.equal(sb.info.template, TEMPLATE);
    assert.equal(sb.info.vcpus, 1);
    assert.equal(sb.info.memoryMib, 256);
    assert.equal(sb.info.idleTimeoutMs, 120_000);
    assert.equal(sb.info.onIdle, "destroy");
    assert.ok(sb.info.expiresAt - sb.info.createdAt <= 600_000);
    assert.deepEqual(sb.info.env, { GREETING: "hi" });
    assert.equal((await sb.commands.run("echo $GREETING")).stdout, "hi\n");
    assert.ok((await Sandbox.list({ client })).some((s) => s.id === sb.id));
    const again = await Sandbox.connect(sb.id, { client });
    assert.equal(again.id, sb.id);
    assert.equal((await again.commands.run("echo $GREETING")).stdout, "hi\n");
    const before = sb.info.lastUsedAt;
    const k = await sb.keepalive();
    assert.ok(k.lastUsedAt >= before);
    assert.equal((await sb.refresh()).id, sb.id);
  } finally {
    assert.equal(await sb.kill(), true);
  }
  assert.equal(await sb.kill(), false);
  await assert.rejects(Sandbox.connect(sb.id, { client }), SessionNotFound);
  assert.ok(!(await Sandbox.list({ client })).some((s) => s.id === sb.id));
});

test("create with an id; a bad id and an unknown template are their errors", async () => {
  const id = `ts-${process.pid}`;
  const sb = await Sandbox.create({ client, template: TEMPLATE, id });
  try {
    assert.equal(sb.id, id);
  } finally {
    await sb.kill();
  }
  await assert.rejects(Sandbox.create({ client, id: "bad id!" }), (e) => e instanceof InvalidSessionId && e.status === 400);
  await assert.rejects(Sandbox.create({ client, template: "no-such-template" }), UnknownTemplate);
});

test("withSandbox destroys the sandbox when the body throws, and passes the error on", async () => {
  let id;
  await assert.rejects(
    withSandbox({ client, template: TEMPLATE }, async (sb) => {
      id = sb.id;
      await sb.commands.run("true");
      throw new Error("body failed");
    }),
    /body failed/,
  );
  await assert.rejects(Sandbox.connect(id, { client }), SessionNotFound);
  assert.equal(await withSandbox({ client, template: TEMPLATE }, async (sb) => (await sb.commands.run("echo 7")).stdout), "7\n");
});

test("Symbol.asyncDispose destroys the sandbox; so does `await using` (compiled by tsc) when the body throws", async () => {
  const sb = await Sandbox.create({ client, template: TEMPLATE });
  await sb[Symbol.asyncDispose]();
  await assert.rejects(Sandbox.connect(sb.id, { client }), SessionNotFound);

  // Node 20 has no `await using` syntax: tsc lowers it, as it does for users.
  const src = `
    import { Sandbox } from ${JSON.stringify(new URL("../dist/index.js", import.meta.url).href)};
    export async function body(opts: any, seen: { id?: string }) {
      await using sb = await Sandbox.create(opts);
      seen.id = sb.id;
      throw new Error("inside await using");
    }`;
  const js = ts.transpileModule(src, { compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ES2022 } }).outputText;
  const mod = await import(`data:text/javascript;base64,${Buffer.from(js).toString("base64")}`);
  const seen = {};
  await assert.rejects(mod.body({ client, template: TEMPLATE }, seen), /inside await using/);
  assert.ok(seen.id);
  await assert.rejects(Sandbox.connect(seen.id, { client }), SessionNotFound);
});

test("templates, health, ready, metrics", async () => {
  const ts = await templates(client);
  const t = ts.find((x) => x.name === TEMPLATE);
  assert.ok(t, JSON.stringify(ts.map((x) => x.name)));
  assert.ok(t.resources.memSizeMib > 0 && t.vcpus > 0);
  assert.equal(ts.filter((x) => x.default).length, 1);
  const h = await health(client);
  assert.equal(h.status, "ok");
  assert.ok(h.uptime >= 0);
  const r = await ready(client);
  assert.equal(r.status, "ready");
  assert.deepEqual(Object.keys(r.checks).sort(), ["accepting", "capacity", "images", "serving", "vmm"]);
  assert.match(await metrics(client), /^# (TYPE|HELP) agent_sandbox_/m);
});
