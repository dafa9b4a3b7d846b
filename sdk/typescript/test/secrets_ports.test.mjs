// Injected secrets and preview ports against the real daemon: the guest sees a
// placeholder, never the value; the set is replaced live; a guest web server is
// reached from here through `ports.expose(...).url`, with the key unless public,
// and nothing after `close`. The Rust wrapper's daemon has networking
// (AGENT_SANDBOX_TEST_NETWORK=on) and a preview listener
// (AGENT_SANDBOX_TEST_PREVIEW=on); without them the typed refusals are checked.
// One `dev` session (python3 for the server) serves the file.
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { test } from "node:test";
import { BadRequest, Client, EgressNotApplied, NotSupported, Sandbox } from "../dist/index.js";
import { client, fileSandbox } from "./_helpers.mjs";

const NETWORK = process.env.AGENT_SANDBOX_TEST_NETWORK === "on";
const PREVIEW = process.env.AGENT_SANDBOX_TEST_PREVIEW === "on";
const NAME = "SDK_TOKEN";
// Random, so no image or earlier run holds it.
const VALUE = `sk-sdk-ts-${randomBytes(12).toString("hex")}`;
const PAGE = `<h1>preview ${randomBytes(6).toString("hex")}</h1>\n`;

const ref = fileSandbox({
  template: "dev",
  ...(NETWORK ? { secrets: [{ name: NAME, value: VALUE, hosts: ["api.test"], format: "Bearer {value}" }] } : {}),
});

test("offline: the create body's secrets and the routes' shapes", async () => {
  const calls = [];
  const port = { sessionId: "s1", port: 8000, public: false, url: "http://p.test:9/ports/ab/", createdAt: 1, expiresAt: 2 };
  const answers = {
    "POST /v1/sessions": [201, { id: "s1", state: "ready" }],
    "PUT /v1/sessions/s1/secrets": [200, { sessionId: "s1", secrets: [] }],
    "POST /v1/sessions/s1/ports": [201, port],
    "GET /v1/sessions/s1/ports": [200, { sessionId: "s1", ports: [port] }],
    "DELETE /v1/sessions/s1/ports/8000": [200, { closed: true }],
  };
  const fetch = async (url, init) => {
    const u = new URL(String(url));
    calls.push({ key: `${init.method} ${u.pathname}`, body: init.body ? JSON.parse(init.body) : undefined, headers: init.headers });
    const [status, body] = answers[`${init.method} ${u.pathname}`] ?? [404, { error: { code: "not_found", message: "no" } }];
    return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
  };
  const c = new Client({ url: "http://sandbox.test", apiKey: "k1", fetch, retry: false });
  assert.deepEqual(c.authHeaders(), { authorization: "Bearer k1" });
  assert.deepEqual(new Client({ url: "http://sandbox.test", apiKey: "", fetch }).authHeaders(), {});
  const secrets = [{ name: "A", value: "aaaa", hosts: ["a.test"], header: "X-Key" }];
  const sb = await Sandbox.create({ client: c, secrets });
  assert.deepEqual(calls.at(-1).body, { secrets });
  assert.deepEqual(await sb.secrets.set([]), []);
  assert.deepEqual(calls.at(-1).body, { secrets: [] });
  const p = await sb.ports.expose(8000, { ttl: "2h" });
  assert.deepEqual(calls.at(-1).body, { port: 8000, ttl: "2h", public: false });
  assert.equal(p.url, port.url);
  assert.equal(await sb.getUrl(8000), port.url); // open, not public: reused
  assert.equal(calls.at(-1).key, "GET /v1/sessions/s1/ports");
  assert.equal(await sb.ports.close(8000), true);
  assert.equal(await sb.ports.close(9000), false); // 404 not_found: not open
});

