import assert from "node:assert/strict";
import { test } from "node:test";
import { ProcessNotFound, SpawnFailed } from "../dist/index.js";
import { fileSandbox, readUntil } from "./_helpers.mjs";

const ref = fileSandbox({ env: { FROM_SESSION: "s" } });

test("run: exit code, stdout, stderr, resource usage", async () => {
  const r = await ref.sb.commands.run("echo out; echo err >&2; exit 3");
  assert.equal(r.exitCode, 3);
  assert.equal(r.stdout, "out\n");
  assert.equal(r.stderr, "err\n");
  assert.equal(r.timedOut, false);
  assert.equal(r.signal, null);
  assert.equal(typeof r.durationMs, "number");
  assert.ok(r.resourceUsage && r.resourceUsage.memoryMb >= 0 && r.resourceUsage.cpuPercent >= 0);
});

test("run: argv without a shell, cwd, env over the session's, stdin text and bytes", async () => {
  const sb = ref.sb;
  assert.equal((await sb.commands.run(["echo", "$HOME", "a b"])).stdout, "$HOME a b\n");
  await sb.files.mkdir("/tmp/wd");
  assert.equal((await sb.commands.run("pwd", { cwd: "/tmp/wd" })).stdout, "/tmp/wd\n");
  const env = await sb.commands.run('echo "$FROM_SESSION $FROM_CMD"', { env: { FROM_CMD: "c" } });
  assert.equal(env.stdout, "s c\n");
  assert.equal((await sb.commands.run("cat", { stdin: "piped\n" })).stdout, "piped\n");
  const bytes = new Uint8Array([0, 1, 2, 255, 10]);
  assert.equal((await sb.commands.run("od -An -tu1 | tr -s ' '", { stdin: bytes })).stdout.trim(), "0 1 2 255 10");
});

test("binary: exact output bytes, buffered, streamed and attached; text split mid-character stays whole", async () => {
  const sb = ref.sb;
  const want = [0, 255, 254, 10, 0xe2, 0x9c, 0x93];
  const cmd = "printf '\\000\\377\\376\\n'; printf '\\342'; sleep 0.2; printf '\\234\\223'";
  const buffered = await sb.commands.run(cmd, { binary: true });
  assert.deepEqual([...buffered.stdoutBytes], want);
  assert.equal(buffered.stdoutBytes.length, 7);
  assert.ok(buffered.stdout.endsWith("✓"));
  const streamed = await sb.commands.run(cmd, { binary: true, onStdout: () => {} });
  assert.deepEqual([...streamed.stdoutBytes], want);
  assert.ok(streamed.stdout.endsWith("✓"), JSON.stringify(streamed.stdout));
  const p = await sb.commands.start(cmd);
  const waited = await p.wait({ binary: true });
  assert.deepEqual([...waited.stdoutBytes], want);
  assert.equal((await sb.commands.run(cmd)).stdoutBytes, undefined); // text only unless asked
});

test("run: secrets are files for that command only, masked in its output", async () => {
  const sb = ref.sb;
  const value = "ts-secret-9f8e7d6c5b4a";
  const r = await sb.commands.run("stat -c %a /run/secrets/TOKEN; cat /run/secrets/TOKEN", { secrets: { TOKEN: value } });
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, "400\n****");
  const chunks = [];
  await sb.commands.run("cat /run/secrets/TOKEN", { secrets: { TOKEN: value }, onStdout: (d) => chunks.push(d) });
  assert.equal(chunks.join(""), "****");
  assert.equal((await sb.commands.run("test -e /run/secrets/TOKEN")).exitCode, 1);
  await assert.rejects(sb.commands.run("true", { secrets: { "a/b": value } }), (e) => /secret name/.test(e.message) && !e.message.includes(value));
});

test("run: a timeout kills the command", async () => {
  const r = await ref.sb.commands.run("sleep 30", { timeout: 500 });
  assert.equal(r.timedOut, true);
  assert.equal(r.signal, "SIGKILL");
  assert.equal(r.exitCode, 137);
});

test("run: onStdout / onStderr get the chunks as they come, in order", async () => {
  const seen = [];
  const r = await ref.sb.commands.run("for i in 1 2 3; do echo o$i; sleep 0.1; echo e$i >&2; sleep 0.1; done", {
    onStdout: (d) => seen.push(`out:${d}`),
    onStderr: (d) => seen.push(`err:${d}`),
  });
  assert.deepEqual(seen.join("").replace(/\n/g, ""), "out:o1err:e1out:o2err:e2out:o3err:e3");
  assert.equal(r.stdout, "o1\no2\no3\n");
  assert.equal(r.stderr, "e1\ne2\ne3\n");
});

