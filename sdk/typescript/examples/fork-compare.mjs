// Fork a prepared sandbox and compare two approaches from the same state.
import { Sandbox } from "agent-sandbox";

const base = await Sandbox.create({ template: "base" });
const copies = [];
try {
  // Expensive shared set-up, done once.
  await base.commands.run("seq 1 200000 | shuf --random-source=/dev/zero > /workspace/numbers.txt");
  const fork = await base.fork(2);
  copies.push(...fork.sandboxes);
  console.log(`forked ${copies.length} copies in a ${fork.pausedMs} ms pause`);

  const approaches = ["sort -n numbers.txt | tail -1", "sort -rn numbers.txt | head -1"];
  const results = await Promise.all(
    copies.map(async (sb, i) => {
      const r = await sb.commands.run(approaches[i]);
      await sb.files.write("/workspace/only-here.txt", `copy ${i}`);
      return { approach: approaches[i], out: r.stdout.trim(), ms: r.durationMs };
    }),
  );
  console.table(results);
  if (results[0].out !== results[1].out) throw new Error("the approaches disagree");
  // Each copy changed only itself.
  if (await base.files.exists("/workspace/only-here.txt")) throw new Error("a copy changed the source");
} finally {
  for (const c of copies) await c.kill();
  await base.kill();
}
