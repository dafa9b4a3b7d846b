// Shared by the test files: the daemon comes from AGENT_SANDBOX_URL /
// AGENT_SANDBOX_API_KEY (tests/sdk_typescript.rs starts a real one).
import { after, before } from "node:test";
import { Client, Sandbox } from "../dist/index.js";

if (!process.env.AGENT_SANDBOX_URL) {
  throw new Error("set AGENT_SANDBOX_URL and AGENT_SANDBOX_API_KEY to a running agent-sandbox daemon");
}

/** The template the tests' sessions use (small and quick to start). */
export const TEMPLATE = process.env.AGENT_SANDBOX_TEST_TEMPLATE ?? "base";

export const client = new Client();

/** One sandbox for a whole test file: created before its tests, killed after. */
export function fileSandbox(opts = {}) {
  const ref = { sb: undefined };
  before(async () => {
    ref.sb = await Sandbox.create({ client, template: TEMPLATE, ...opts });
  });
  after(async () => {
    await ref.sb?.kill();
  });
  return ref;
}

/** Reads an async iterator of events until `pred(text so far)` holds; answers the text. */
export async function readUntil(iter, pred, what = "output") {
  let text = "";
  for (;;) {
    const { value, done } = await iter.next();
    if (done) throw new Error(`stream ended before ${what}; got ${JSON.stringify(text)}`);
    if (value.type === "stdout" || value.type === "stderr") text += value.data;
    if (pred(text)) return text;
  }
}
