// A dev server in the background, its output followed while we use it.
import { Sandbox } from "agent-sandbox";

const sb = await Sandbox.create({ template: "python" });
try {
  await sb.files.write("site/index.html", "<h1>hello from the sandbox</h1>\n");
  const server = await sb.commands.start(["python3", "-u", "-m", "http.server", "8000", "--directory", "site"], { tag: "dev-server" });

  // Follow its output (replayed from the start, then live) until it exits.
  let log = "";
  let ready;
  const isReady = new Promise((r) => (ready = r));
  const follow = (async () => {
    for await (const ev of server.attach()) {
      if (ev.type === "stdout" || ev.type === "stderr") {
        log += ev.data;
        process.stdout.write(`[server] ${ev.data}`);
        if (log.includes("Serving HTTP")) ready();
      }
      if (ev.type === "exit") console.log(`[server] exited, signal ${ev.signal}`);
    }
  })();
  await isReady;

  for (let i = 0; i < 3; i++) {
    const page = await sb.commands.run("curl -sS http://127.0.0.1:8000/");
    console.log(`GET / -> ${page.stdout.trim()}`);
  }
  await server.signal("INT");
  await follow;
  const hits = log.split("\n").filter((l) => l.includes('"GET / HTTP/1.1" 200')).length;
  if (hits !== 3) throw new Error(`the followed log shows ${hits} requests, not 3`);
} finally {
  await sb.kill();
}
