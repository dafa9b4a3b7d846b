// Install a pip package in the guest and use it.
//   node examples/pip-install.mjs            from PyPI (needs a daemon whose sessions reach the internet)
//   node examples/pip-install.mjs --offline  a wheel built in the guest, installed with --no-index
import { Sandbox } from "agent-sandbox";

const offline = process.argv.includes("--offline");
// A minimal pure-Python wheel, zipped by the guest's python (stdlib only).
const makeWheel = `
import base64, hashlib, sys, zipfile
files = {"tinypkg/__init__.py": "def answer():\\n    return 42\\n",
         "tinypkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\\nName: tinypkg\\nVersion: 0.1\\n",
         "tinypkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: example\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
rec = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},{len(t.encode())}" for n, t in files.items()]
files["tinypkg-0.1.dist-info/RECORD"] = "\\n".join(rec + ["tinypkg-0.1.dist-info/RECORD,,"]) + "\\n"
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for n, t in files.items():
        z.writestr(n, t)
`;

const sb = await Sandbox.create({ template: "python" });
try {
  // The system pip serves the venv (ensurepip would take minutes under emulation).
  const venv = await sb.commands.run("python3 -m venv --system-site-packages --without-pip /workspace/venv", { timeout: 120_000 });
  if (venv.exitCode !== 0) throw new Error(`venv: ${venv.stderr}`);
  let install, use;
  if (offline) {
    await sb.files.write("make_wheel.py", makeWheel);
    await sb.commands.run("mkdir -p wheels && python3 make_wheel.py wheels/tinypkg-0.1-py3-none-any.whl");
    install = "/workspace/venv/bin/python -m pip install --no-index --find-links /workspace/wheels tinypkg";
    use = "import tinypkg; print(tinypkg.answer())";
  } else {
    install = "/workspace/venv/bin/python -m pip install humanize";
    use = "import humanize; print(humanize.naturalsize(123456789))";
  }
  const r = await sb.commands.run(install, { timeout: 300_000, onStdout: (d) => process.stdout.write(d) });
  if (r.exitCode !== 0) throw new Error(`pip install failed (exit ${r.exitCode}): ${r.stderr}`);
  const out = await sb.commands.run(["/workspace/venv/bin/python", "-c", use]);
  console.log(out.stdout.trim()); // 42 offline, "123.5 MB" from PyPI
  if (out.exitCode !== 0) throw new Error(out.stderr);
} finally {
  await sb.kill();
}
