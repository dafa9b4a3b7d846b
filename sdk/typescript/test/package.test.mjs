// The package's promises: ESM, no runtime dependencies, no Node-only imports
// in the library, types for every module. No daemon needed.
import assert from "node:assert/strict";
import { existsSync, readFileSync, readdirSync } from "node:fs";
import { test } from "node:test";

const root = new URL("../", import.meta.url);
const pkg = JSON.parse(readFileSync(new URL("package.json", root), "utf8"));

test("package.json: ESM, zero runtime dependencies, devDependencies typescript and typedoc only", () => {
  assert.equal(pkg.type, "module");
  assert.equal(pkg.dependencies, undefined);
  assert.equal(pkg.peerDependencies, undefined);
  assert.deepEqual(Object.keys(pkg.devDependencies).sort(), ["typedoc", "typescript"]);
  assert.equal(pkg.exports["."].types, "./dist/index.d.ts");
  assert.equal(pkg.exports["."].import, "./dist/index.js");
  assert.equal(pkg.engines.node, ">=18");
});

test("dist: relative imports only (no node: or bare specifiers), a .d.ts beside each .js", () => {
  const dist = new URL("dist/", root);
  const js = readdirSync(dist).filter((f) => f.endsWith(".js"));
  assert.ok(js.includes("index.js"), "built? run npm run build");
  for (const f of js) {
    // Code only: doc comments show imports of the package itself.
    const text = readFileSync(new URL(f, dist), "utf8").replace(/\/\*[\s\S]*?\*\/|^\s*\/\/.*$/gm, "");
    const specs = [...text.matchAll(/\b(?:import|export)\b[^'"]*?from\s*["']([^"']+)["']|\bimport\(\s*["']([^"']+)["']/g)].map((m) => m[1] ?? m[2]);
    for (const s of specs) assert.ok(s.startsWith("./"), `${f} imports ${s}`);
    assert.ok(!/\brequire\(|\bBuffer\b|\bprocess\.(?!env)/.test(text), `${f} uses a Node-only global`);
    assert.ok(existsSync(new URL(f.replace(/\.js$/, ".d.ts"), dist)), `${f} has no .d.ts`);
  }
});

test("the README's quick start is examples/quickstart.mjs, 10 lines", () => {
  const readme = readFileSync(new URL("README.md", root), "utf8");
  const block = readme.split("## Quick start")[1].match(/```js\n([\s\S]*?)```/)[1];
  const example = readFileSync(new URL("examples/quickstart.mjs", root), "utf8");
  assert.equal(block, example);
  assert.equal(example.trimEnd().split("\n").length, 10);
});

test("the .d.ts type-check a user's code: await using, results, events, error classes", async () => {
  const ts = (await import("typescript")).default;
  const { mkdtempSync, writeFileSync, rmSync } = await import("node:fs");
  const { tmpdir } = await import("node:os");
  const { join } = await import("node:path");
  const dir = mkdtempSync(join(tmpdir(), "sdk-ts-types-"));
  try {
    const index = new URL("dist/index.js", root).pathname;
    const file = join(dir, "user.ts");
    writeFileSync(
      file,
      `import { Sandbox, SandboxError, RateLimited, withSandbox, run, type CommandEvent } from ${JSON.stringify(index)};
      export async function main(): Promise<number> {
        await using sb = await Sandbox.create({ template: "base", vcpus: 1, memoryMib: 256, env: { A: "1" }, ttl: "1h", idleTimeout: 60, onIdle: "pause", egress: { mode: "none" } });
        const r = await sb.commands.run(["true"], { cwd: "/", timeout: 1000, stdin: new Uint8Array([1]), onStdout: (d: string) => void d });
        const code: number = r.exitCode; const out: string = r.stdout; const mem: number | undefined = r.resourceUsage?.memoryMb;
        for await (const ev of sb.commands.stream("echo")) { const e: CommandEvent = ev; if (e.type === "exit") return e.exitCode; }
        const p = await sb.commands.start("cat", { tag: "t", pty: { rows: 2, cols: 3 } }); await p.resize(4, 5); await p.sendStdin("x", { eof: true });
        await sb.files.write("f", new Blob(["x"])); const bytes: Uint8Array = await sb.files.readBytes("f");
        const n = await withSandbox({}, async (s) => (await s.files.list()).length);
        const rr = await run("python", "print(1)", { timeoutMs: 10 });
        try { await Sandbox.list(); } catch (e) { if (e instanceof RateLimited) { const s: number = e.retryAfter; void s; } if (e instanceof SandboxError) { const c: string = e.code; const st: number = e.status; void c; void st; } }
        return code + out.length + (mem ?? 0) + bytes.length + n + rr.exitCode;
      }`,
    );
    const program = ts.createProgram([file], {
      strict: true, noEmit: true, target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ES2022,
      moduleResolution: ts.ModuleResolutionKind.Bundler, lib: ["lib.es2022.d.ts", "lib.dom.d.ts", "lib.esnext.disposable.d.ts"], types: [],
    });
    const diags = ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
    assert.deepEqual(diags, []);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
