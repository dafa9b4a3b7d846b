/**
 * The API's objects, as docs/openapi.yaml defines them.
 *
 * @module
 */

/** Seconds, or text like `30m`, `2h`, `250ms`. */
export type Duration = number | string;

/** A session's network policy (docs/network.md). */
export interface Egress {
  mode?: "internet" | "none" | "allowlist" | "denylist";
  /** `CIDR[:port[/proto]]`, allowlist / denylist only. */
  rules?: string[];
  domains?: string[];
  deniedDomains?: string[];
  bandwidthKbps?: number | null;
  bandwidthBurstKbit?: number;
}

/** `GET /v1/sessions/{id}/network`. */
export interface NetworkState {
  sessionId: string;
  egress: Egress;
}

/**
 * A credential the egress proxy injects (`secrets` of {@link SandboxCreateOptions},
 * `sandbox.secrets.set`): the guest's commands get `name` set to a placeholder
 * (`asbx-secret-<32 hex>`), never `value`; the proxy puts the value in place of
 * the placeholder in the `header` of HTTPS requests to `hosts` (docs/api.md,
 * "Injected secrets"). Needs per-session networking.
 */
export interface SecretSpec {
  /** The environment variable holding the placeholder (`[A-Za-z_][A-Za-z0-9_]{0,63}`). */
  name: string;
  /** The credential (4 characters to 8192 bytes); never shown back. */
  value: string;
  /** Where the value may go: names (`api.example.com`) or `*.suffix` wildcards (1-16). */
  hosts: string[];
  /** The request header it goes into (default `Authorization`). */
  header?: string;
  /**
   * The header's whole value, `{value}` standing for the secret (`"Bearer {value}"`);
   * absent: the placeholder inside the header is replaced and the rest kept.
   */
  format?: string;
}

/** What the daemon shows of an injected secret: never its value. */
export interface SecretInfo {
  name: string;
  hosts: string[];
  /** The header it goes into (`Authorization` unless the secret named one). */
  header: string;
  format: string | null;
  /** What the guest's `$NAME` holds: `asbx-secret-` and 32 hex digits. */
  placeholder: string;
}

/** A guest port open to the outside through the daemon's preview listener. */
export interface PortInfo {
  sessionId: string;
  port: number;
  /** The path form, `<preview>/ports/<token>/` (the guest sees `/` and below). */
  url: string;
  /** `<port>-<session>.<preview domain>/?asbx_token=<token>`, when the daemon has a `--preview-domain` (opening it sets the token as a host-only cookie). */
  hostUrl?: string;
  /**
   * `true`: the URL alone reaches it. `false`: a request also needs the owner's
   * API key (`Authorization: Bearer ...`, see `Client.authHeaders`), which the
   * guest never sees.
   */
  public: boolean;
  /** Ms since the epoch. */
  createdAt: number;
  /** Ms since the epoch; the URL answers 404 after it. */
  expiresAt: number;
}

/** Options of `sandbox.ports.expose`. */
export interface ExposeOptions {
  /** How long the URL works (default 1 h, at most 24 h and the session's life). */
  ttl?: Duration;
  /** Reachable with the URL alone, without the API key (default false). */
  public?: boolean;
}

/** What `POST /v1/sessions` takes (all optional). */
export interface SandboxCreateOptions {
  /** Session id (`[A-Za-z0-9_-]{1,64}`); default: the daemon picks one. */
  id?: string;
  template?: string;
  vcpus?: number;
  memoryMib?: number;
  diskMib?: number;
  /** Lifetime cap. */
  ttl?: Duration;
  /** Idle time after which `onIdle` happens (default 30 min). */
  idleTimeout?: Duration;
  env?: Record<string, string>;
  egress?: Egress;
  onIdle?: "destroy" | "pause";
  /** How long a paused session is kept. */
  pausedTtl?: Duration;
  /** Start from this snapshot instead of a template. */
  fromSnapshot?: string;
  /** Credentials the egress proxy injects; each command sees only placeholders (needs networking). */
  secrets?: SecretSpec[];
}

/** A session as the daemon shows it. */
export interface SessionInfo {
  id: string;
  sessionId: string;
  owner?: string;
  template: string;
  state: "starting" | "ready" | "failed" | "paused" | "closing";
  vcpus: number;
  memoryMib: number;
  diskMib: number;
  env: Record<string, string>;
  egress: Egress;
  createdAt: number;
  lastUsedAt: number;
  expiresAt: number;
  idleTimeoutMs: number;
  onIdle: "destroy" | "pause";
  pausedTtlMs: number;
  snapshotBytes?: number;
  pausedAt?: number;
  pausedExpiresAt?: number;
  busy: boolean;
  /** Its injected secrets (absent when it has none); never a value. */
  secrets?: SecretInfo[];
}