test("a secret is a placeholder in the guest; the list shows no value", async () => {
  const sb = ref.sb;
  if (!NETWORK) {
    await assert.rejects(Sandbox.create({ client, template: "dev", secrets: [{ name: NAME, value: VALUE, hosts: ["api.test"] }] }), EgressNotApplied);
    return;
  }
  assert.equal(sb.info.secrets.length, 1);
  const placeholder = sb.info.secrets[0].placeholder;
  assert.match(placeholder, /^asbx-secret-[0-9a-f]{32}$/);
  const r = await sb.commands.run(`printenv ${NAME}`);
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, `${placeholder}\n`);
  assert.ok(!r.stdout.includes(VALUE));
  const listed = await sb.secrets.list();
  assert.deepEqual(listed, [{ name: NAME, hosts: ["api.test"], header: "Authorization", format: "Bearer {value}", placeholder }]);
  assert.ok(!JSON.stringify(listed).includes(VALUE));
  const info = await sb.refresh();
  assert.ok(!JSON.stringify(info).includes(VALUE));
  assert.equal(info.secrets[0].placeholder, placeholder);
});

test("secrets replaced live, a bad one refused without its value, then none", async () => {
  const sb = ref.sb;
  if (!NETWORK) {
    await assert.rejects(sb.secrets.set([{ name: NAME, value: VALUE, hosts: ["api.test"] }]), EgressNotApplied);
    return;
  }
  const before = Object.fromEntries((await sb.secrets.list()).map((s) => [s.name, s.placeholder]));
  const other = `other-${randomBytes(8).toString("hex")}`;
  const got = await sb.secrets.set([
    { name: NAME, value: `sk-rotated-${randomBytes(8).toString("hex")}`, hosts: ["api.test"] },
    { name: "OTHER_KEY", value: other, hosts: ["*.other.test"], header: "X-Api-Key" },
  ]);
  const by = Object.fromEntries(got.map((s) => [s.name, s]));
  assert.deepEqual(Object.keys(by).sort(), ["OTHER_KEY", NAME]);
  assert.equal(by[NAME].placeholder, before[NAME]); // a name kept keeps its placeholder
  assert.equal(by[NAME].format, null);
  assert.deepEqual([by.OTHER_KEY.hosts, by.OTHER_KEY.header], [["*.other.test"], "X-Api-Key"]);
  const out = (await sb.commands.run("printenv OTHER_KEY")).stdout;
  assert.equal(out, `${by.OTHER_KEY.placeholder}\n`);
  assert.ok(!out.includes(other));
  await assert.rejects(sb.secrets.set([{ name: "SHORT", value: "q7z", hosts: ["a.test"] }]), (e) => {
    return e instanceof BadRequest && e.message.includes("SHORT") && !e.message.includes("q7z");
  });
  assert.deepEqual((await sb.secrets.list()).map((s) => s.name).sort(), ["OTHER_KEY", NAME]);
  assert.deepEqual(await sb.secrets.set([]), []);
  assert.deepEqual(await sb.secrets.list(), []);
  assert.equal((await sb.commands.run(`printenv ${NAME}`)).exitCode, 1);
  assert.equal((await sb.commands.run("echo ${OTHER_KEY:-gone}")).stdout, "gone\n");
});