test("stream: started, then output in the order printed, then exit", async () => {
  const evs = [];
  for await (const ev of ref.sb.commands.stream("for i in 1 2 3 4 5; do echo $i; sleep 0.05; echo x$i >&2; sleep 0.05; done; exit 4")) {
    evs.push(ev);
  }
  assert.equal(evs[0].type, "started");
  assert.ok(evs[0].procId > 0 && evs[0].pid > 0);
  const last = evs.at(-1);
  assert.equal(last.type, "exit");
  assert.equal(last.exitCode, 4);
  const out = evs.slice(1, -1);
  assert.ok(out.every((e) => e.type === "stdout" || e.type === "stderr"));
  assert.equal(out.map((e) => `${e.type}:${e.data}`).join(""), [1, 2, 3, 4, 5].map((i) => `stdout:${i}\nstderr:x${i}\n`).join(""));
  const ts = out.map((e) => e.ts);
  assert.deepEqual(ts, [...ts].sort((a, b) => a - b));
});

test("stream: breaking out of the loop kills the command", async () => {
  const sb = ref.sb;
  // The daemon notices a client gone when it next writes: the loop prints.
  await sb.files.write("/tmp/loop.sh", "echo ready; while :; do echo tick; sleep 0.2; done\n");
  for await (const ev of sb.commands.stream(["sh", "/tmp/loop.sh"])) {
    if (ev.type === "stdout") break;
  }
  const deadline = Date.now() + 15_000;
  let left;
  do {
    left = (await sb.commands.run("pgrep -c -f -x 'sh /tmp/loop.sh' || true")).stdout.trim();
  } while (left !== "0" && Date.now() < deadline);
  assert.equal(left, "0");
});

test("run: aborting its signal cancels a foreground command", async () => {
  const ctl = new AbortController();
  const pending = ref.sb.commands.run("while :; do echo x; sleep 0.2; done", { signal: ctl.signal });
  ctl.abort();
  await assert.rejects(pending, (e) => e.name === "AbortError");
});

test("run: a program that does not exist is SpawnFailed", async () => {
  await assert.rejects(ref.sb.commands.run(["/no/such/program"]), SpawnFailed);
});

test("background: start, attach after it printed, sendStdin, list, get, wait", async () => {
  const sb = ref.sb;
  const p = await sb.commands.start("echo before; read line; echo got $line; echo bye >&2", { tag: "reader" });
  assert.ok(p.procId > 0 && p.pid > 0);
  // Wait until it has printed (attach replays it), then attach anew: the line is there.
  await readUntil(p.attach(), (t) => t.includes("before"));
  const it = p.attach();
  assert.equal(await readUntil(it, (t) => t.includes("before\n")), "before\n");
  const listed = (await sb.commands.list()).find((x) => x.procId === p.procId);
  assert.equal(listed.tag, "reader");
  assert.equal(listed.running, true);
  assert.equal(listed.background, true);
  await p.sendStdin("hello\n");
  const rest = await readUntil(it, (t) => t.includes("bye"));
  assert.match(rest, /got hello/);
  const r = await p.wait();
  assert.equal(r.exitCode, 0);
  assert.equal(r.stdout, "before\ngot hello\n");
  assert.equal(r.stderr, "bye\n");
  const info = await sb.commands.process(p.procId).info(); // a handle from the id alone
  assert.equal(info.running, false);
  assert.equal(info.exitCode, 0);
  assert.equal(info.pid, p.pid);
});

test("background: attach without replay sees only new output; sendStdin with eof", async () => {
  const p = await ref.sb.commands.start("echo early; cat; echo done");
  await readUntil(p.attach(), (t) => t.includes("early"));
  const it = p.attach({ replay: false });
  await p.sendStdin("late\n", { eof: true });
  let text = "";
  for (;;) {
    const { value, done } = await it.next();
    if (done || value.type === "exit") break;
    if (value.type === "stdout") text += value.data;
  }
  assert.equal(text, "late\ndone\n");
});

test("background: signal, kill, killAll", async () => {
  const sb = ref.sb;
  const a = await sb.commands.start(["sleep", "600"]);
  await a.signal("TERM");
  const ra = await a.wait();
  assert.equal(ra.signal, "SIGTERM");
  const b = await sb.commands.start(["sleep", "601"]);
  await b.kill();
  assert.equal((await b.wait()).signal, "SIGKILL");
  const c = await sb.commands.start(["sleep", "602"]);
  await sb.commands.start(["sleep", "603"]);
  const k = await sb.commands.killAll();
  assert.ok(k.killed >= 2, `killed ${k.killed}`);
  assert.equal(k.remaining, 0);
  // The record notes the exit a moment after the answer: wait for it.
  assert.equal((await c.wait()).signal, "SIGKILL");
  assert.equal((await c.info()).running, false);
  await assert.rejects(sb.commands.get(999999), ProcessNotFound);
});

test("pty: the terminal's size, and a resize, as `stty size` sees them", async () => {
  const t = await ref.sb.pty.create({ rows: 24, cols: 80 });
  const it = t.attach();
  await t.sendStdin("stty size\n");
  await readUntil(it, (s) => s.includes("24 80"), "24 80");
  await t.resize(40, 120);
  await t.sendStdin("stty size; exit\n");
  await readUntil(it, (s) => s.includes("40 120"), "40 120");
  const info = await t.info();
  assert.equal(info.pty, true);
});
