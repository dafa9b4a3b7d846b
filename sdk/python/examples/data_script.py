"""Run a Python data script in a sandbox: upload a CSV, analyse it in the
guest, read the result back as JSON."""

import json
import random

from agent_sandbox import Sandbox

SCRIPT = """
import csv, json, statistics
rows = list(csv.DictReader(open("sales.csv")))
by_region = {}
for r in rows:
    by_region.setdefault(r["region"], []).append(float(r["amount"]))
report = {k: {"n": len(v), "total": round(sum(v), 2), "median": statistics.median(v)}
          for k, v in sorted(by_region.items())}
json.dump(report, open("report.json", "w"), indent=1)
print(f"{len(rows)} rows, {len(report)} regions")
"""


def main() -> None:
    rng = random.Random(7)
    lines = ["region,amount"] + [f"{rng.choice(['north', 'south', 'east'])},{rng.randint(1, 500)}" for _ in range(1000)]
    with Sandbox.create("dev") as sbx:  # the developer image has python3
        sbx.files.write("sales.csv", "\n".join(lines) + "\n")
        sbx.files.write("analyze.py", SCRIPT)
        run = sbx.commands.run("python3 analyze.py", timeout=60)
        print(run.stdout.strip(), f"(exit {run.exit_code}, {run.duration_ms} ms)")
        report = json.loads(sbx.files.read("report.json"))
        for region, stats in report.items():
            print(f"{region:>6}: {stats['n']} sales, total {stats['total']}, median {stats['median']}")


if __name__ == "__main__":
    main()
