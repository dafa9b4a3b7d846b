import assert from "node:assert/strict";
import { test } from "node:test";
import { Sandbox, SessionBusy, SnapshotNotFound, Snapshots } from "../dist/index.js";
import { TEMPLATE, client } from "./_helpers.mjs";

test("checkpoint, snapshots list/get, sessions from the snapshot (one, then two at once), delete", async () => {
  const snaps = new Snapshots(client);
  const sb = await Sandbox.create({ client, template: TEMPLATE });
  let from;
  try {
    await sb.files.write("state.txt", "before");
    const snap = await sb.checkpoint({ name: "sdk-test" });
    assert.match(snap.id, /^snap-([a-z][a-z0-9]{0,15}-)?[0-9a-f]{12}$/);
    assert.equal(snap.name, "sdk-test");
    assert.equal(snap.sessionId, sb.id);
    assert.equal(snap.restorable, true);
    assert.ok(snap.sizeBytes > 0);
    await sb.files.write("state.txt", "after"); // the source runs on, changed
    assert.ok((await snaps.list()).some((s) => s.id === snap.id));
    assert.equal((await snaps.get(snap.id)).id, snap.id);
    from = await Sandbox.create({ client, fromSnapshot: snap.id });
    assert.notEqual(from.id, sb.id);
    assert.equal(await from.files.read("state.txt"), "before");
    assert.equal(await sb.files.read("state.txt"), "after");
    await from.kill();
    const many = await Sandbox.createFromSnapshot(snap.id, 2, { client });
    try {
      assert.equal(many.failed.length, 0);
      assert.equal(new Set(many.sandboxes.map((s) => s.id)).size, 2);
      for (const c of many.sandboxes) assert.equal(await c.files.read("state.txt"), "before");
    } finally {
      for (const c of many.sandboxes) await c.kill();
    }
    from = await Sandbox.create({ client, fromSnapshot: snap.id });
    await snaps.delete(snap.id);
    await assert.rejects(snaps.get(snap.id), SnapshotNotFound);
    assert.equal(await from.files.read("state.txt"), "before"); // runs on without its snapshot
  } finally {
    await from?.kill();
    await sb.kill();
  }
});

test("fork: copies carry files and running processes; each diverges on its own", async () => {
  const sb = await Sandbox.create({ client, template: TEMPLATE });
  let forks = [];
  try {
    await sb.files.write("f.txt", "shared");
    const bg = await sb.commands.start("i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done");
    const fork = await sb.fork(1);
    forks = fork.sandboxes;
    assert.equal(fork.sourceId, sb.id);
    assert.equal(fork.failed.length, 0);
    assert.equal(forks.length, 1);
    assert.ok(fork.pausedMs >= 0 && fork.snapshotBytes > 0);
    const [copy] = forks;
    assert.equal(await copy.files.read("f.txt"), "shared");
    await copy.files.write("f.txt", "copy");
    assert.equal(await sb.files.read("f.txt"), "shared");
    const procs = await copy.commands.list();
    assert.ok(procs.some((p) => p.procId === bg.procId && p.running), JSON.stringify(procs));
  } finally {
    for (const f of forks) await f.kill();
    await sb.kill();
  }
});

test("pause and resume keep processes and files; busy is refused", async () => {
  const sb = await Sandbox.create({ client, template: TEMPLATE });
  try {
    await sb.files.write("/tmp/keep.txt", "kept");
    const bg = await sb.commands.start(["sleep", "700"]);
    // A foreground command running: pause is refused at once.
    const it = sb.commands.stream("echo go; sleep 1");
    await it.next(); // started
    await assert.rejects(sb.pause(), SessionBusy);
    for await (const ev of it) if (ev.type === "exit") assert.equal(ev.exitCode, 0); // let it end
    const p = await sb.pause();
    assert.equal(p.state, "paused");
    assert.ok(p.snapshotBytes > 0);
    assert.equal((await Sandbox.connect(sb.id, { client })).info.state, "paused");
    const r = await sb.resume();
    assert.equal(r.state, "ready");
    assert.equal(await sb.files.read("/tmp/keep.txt"), "kept");
    assert.equal((await bg.info()).running, true);
  } finally {
    await sb.kill();
  }
});
