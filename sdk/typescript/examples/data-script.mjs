// Run a Python data script in a sandbox: upload data, run, read back the result.
import { withSandbox } from "agent-sandbox";

const csv = ["city,temp"].concat(
  Array.from({ length: 200 }, (_, i) => `${["Oslo", "Lima", "Pune", "Baku"][i % 4]},${((i * 37) % 40) - 5}`),
).join("\n");

const script = `
import csv, json, statistics
rows = list(csv.DictReader(open("data.csv")))
by = {}
for r in rows:
    by.setdefault(r["city"], []).append(float(r["temp"]))
print(json.dumps({c: {"n": len(v), "mean": round(statistics.mean(v), 2), "max": max(v)} for c, v in sorted(by.items())}))
`;

const summary = await withSandbox({ template: "python" }, async (sb) => {
  await sb.files.write("data.csv", csv);
  await sb.files.write("analyse.py", script);
  const r = await sb.commands.run(["python3", "analyse.py"]);
  if (r.exitCode !== 0) throw new Error(`analyse.py failed: ${r.stderr}`);
  console.error(`ran in ${r.durationMs} ms, peak ${r.resourceUsage?.memoryMb} MiB`);
  return JSON.parse(r.stdout);
});
console.log(summary);
if (summary.Oslo.n !== 50) throw new Error("unexpected summary");