/** What the command used, measured in the sandbox for it alone. */
export interface ResourceUsage {
  /** Peak memory, MiB. */
  memoryMb: number;
  /** CPU time / run time × 100. */
  cpuPercent: number;
  source?: "cgroup" | "rusage";
}

/** How a command ended. */
export interface CommandExit {
  exitCode: number;
  /** `"SIGKILL"` and the like, or null. */
  signal: string | null;
  timedOut: boolean;
  /** The command's run time in the guest, ms. */
  durationMs: number;
  resourceUsage: ResourceUsage | null;
  oomKilled: boolean;
}

/** A finished command: {@link CommandExit} and its output. */
export interface CommandResult extends CommandExit {
  stdout: string;
  stderr: string;
  /** Output was cut at the daemon's 16 MiB bound. */
  truncated: boolean;
  procId?: number;
  /** The exact stdout bytes (with `binary: true`; `stdout` is their UTF-8 reading). */
  stdoutBytes?: Uint8Array;
  /** The exact stderr bytes (with `binary: true`). */
  stderrBytes?: Uint8Array;
}

/** One event of a command's stream, in order. */
export type CommandEvent =
  | { type: "started"; procId: number; pid: number }
  | { type: "stdout" | "stderr"; data: string; ts: number; /** The chunk's exact bytes (with `binary: true`). */ bytes?: Uint8Array }
  | { type: "dropped"; bytes: number }
  | ({ type: "exit" } & CommandExit);

/** A process of a session (`GET .../processes`). */
export interface ProcessInfo {
  procId: number;
  pid: number;
  argv: string[];
  tag: string | null;
  background: boolean;
  pty: boolean;
  startedAt: number;
  running: boolean;
  exitCode: number | null;
  signal: string | null;
}

/** A directory entry. */
export interface FileEntry {
  path: string;
  name: string;
  type: "file" | "directory" | "symlink" | "other";
  size: number;
  mode: number;
  mtime: number;
}

/** File metadata. */
export interface FileStat {
  path: string;
  type: "file" | "directory" | "symlink" | "other";
  size: number;
  mode: number;
  mtime: number;
  linkTarget: string | null;
}

/** A saved session state. */
export interface Snapshot {
  id: string;
  name: string | null;
  sessionId: string;
  template: string;
  vcpus: number;
  memoryMib: number;
  diskMib: number;
  sizeBytes: number;
  pausedMs: number;
  createdAt: number;
  restorable: boolean;
  problem?: string;
}

/** A copy of a fork (or a create of several) that failed to start. */
export interface FailedCopy {
  id: string;
  sessionId?: string;
  error: { code: string; message: string };
}

/** Limits of a one-shot {@link run}. */
export interface RunLimits {
  timeoutMs?: number;
  maxMemoryMb?: number;
  cpuCores?: number;
  allowNetwork?: boolean;
}

/** The answer of `POST /v1/run`. */
export interface RunResult extends CommandExit {
  sandboxId: string;
  language: string;
  template: string;
  stdout: string;
  stderr: string;
  truncated: boolean;
}

/** A template with a built image. */
export interface Template {
  name: string;
  displayName: string;
  version: string;
  description: string;
  tools: string[];
  resources: { memSizeMib: number; vcpuCount: number };
  vcpus: number;
  memoryMib: number;
  default: boolean;
}

/** An API key's record (never its secret). */
export interface KeyRecord {
  id: string;
  name: string;
  keyPrefix: string;
  scopes: string[];
  rateLimit: { requestsPerSecond: number; burst: number };
  createdAt: number;
  expiresAt: number | null;
  enabled: boolean;
  expired?: boolean;
}

/** A new or rotated key: its secret (shown only here) and record. */
export interface KeyWithSecret {
  key: string;
  record: KeyRecord;
}

/** `GET /health`. */
export interface Health {
  status: "ok";
  uptime: number;
  version?: string;
  backend?: string;
  sessions?: number;
  /** This host's id behind a router (`--host-id`), else null. */
  host?: string | null;
  /** `serving`, `draining` or `drained`. */
  drain?: "serving" | "draining" | "drained";
}

/** `GET /ready`. */
export interface Readiness {
  status: "ready" | "not_ready";
  checks: { accepting: boolean; vmm: boolean; images: boolean; capacity: boolean; serving: boolean } & Record<string, boolean>;
  ready?: boolean;
  /** What failed, when not ready. */
  reason?: string;
  sessions?: number;
  maxSessions?: number;
  host?: string | null;
  drain?: "serving" | "draining" | "drained";
}
