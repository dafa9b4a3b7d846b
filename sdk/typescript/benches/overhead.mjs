// p50 of exec `true` through the SDK vs raw fetch, same process, same session.
// AGENT_SANDBOX_URL / AGENT_SANDBOX_API_KEY name the daemon. Usage: node benches/overhead.mjs [runs]
import { Client, Sandbox } from "agent-sandbox";

const runs = Number(process.argv[2] ?? 50);
const url = (process.env.AGENT_SANDBOX_URL ?? "http://127.0.0.1:3000").replace(/\/+$/, "");
const key = process.env.AGENT_SANDBOX_API_KEY;
const p50 = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

const sb = await Sandbox.create({ template: process.env.AGENT_SANDBOX_TEST_TEMPLATE ?? "base" });
try {
  const raw = async () => {
    const res = await fetch(`${url}/v1/sessions/${sb.id}/exec`, {
      method: "POST",
      headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
      body: JSON.stringify({ argv: ["true"] }),
    });
    const body = await res.json();
    if (res.status !== 200 || body.exitCode !== 0) throw new Error(`raw exec: ${res.status} ${JSON.stringify(body)}`);
  };
  const sdk = async () => {
    const r = await sb.commands.run(["true"]);
    if (r.exitCode !== 0) throw new Error(`sdk exec: ${r.exitCode}`);
  };
  for (let i = 0; i < 5; i++) await raw(), await sdk(); // warm up both paths
  const times = { raw: [], sdk: [] };
  for (let i = 0; i < runs; i++) {
    // Interleaved, so both see the same load.
    for (const [name, f] of [["raw", raw], ["sdk", sdk]]) {
      const t0 = performance.now();
      await f();
      times[name].push(performance.now() - t0);
    }
  }
  const r = p50(times.raw);
  const s = p50(times.sdk);
  console.log(`exec true, ${runs} runs each: p50 raw fetch ${r.toFixed(2)} ms, p50 SDK ${s.toFixed(2)} ms, overhead ${(s - r).toFixed(2)} ms`);
} finally {
  await sb.kill();
}

// The SDK's own cost per call, without the network: the same exec answered
// by a canned response (fetch replaced), against building that response alone.
const canned = JSON.stringify({ exitCode: 0, signal: null, timedOut: false, duration: 1, durationMs: 1, resourceUsage: null, oomKilled: false, output: [], truncated: false, procId: 1 });
const answer = () => new Response(canned, { status: 200, headers: { "content-type": "application/json" } });
const offline = new Sandbox(new Client({ url: "http://canned.test", apiKey: "k", fetch: async () => answer() }), { id: "s" });
const bare = async () => (await answer()).json();
const local = { bare: [], sdk: [] };
for (let i = 0; i < 1000 + 200; i++) {
  for (const [name, f] of [["bare", bare], ["sdk", () => offline.commands.run(["true"])]]) {
    const t0 = performance.now();
    await f();
    if (i >= 200) local[name].push(performance.now() - t0);
  }
}
console.log(`client side, 1000 calls: p50 canned response ${(p50(local.bare) * 1000).toFixed(1)} µs, through the SDK ${(p50(local.sdk) * 1000).toFixed(1)} µs`);
