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
