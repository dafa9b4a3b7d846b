// Install a package from PyPI in the guest and use it. Needs a daemon whose
// sessions reach the internet (not `serve --network off`).
import { Sandbox } from "agent-sandbox";

const pkg = process.argv[2] ?? "humanize";
await using sb = await Sandbox.create({ template: "python", egress: { mode: "internet" } });
const install = await sb.commands.run(`python3 -m venv /workspace/venv && /workspace/venv/bin/pip install -q ${pkg}`, {
  timeout: 300_000,
  onStderr: (d) => process.stderr.write(d),
});
if (install.exitCode !== 0) throw new Error(`pip install ${pkg} failed (exit ${install.exitCode})`);
const use = await sb.commands.run(["/workspace/venv/bin/python", "-c", "import humanize; print(humanize.naturalsize(123456789))"]);
console.log(use.stdout.trim()); // 123.5 MB
