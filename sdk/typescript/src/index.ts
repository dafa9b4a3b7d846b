/**
 * TypeScript client of agent-sandbox: a microVM per AI-agent session.
 *
 * ```ts
 * import { Sandbox } from "agent-sandbox";
 * await using sb = await Sandbox.create({ template: "base" });
 * console.log((await sb.commands.run("echo hi")).stdout);
 * ```
 *
 * Configuration: `AGENT_SANDBOX_URL` and `AGENT_SANDBOX_API_KEY`, or
 * {@link ClientOptions}. Errors are {@link SandboxError} subclasses, one
 * per API error code.
 *
 * @module
 */
export { Client, errorOf, ndjson } from "./client.js";
export type { ClientLike, ClientOptions, Query, RequestOptions, RetryOptions } from "./client.js";
export * from "./errors.js";
export * from "./types.js";
export { Commands, Files, Network, Ports, Process, Pty, Sandbox, Secrets, fromBase64, toBase64, withSandbox } from "./sandbox.js";
export type { CommandOptions, ConnectOptions, CreateOptions, FileData, ForkResult, RunOptions, Signal, StartOptions, StartedSandboxes } from "./sandbox.js";
export { Keys, Snapshots, health, metrics, ready, run, templates } from "./api.js";
export type { KeyCreateOptions, Language } from "./api.js";
