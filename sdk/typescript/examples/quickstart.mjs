import { Sandbox } from "agent-sandbox";
// AGENT_SANDBOX_URL and AGENT_SANDBOX_API_KEY say where the daemon is.
const sandbox = await Sandbox.create({ template: "base" });
try {
  await sandbox.files.write("hello.sh", "echo hello from $(uname -s)");
  const result = await sandbox.commands.run("sh hello.sh");
  console.log(result.stdout.trim(), "exit", result.exitCode);
} finally {
  await sandbox.kill();
}
