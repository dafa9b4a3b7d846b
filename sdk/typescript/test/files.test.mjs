import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { test } from "node:test";
import { AlreadyExists, DirectoryNotEmpty, FileNotFound } from "../dist/index.js";
import { fileSandbox } from "./_helpers.mjs";

const ref = fileSandbox();

test("write / read text and bytes, relative paths under the workspace", async () => {
  const sb = ref.sb;
  const w = await sb.files.write("notes/a.txt", "héllo ✓\n");
  assert.equal(w.bytes, Buffer.byteLength("héllo ✓\n"));
  assert.equal(await sb.files.read("notes/a.txt"), "héllo ✓\n");
  assert.equal(await sb.files.read("/workspace/notes/a.txt"), "héllo ✓\n");
  const bytes = new Uint8Array(256).map((_, i) => i);
  await sb.files.write("/tmp/all.bin", bytes);
  assert.deepEqual(await sb.files.readBytes("/tmp/all.bin"), bytes);
  await sb.files.write("/tmp/blob.bin", new Blob([bytes]));
  assert.deepEqual(await sb.files.readBytes("/tmp/blob.bin"), bytes);
  assert.equal((await sb.commands.run("sha256sum /tmp/all.bin | cut -d' ' -f1")).stdout.trim(), createHash("sha256").update(bytes).digest("hex"));
});

test("write with a mode; stat; exists", async () => {
  const sb = ref.sb;
  await sb.files.write("run.sh", "#!/bin/sh\necho ran\n", { mode: 0o755 });
  const st = await sb.files.stat("run.sh");
  assert.equal(st.type, "file");
  assert.equal(st.mode & 0o777, 0o755);
  assert.equal(st.size, 19);
  assert.equal(st.path, "/workspace/run.sh");
  assert.equal((await sb.commands.run("./run.sh")).stdout, "ran\n");
  assert.equal(await sb.files.exists("run.sh"), true);
  assert.equal(await sb.files.exists("nope.sh"), false);
});

test("mkdir, list (flat and recursive), rename, remove", async () => {
  const sb = ref.sb;
  await sb.files.mkdir("tree/a/b");
  await sb.files.write("tree/a/b/f.txt", "f");
  await sb.files.write("tree/top.txt", "t");
  const flat = await sb.files.list("tree");
  assert.deepEqual(flat.map((e) => `${e.name}:${e.type}`).sort(), ["a:directory", "top.txt:file"]);
  const deep = await sb.files.list("tree", { recursive: true });
  assert.ok(deep.some((e) => e.path.endsWith("a/b/f.txt") && e.size === 1), JSON.stringify(deep));
  await sb.files.rename("tree/top.txt", "tree/moved.txt");
  assert.equal(await sb.files.read("tree/moved.txt"), "t");
  await assert.rejects(sb.files.read("tree/top.txt"), FileNotFound);
  await sb.files.write("tree/other.txt", "o");
  await assert.rejects(sb.files.rename("tree/other.txt", "tree/moved.txt", { overwrite: false }), AlreadyExists);
  await assert.rejects(sb.files.remove("tree/a"), DirectoryNotEmpty);
  await sb.files.remove("tree/a", { recursive: true });
  await sb.files.remove("tree/other.txt");
  assert.deepEqual((await sb.files.list("tree")).map((e) => e.name), ["moved.txt"]);
});

test("64 MiB binary round trip, streamed both ways, byte-exact", async () => {
  const sb = ref.sb;
  const size = 64 * 1024 * 1024;
  const chunk = 1024 * 1024;
  // Deterministic, incompressible-looking bytes, made as they are sent.
  const block = (i) => {
    const b = new Uint8Array(chunk);
    let x = (i + 1) * 2654435761;
    for (let j = 0; j < chunk; j += 4) {
      x ^= x << 13; x ^= x >>> 17; x ^= x << 5;
      b[j] = x; b[j + 1] = x >>> 8; b[j + 2] = x >>> 16; b[j + 3] = x >>> 24;
    }
    return b;
  };
  const sent = createHash("sha256");
  let i = 0;
  const upload = new ReadableStream({
    pull(c) {
      if (i === size / chunk) return c.close();
      const b = block(i++);
      sent.update(b);
      c.enqueue(b);
    },
  });
  const w = await sb.files.write("/tmp/big.bin", upload);
  assert.equal(w.bytes, size);
  const want = sent.digest("hex");
  assert.equal((await sb.commands.run("sha256sum /tmp/big.bin | cut -d' ' -f1", { timeout: 120_000 })).stdout.trim(), want);
  const got = createHash("sha256");
  let n = 0;
  for await (const part of await sb.files.download("/tmp/big.bin")) {
    got.update(part);
    n += part.length;
  }
  assert.equal(n, size);
  assert.equal(got.digest("hex"), want);
  await sb.files.remove("/tmp/big.bin");
});