test("a guest web server through its preview URL: the key unless public, nothing after close", async () => {
  const sb = ref.sb;
  if (!PREVIEW) {
    await assert.rejects(sb.ports.expose(8000), NotSupported);
    return;
  }
  await sb.files.write("site/index.html", PAGE);
  const server = await sb.commands.start(["python3", "-m", "http.server", "8000", "--directory", "site"], { tag: "preview" });
  const key = client.authHeaders();
  let oks = 0; // requests that reached the server (each is a line of its log)
  const get = async (url, auth = true) => {
    const r = await fetch(url, { headers: auth ? key : {} });
    const text = await r.text();
    if (r.status === 200) oks++;
    return { status: r.status, text };
  };
  try {
    const p = await sb.ports.expose(8000);
    assert.equal(p.port, 8000);
    assert.equal(p.public, false);
    assert.equal(p.sessionId, sb.id);
    assert.ok(p.url.startsWith("http://") && p.expiresAt > p.createdAt);
    // 502 until the server listens.
    const until = Date.now() + 60_000;
    while ((await get(`${p.url}index.html`)).status !== 200) {
      assert.ok(Date.now() < until, "the guest server never answered through the preview");
      await new Promise((r) => setTimeout(r, 100));
    }
    assert.deepEqual(await get(`${p.url}index.html`), { status: 200, text: PAGE });
    // Not public: the key is needed (and nothing reaches the guest without it).
    assert.equal((await get(`${p.url}index.html`, false)).status, 401);
    assert.equal((await fetch(p.url, { headers: { authorization: "Bearer asbx_wrong" } })).status, 401);
    assert.deepEqual((await sb.ports.list()).map((x) => [x.port, x.url, x.public]), [[8000, p.url, false]]);
    assert.equal(await sb.getUrl(8000), p.url); // open with the same `public`: reused

    // Opened again, public: a new URL; the old one is gone.
    const pub = await sb.ports.expose(8000, { ttl: 600, public: true });
    assert.notEqual(pub.url, p.url);
    assert.equal(pub.public, true);
    assert.ok(pub.expiresAt - pub.createdAt <= 600_000);
    assert.equal((await get(`${p.url}index.html`)).status, 404);
    assert.deepEqual(await get(`${pub.url}index.html`, false), { status: 200, text: PAGE });
    assert.equal(await sb.ports.getUrl(8000, { public: true }), pub.url);

    // Closed: 404 with or without the key, and nothing reaches the guest.
    assert.equal(await sb.ports.close(8000), true);
    assert.equal((await get(`${pub.url}index.html`, false)).status, 404);
    assert.equal((await get(`${pub.url}index.html`)).status, 404);
    assert.equal(await sb.ports.close(8000), false);
    assert.deepEqual(await sb.ports.list(), []);

    await assert.rejects(sb.ports.expose(0), BadRequest);
    await assert.rejects(sb.ports.expose(8000, { ttl: "25h" }), BadRequest);
  } finally {
    await server.kill();
  }
  const log = (await server.wait()).stderr;
  assert.equal(log.split('"GET ').length - 1, oks, log);
  assert.equal(log.split('"GET /index.html HTTP/1.1" 200').length - 1, oks, log);
});

const offnet = process.env.AGENT_SANDBOX_OFFNET_URL;
test("a daemon without networking or a preview listener: EgressNotApplied, NotSupported", { skip: !offnet && "AGENT_SANDBOX_OFFNET_URL (a VM daemon with --network off) not set" }, async () => {
  const c = new Client({ url: offnet, apiKey: process.env.AGENT_SANDBOX_OFFNET_KEY });
  await assert.rejects(Sandbox.create({ client: c, template: "base", secrets: [{ name: NAME, value: VALUE, hosts: ["api.test"] }] }), (e) => {
    return e instanceof EgressNotApplied && e.status === 409 && !e.message.includes(VALUE);
  });
  assert.deepEqual(await Sandbox.list(c), []); // refused before any session was made
  const sb = await Sandbox.create({ client: c, template: "base" });
  try {
    assert.equal(sb.info.secrets, undefined);
    assert.deepEqual(await sb.secrets.list(), []);
    await assert.rejects(sb.secrets.set([{ name: NAME, value: VALUE, hosts: ["api.test"] }]), EgressNotApplied);
    assert.deepEqual(await sb.secrets.set([]), []); // none needs nothing
    await assert.rejects(sb.ports.expose(8000), (e) => e instanceof NotSupported && e.status === 501);
    assert.deepEqual(await sb.ports.list(), []);
    assert.equal(await sb.ports.close(8000), false);
  } finally {
    await sb.kill();
  }
});
