/**
 * {@link Sandbox}: one session (a microVM) and everything in it.
 *
 * @module
 */
import { Client, type ClientLike, type ClientOptions, type RequestOptions, ndjson } from "./client.js";
import { NotFound, SandboxError, SessionNotFound, errorFromBody } from "./errors.js";
import type {
  CommandEvent,
  CommandExit,
  CommandResult,
  Egress,
  ExposeOptions,
  FailedCopy,
  FileEntry,
  FileStat,
  NetworkState,
  PortInfo,
  ProcessInfo,
  SandboxCreateOptions,
  SecretInfo,
  SecretSpec,
  SessionInfo,
  Snapshot,
} from "./types.js";

/** How to reach the daemon: a shared {@link Client}, or options for a new one. */
export interface ConnectOptions extends ClientOptions {
  /** Reuse this client (its url / key / retries) instead of making one. */
  client?: Client;
  /** Admin keys: address a session of another key (`?owner=<key id>`). */
  owner?: string;
}

/** Options of {@link Sandbox.create}: the session's settings and where the daemon is. */
export type CreateOptions = SandboxCreateOptions & ConnectOptions;

/** Options of a command, foreground or background. */
export interface CommandOptions {
  /** Working directory (default: the workspace). */
  cwd?: string;
  /** Variables added to the session's. */
  env?: Record<string, string>;
  /** Milliseconds; the process group is killed after it (`timedOut: true`). */
  timeout?: number;
  /** Bytes fed to stdin, then EOF. */
  stdin?: string | Uint8Array;
  /**
   * Output as exact bytes too (`bytes` on events, `stdoutBytes` / `stderrBytes`
   * on results), for binary output; `data` / `stdout` stay its UTF-8 reading.
   */
  binary?: boolean;
  /**
   * Files `/run/secrets/NAME` (mode 0400) for this command only, removed when
   * it ends; each value is masked as `****` in its output. Not for `start`.
   */
  secrets?: Record<string, string>;
  /**
   * Aborting it disconnects; the daemon then kills the foreground command
   * (it notices the disconnect when the command next prints).
   */
  signal?: AbortSignal;
}

/** Options of {@link Commands.run}. */
export interface RunOptions extends CommandOptions {
  /** Called with each stdout chunk as it arrives. */
  onStdout?: (data: string) => void;
  /** Called with each stderr chunk as it arrives. */
  onStderr?: (data: string) => void;
}

/** Options of {@link Commands.start}. */
export interface StartOptions extends Omit<CommandOptions, "signal" | "binary" | "secrets"> {
  /** A label shown in process listings. */
  tag?: string;
  /** Run on a terminal of this size (all output is stdout). */
  pty?: { rows: number; cols: number };
}

/** A signal name (`"TERM"`, `"SIGKILL"`, any case) or number (1-64). */
export type Signal = string | number;


/** Base64 of bytes, without Node's Buffer. */
export function toBase64(bytes: Uint8Array): string {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function execBody(cmd: string | string[], o: CommandOptions & StartOptions, extra: Record<string, unknown> = {}) {
  const body: Record<string, unknown> = Array.isArray(cmd) ? { argv: cmd } : { command: cmd };
  if (o.cwd !== undefined) body.cwd = o.cwd;
  if (o.env !== undefined) body.env = o.env;
  if (o.timeout !== undefined) body.timeout = o.timeout;
  if (typeof o.stdin === "string") body.stdin = o.stdin;
  else if (o.stdin !== undefined) body.stdinBase64 = toBase64(o.stdin);
  if (o.tag !== undefined) body.tag = o.tag;
  if (o.pty !== undefined) body.pty = o.pty;
  if (o.binary) body.encoding = "base64";
  if (o.secrets !== undefined) body.secrets = o.secrets;
  return { ...body, ...extra };
}

/** Bytes of base64 text, without Node's Buffer. */
export function fromBase64(text: string): Uint8Array {
  const s = atob(text);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

function exitOf(raw: Record<string, unknown>): CommandExit {
  return {
    exitCode: raw.exitCode as number,
    signal: (raw.signal as string | null) ?? null,
    timedOut: Boolean(raw.timedOut),
    durationMs: (raw.durationMs as number | undefined) ?? (raw.duration as number),
    resourceUsage: (raw.resourceUsage as CommandExit["resourceUsage"]) ?? null,
    oomKilled: Boolean(raw.oomKilled),
  };
}

/** The daemon's stream lines as {@link CommandEvent}s; an error line is thrown as its error class. */
async function* events(body: ReadableStream<Uint8Array> | null): AsyncGenerator<CommandEvent> {
  // Base64 chunks are read per stream, so a character split between chunks stays whole.
  const text = { stdout: new TextDecoder(), stderr: new TextDecoder() };
  for await (const raw of ndjson(body)) {
    switch (raw.type) {
      case "started":
        yield { type: "started", procId: raw.procId as number, pid: raw.pid as number };
        break;
      case "stream": {
        const type = raw.stream === "stderr" ? "stderr" : "stdout";
        if (raw.encoding === "base64") {
          const bytes = fromBase64(raw.data as string);
          yield { type, data: text[type].decode(bytes, { stream: true }), ts: raw.ts as number, bytes };
        } else yield { type, data: raw.data as string, ts: raw.ts as number };
        break;
      }
      case "dropped":
        yield { type: "dropped", bytes: raw.bytes as number };
        break;
      case "result":
        yield { type: "exit", ...exitOf(raw) };
        return;
      case "error":
        throw errorFromBody(0, raw);
    }
  }
}

/** Runs the events to the end, collecting output: the {@link CommandResult}. */
async function collect(evs: AsyncIterable<CommandEvent>, o: RunOptions & { binary?: boolean } = {}): Promise<CommandResult> {
  let stdout = "";
  let stderr = "";
  const bytes = { stdout: [] as Uint8Array[], stderr: [] as Uint8Array[] };
  let procId: number | undefined;
  for await (const ev of evs) {
    if (ev.type === "started") procId = ev.procId;
    else if (ev.type === "stdout") {
      stdout += ev.data;
      if (ev.bytes) bytes.stdout.push(ev.bytes);
      o.onStdout?.(ev.data);
    } else if (ev.type === "stderr") {
      stderr += ev.data;
      if (ev.bytes) bytes.stderr.push(ev.bytes);
      o.onStderr?.(ev.data);
    } else if (ev.type === "exit") {
      const { type: _, ...exit } = ev;
      const r: CommandResult = { ...exit, stdout, stderr, truncated: false, procId };
      if (o.binary) Object.assign(r, { stdoutBytes: concat(bytes.stdout), stderrBytes: concat(bytes.stderr) });
      return r;
    }
  }
  throw new SandboxError("the output stream ended before the command's result", 0, "stream_ended");
}

/** Commands of a sandbox: foreground (buffered or streamed) and background processes. */
export class Commands {
  readonly #sb: Sandbox;
  /** @internal */
  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }

  /**
   * Runs `cmd` (a string: a `/bin/sh -c` line; an array: program + args, no shell)
   * and answers when it ends, whatever its exit code. With `onStdout`/`onStderr`
   * the output is streamed to them as it comes.
   */
  async run(cmd: string | string[], opts: RunOptions = {}): Promise<CommandResult> {
    if (opts.onStdout || opts.onStderr) return collect(this.stream(cmd, opts), opts);
    const raw = await this.#sb.json<Record<string, unknown>>("POST", "/exec", { json: execBody(cmd, opts), signal: opts.signal });
    const out = (raw.output as { stream: string; data: string; encoding?: string }[] | undefined) ?? [];
    const result: CommandResult = { ...exitOf(raw), stdout: "", stderr: "", truncated: Boolean(raw.truncated), procId: raw.procId as number | undefined };
    for (const s of ["stdout", "stderr"] as const) {
      const chunks = out.filter((c) => c.stream === s);
      if (opts.binary) {
        const b = concat(chunks.map((c) => (c.encoding === "base64" ? fromBase64(c.data) : new TextEncoder().encode(c.data))));
        result[s] = new TextDecoder().decode(b);
        result[s === "stdout" ? "stdoutBytes" : "stderrBytes"] = b;
      } else result[s] = chunks.map((c) => c.data).join("");
    }
    return result;
  }

  /**
   * Runs `cmd` and yields its events as the guest produces them: `started`,
   * `stdout`/`stderr` chunks in order, then `exit`. Breaking out of the loop
   * (or aborting `opts.signal`) disconnects, and the daemon kills the command
   * (when it next prints: a silent command runs on to its timeout).
   */
  stream(cmd: string | string[], opts: CommandOptions = {}): AsyncGenerator<CommandEvent> {
    return this.#events("POST", "/exec", { json: execBody(cmd, opts), signal: opts.signal });
  }

  /** Starts `cmd` in the background and answers at once with its handle. */
  async start(cmd: string | string[], opts: StartOptions = {}): Promise<Process> {
    const r = await this.#sb.json<{ procId: number; pid: number }>("POST", "/exec", { json: execBody(cmd, opts, { background: true }) });
    return new Process(this.#sb, r.procId, r.pid);
  }

  /** A handle on background process `procId` (no request made). */
  process(procId: number): Process {
    return new Process(this.#sb, procId);
  }

  /**
   * Yields a background process's events until it exits: what it printed so far
   * first (unless `replay: false`), then live output, then `exit`.
   */
  attach(procId: number, opts: { replay?: boolean; binary?: boolean; signal?: AbortSignal } = {}): AsyncGenerator<CommandEvent> {
    const query = { replay: opts.replay ?? true, encoding: opts.binary ? "base64" : undefined };
    return this.#events("GET", `/processes/${procId}/output`, { query, signal: opts.signal });
  }

  /** An NDJSON request's events; leaving early aborts the request (so the daemon sees the client go). */
  async *#events(method: string, sub: string, opts: RequestOptions): AsyncGenerator<CommandEvent> {
    const ctrl = new AbortController();
    const outer = opts.signal;
    const onAbort = () => ctrl.abort(outer?.reason);
    if (outer?.aborted) onAbort();
    outer?.addEventListener("abort", onAbort, { once: true });
    let finished = false;
    try {
      const res = await this.#sb.request(method, sub, { ...opts, headers: { accept: "application/x-ndjson" }, signal: ctrl.signal });
      for await (const ev of events(res.body)) {
        if (ev.type === "exit") finished = true;
        yield ev;
      }
      finished = true;
    } finally {
      outer?.removeEventListener("abort", onAbort);
      if (!finished) ctrl.abort();
    }
  }

  /** Waits for a background process to exit; its output replayed and collected. */
  wait(procId: number, opts: Omit<RunOptions, Exclude<keyof CommandOptions, "binary">> = {}): Promise<CommandResult> {
    return collect(this.attach(procId, { binary: opts.binary }), opts).then((r) => ({ ...r, procId }));
  }

  /** Sends bytes to a background process's stdin (`eof: true` closes it after). */
  async sendStdin(procId: number, data: string | Uint8Array, opts: { eof?: boolean } = {}): Promise<void> {
    await this.#sb.request("POST", `/processes/${procId}/stdin`, {
      query: { eof: opts.eof || undefined },
      body: typeof data === "string" ? new TextEncoder().encode(data) : data,
      headers: { "content-type": "application/octet-stream" },
    });
  }

  /** Sends a signal (default SIGTERM) to a background process. */
  async signal(procId: number, signal: Signal = "TERM"): Promise<void> {
    await this.#sb.request("POST", `/processes/${procId}/signal`, { json: { signal } });
  }

  /** SIGKILLs a background process. */
  kill(procId: number): Promise<void> {
    return this.signal(procId, "KILL");
  }

  /** One process of the session, running or finished. */
  get(procId: number): Promise<ProcessInfo> {
    return this.#sb.json<ProcessInfo>("GET", `/processes/${procId}`);
  }

  /** The session's processes, running and recently finished. */
  async list(): Promise<ProcessInfo[]> {
    return (await this.#sb.json<{ processes: ProcessInfo[] }>("GET", "/processes")).processes;
  }

  /** SIGKILLs every process in the sandbox; files and the session stay. */
  killAll(): Promise<{ killed: number; remaining: number }> {
    return this.#sb.json("DELETE", "/processes");
  }
}

/** Terminals: background processes on a PTY. */
export class Pty {
  readonly #sb: Sandbox;
  /** @internal */
  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }

  /** Starts `cmd` (default a shell) on a terminal of `rows` × `cols`. */
  create(opts: { rows: number; cols: number; cmd?: string | string[] } & Omit<StartOptions, "pty">): Promise<Process> {
    const { rows, cols, cmd, ...rest } = opts;
    return this.#sb.commands.start(cmd ?? ["/bin/sh", "-i"], { ...rest, pty: { rows, cols } });
  }

  /** Resizes the terminal of PTY process `procId`. */
  async resize(procId: number, size: { rows: number; cols: number }): Promise<void> {
    await this.#sb.request("POST", `/processes/${procId}/resize`, { json: size, idempotent: true });
  }
}

/** A background process of a sandbox. */
export class Process {
  readonly sandbox: Sandbox;
  readonly procId: number;
  /** Its pid in the guest (unknown for a handle made from an id alone). */
  readonly pid: number | undefined;
  /** @internal */
  constructor(sandbox: Sandbox, procId: number, pid?: number) {
    this.sandbox = sandbox;
    this.procId = procId;
    this.pid = pid;
  }
  /** {@link Commands.attach} */
  attach(opts: { replay?: boolean; binary?: boolean; signal?: AbortSignal } = {}): AsyncGenerator<CommandEvent> {
    return this.sandbox.commands.attach(this.procId, opts);
  }
  /** {@link Commands.wait} */
  wait(opts: Omit<RunOptions, Exclude<keyof CommandOptions, "binary">> = {}): Promise<CommandResult> {
    return this.sandbox.commands.wait(this.procId, opts);
  }
  /** {@link Commands.sendStdin} */
  sendStdin(data: string | Uint8Array, opts: { eof?: boolean } = {}): Promise<void> {
    return this.sandbox.commands.sendStdin(this.procId, data, opts);
  }
  /** {@link Commands.signal} */
  signal(signal: Signal = "TERM"): Promise<void> {
    return this.sandbox.commands.signal(this.procId, signal);
  }
  /** {@link Commands.kill} */
  kill(): Promise<void> {
    return this.sandbox.commands.kill(this.procId);
  }
  /** {@link Pty.resize} */
  resize(rows: number, cols: number): Promise<void> {
    return this.sandbox.pty.resize(this.procId, { rows, cols });
  }
  /** {@link Commands.get} */
  info(): Promise<ProcessInfo> {
    return this.sandbox.commands.get(this.procId);
  }
}

/** What {@link Files.write} takes: text, bytes, a Blob, or a stream (sent as it is read). */
export type FileData = string | Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array>;

/** Files of a sandbox. Relative paths are under the session's workspace. */
export class Files {
  readonly #sb: Sandbox;
  /** @internal */
  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }

  #content(method: string, path: string, opts: RequestOptions = {}): Promise<Response> {
    return this.#sb.request(method, "/files/content", { ...opts, query: { path, ...opts.query } });
  }

  /** The file as text (UTF-8). */
  async read(path: string): Promise<string> {
    return (await this.#content("GET", path)).text();
  }

  /** The file's bytes. */
  async readBytes(path: string): Promise<Uint8Array> {
    return new Uint8Array(await (await this.#content("GET", path)).arrayBuffer());
  }

  /** The file as a stream of bytes, read as it comes (for large files). */
  async download(path: string, opts: { signal?: AbortSignal } = {}): Promise<ReadableStream<Uint8Array>> {
    const res = await this.#content("GET", path, opts);
    return res.body ?? new ReadableStream({ start: (c) => c.close() });
  }

  /**
   * Writes the file (atomically; parents created). A `ReadableStream` is
   * uploaded as it is read, so large files need not be in memory.
   * `mode` is the permission bits, e.g. `0o755`.
   */
  async write(path: string, data: FileData, opts: { mode?: number; signal?: AbortSignal } = {}): Promise<{ path: string; bytes: number }> {
    const body = typeof data === "string" ? new TextEncoder().encode(data) : data;
    const res = await this.#content("PUT", path, {
      body: body as BodyInit,
      query: { mode: opts.mode?.toString(8) },
      headers: { "content-type": "application/octet-stream" },
      signal: opts.signal,
    });
    return (await res.json()) as { path: string; bytes: number };
  }

  /** The entries of a directory (default the workspace). */
  async list(path = ".", opts: { recursive?: boolean } = {}): Promise<FileEntry[]> {
    const r = await this.#sb.json<{ files: FileEntry[] }>("GET", "/files/list", { query: { path, recursive: opts.recursive || undefined } });
    return r.files;
  }

  /** A file's metadata. */
  stat(path: string): Promise<FileStat> {
    return this.#sb.json<FileStat>("GET", "/files/stat", { query: { path } });
  }

  /** Whether the path exists. */
  async exists(path: string): Promise<boolean> {
    try {
      await this.stat(path);
      return true;
    } catch (e) {
      if (e instanceof SandboxError && e.status === 404 && e.code === "file_not_found") return false;
      throw e;
    }
  }

  /** Makes a directory (with its parents unless `parents: false`). */
  async mkdir(path: string, opts: { parents?: boolean } = {}): Promise<void> {
    const parents = opts.parents ?? true;
    await this.#sb.request("POST", "/files/mkdir", { json: { path, parents }, idempotent: parents });
  }

  /** Removes a file, or a directory (`recursive: true` for a non-empty one). */
  async remove(path: string, opts: { recursive?: boolean } = {}): Promise<void> {
    await this.#sb.request("POST", "/files/remove", { json: { path, recursive: opts.recursive ?? false } });
  }

  /** Renames (moves) `from` to `to`; `overwrite: false` refuses an existing target. */
  async rename(from: string, to: string, opts: { overwrite?: boolean } = {}): Promise<void> {
    await this.#sb.request("POST", "/files/rename", { json: { from, to, overwrite: opts.overwrite ?? true } });
  }
}

/** A sandbox's network policy. */
export class Network {
  readonly #sb: Sandbox;
  /** @internal */
  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }
  /** The policy in force. */
  async get(): Promise<Egress> {
    return (await this.#sb.json<NetworkState>("GET", "/network")).egress;
  }
  /** Replaces the policy; answers the one now in force (`EgressNotApplied` if it could not be). */
  async set(egress: Egress): Promise<Egress> {
    return (await this.#sb.json<NetworkState>("PUT", "/network", { json: egress })).egress;
  }
}

/**
 * A sandbox's injected secrets: credentials the guest never holds. Each command
 * sees `NAME=asbx-secret-<32 hex>`, a placeholder; the egress proxy replaces it
 * with the value in the named header of HTTPS requests to the secret's hosts
 * and refuses it (403) anywhere else. Values are never shown back.
 *
 * ```ts
 * const sb = await Sandbox.create({
 *   secrets: [{ name: "OPENAI_API_KEY", value: key, hosts: ["api.openai.com"], format: "Bearer {value}" }],
 * });
 * ```
 */
export class Secrets {
  readonly #sb: Sandbox;
  /** @internal */
  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }
  /** Names, hosts, headers and placeholders (never a value). */
  async list(): Promise<SecretInfo[]> {
    return (await this.#sb.json<{ secrets: SecretInfo[] }>("GET", "/secrets")).secrets;
  }
  /**
   * Replaces the whole set, live (`[]`: none; a name kept keeps its placeholder);
   * the next command sees the new variables. `EgressNotApplied` without
   * per-session networking; `BadRequest` names a bad secret, never its value.
   */
  async set(secrets: SecretSpec[]): Promise<SecretInfo[]> {
    return (await this.#sb.json<{ secrets: SecretInfo[] }>("PUT", "/secrets", { json: { secrets } })).secrets;
  }
}

/**
 * Guest ports reached from outside through the daemon's preview listener
 * (`serve --preview-listen ADDR`; else `NotSupported`).
 *
 * ```ts
 * await sb.commands.start("python3 -m http.server 8000");
 * const { url } = await sb.ports.expose(8000);
 * await fetch(url, { headers: sb.client.authHeaders() }); // not public: the key too
 * ```
 */
export class Ports {
  readonly #sb: Sandbox;
  /** @internal */
  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }
  /**
   * Opens guest `port` (1-65535). Not `public` (the default): requests also need
   * the owner's API key, which the guest never sees. An open port gets a new URL
   * (the old one stops working).
   */
  expose(port: number, opts: ExposeOptions = {}): Promise<PortInfo> {
    return this.#sb.json<PortInfo>("POST", "/ports", { json: { port, ttl: opts.ttl, public: opts.public ?? false } });
  }
  /** The open ports (expired ones are gone). */
  async list(): Promise<PortInfo[]> {
    return (await this.#sb.json<{ ports: PortInfo[] }>("GET", "/ports")).ports;
  }
  /** Closes `port` (its URLs answer 404): true, or false when it was not open. */
  async close(port: number): Promise<boolean> {
    try {
      await this.#sb.request("DELETE", `/ports/${encodeURIComponent(String(port))}`);
      return true;
    } catch (e) {
      if (e instanceof NotFound) return false;
      throw e;
    }
  }
  /**
   * The URL of guest `port`: that of its open grant when it has one with the
   * same `public`, else a new grant's ({@link Ports.expose}, which replaces a
   * grant with the other `public`).
   */
  async getUrl(port: number, opts: ExposeOptions = {}): Promise<string> {
    const pub = opts.public ?? false;
    const open = (await this.list()).find((p) => p.port === port && p.public === pub);
    return open ? open.url : (await this.expose(port, opts)).url;
  }
}

/** Sessions started together (a fork, or several from one snapshot). */
export interface StartedSandboxes {
  /** The copies that started. */
  sandboxes: Sandbox[];
  /** The copies that failed to start (already removed). */
  failed: FailedCopy[];
}

/** What {@link Sandbox.fork} answers. */
export interface ForkResult extends StartedSandboxes {
  sourceId: string;
  /** How long the source's guest was stopped. */
  pausedMs: number;
  snapshotBytes: number;
}

function started(client: Client, sessions: (SessionInfo | FailedCopy)[], owner?: string): StartedSandboxes {
  return {
    sandboxes: sessions.filter((s): s is SessionInfo => !("error" in s)).map((s) => new Sandbox(client, s, owner)),
    failed: sessions.filter((s): s is FailedCopy => "error" in s),
  };
}

const asyncDispose: typeof Symbol.asyncDispose =
  (Symbol as { asyncDispose?: typeof Symbol.asyncDispose }).asyncDispose ?? (Symbol.for("Symbol.asyncDispose") as typeof Symbol.asyncDispose);

const CREATE_FIELDS = ["id", "template", "vcpus", "memoryMib", "diskMib", "ttl", "idleTimeout", "env", "egress", "onIdle", "pausedTtl", "fromSnapshot", "secrets"] as const;

/**
 * One session: a microVM of its own, destroyed by {@link Sandbox.kill} (or
 * `await using`, or {@link withSandbox}).
 *
 * ```ts
 * await using sb = await Sandbox.create({ template: "python" });
 * const r = await sb.commands.run("python3 -c 'print(6*7)'");
 * ```
 */
export class Sandbox {
  /** The session id. */
  readonly id: string;
  readonly client: Client;
  /** The session as last seen (by create, connect, {@link Sandbox.refresh}, pause, resume). */
  info: SessionInfo;
  readonly commands: Commands;
  readonly files: Files;
  readonly pty: Pty;
  readonly network: Network;
  /** Injected secrets (credential placeholders). */
  readonly secrets: Secrets;
  /** Preview URLs of guest ports. */
  readonly ports: Ports;
  readonly #owner: string | undefined;

  /** @internal Use {@link Sandbox.create} or {@link Sandbox.connect}. */
  constructor(client: Client, info: SessionInfo, owner?: string) {
    this.client = client;
    this.info = info;
    this.id = info.id;
    this.#owner = owner;
    this.commands = new Commands(this);
    this.files = new Files(this);
    this.pty = new Pty(this);
    this.network = new Network(this);
    this.secrets = new Secrets(this);
    this.ports = new Ports(this);
  }

  /** Creates a session and answers once its sandbox is ready. */
  static async create(opts: CreateOptions = {}): Promise<Sandbox> {
    const client = clientOf(opts);
    const body: Record<string, unknown> = {};
    for (const k of CREATE_FIELDS) if (opts[k] !== undefined) body[k] = opts[k];
    // With an id a repeat cannot make a second session (it is `session_exists`).
    const info = await client.json<SessionInfo>("POST", "/v1/sessions", { json: body, idempotent: opts.id !== undefined });
    return new Sandbox(client, info, opts.owner);
  }

  /**
   * Starts `count` sessions from one snapshot (each its own VM, with the
   * snapshot's files, processes and memory), answered once each is ready.
   */
  static async createFromSnapshot(snapshotId: string, count: number, opts: Omit<CreateOptions, "fromSnapshot" | "id"> = {}): Promise<StartedSandboxes> {
    const client = clientOf(opts);
    const body: Record<string, unknown> = { fromSnapshot: snapshotId, count };
    for (const k of CREATE_FIELDS) if (k !== "fromSnapshot" && k !== "id" && opts[k] !== undefined) body[k] = opts[k];
    const r = await client.json<{ sessions: (SessionInfo | FailedCopy)[] }>("POST", "/v1/sessions", { json: body });
    return started(client, r.sessions, opts.owner);
  }

  /** A handle on an existing session (`SessionNotFound` if there is none). */
  static async connect(id: string, opts: ConnectOptions = {}): Promise<Sandbox> {
    const client = clientOf(opts);
    const info = await client.json<SessionInfo>("GET", `/v1/sessions/${encodeURIComponent(id)}`, { query: { owner: opts.owner } });
    return new Sandbox(client, info, opts.owner);
  }

  /** The key's sessions (every key's, with their `owner`, for an admin key). */
  static async list(opts: ClientLike = {}): Promise<SessionInfo[]> {
    return (await Client.of(opts).json<{ sessions: SessionInfo[] }>("GET", "/v1/sessions")).sessions;
  }

  /** @internal A request to a route under this session. */
  request(method: string, sub: string, opts: RequestOptions = {}): Promise<Response> {
    return this.client.request(method, `/v1/sessions/${encodeURIComponent(this.id)}${sub}`, {
      ...opts,
      query: { owner: this.#owner, ...opts.query },
    });
  }

  /** @internal */
  async json<T>(method: string, sub: string, opts: RequestOptions = {}): Promise<T> {
    return (await (await this.request(method, sub, opts)).json()) as T;
  }

  async #update(method: string, sub: string, idempotent?: boolean): Promise<SessionInfo> {
    this.info = await this.json<SessionInfo>(method, sub, { idempotent });
    return this.info;
  }

  /** The session now. */
  refresh(): Promise<SessionInfo> {
    return this.#update("GET", "");
  }

  /** Counts as activity: resets the idle timer. */
  keepalive(): Promise<SessionInfo> {
    return this.#update("POST", "/keepalive", true);
  }

  /** A URL that reaches guest `port` from outside: {@link Ports.getUrl}. */
  getUrl(port: number, opts: ExposeOptions = {}): Promise<string> {
    return this.ports.getUrl(port, opts);
  }

  /** Destroys the session and its sandbox: true, or false when it was already gone. */
  async kill(): Promise<boolean> {
    try {
      const r = await this.json<{ destroyed?: boolean }>("DELETE", "");
      return r.destroyed ?? true;
    } catch (e) {
      if (e instanceof SessionNotFound) return false;
      throw e;
    }
  }

  /** Saves the whole running state as a snapshot; the session runs on. */
  checkpoint(opts: { name?: string } = {}): Promise<Snapshot> {
    return this.json<Snapshot>("POST", "/snapshots", { json: opts });
  }

  /** A checkpoint plus `count` new sessions started from it; the source runs on. */
  async fork(count = 1): Promise<ForkResult> {
    const r = await this.json<{ sourceId: string; pausedMs: number; snapshotBytes: number; sessions: (SessionInfo | FailedCopy)[] }>(
      "POST",
      "/fork",
      { json: { count } },
    );
    return { sourceId: r.sourceId, pausedMs: r.pausedMs, snapshotBytes: r.snapshotBytes, ...started(this.client, r.sessions, this.#owner) };
  }

  /** Saves the state and stops the VM; it stays listed as `paused`. */
  pause(): Promise<SessionInfo> {
    return this.#update("POST", "/pause");
  }

  /** Restores a paused session where it was (a running one is answered as it is). */
  resume(): Promise<SessionInfo> {
    return this.#update("POST", "/resume", true);
  }

  /** `await using sb = await Sandbox.create()`: kills the session at the end of the scope. */
  async [asyncDispose](): Promise<void> {
    await this.kill();
  }
}

function clientOf(opts: ConnectOptions): Client {
  return opts.client ?? new Client(opts);
}

/**
 * Creates a sandbox, runs `fn` with it and destroys it afterwards, also when
 * `fn` throws (for runtimes without `await using`).
 */
export async function withSandbox<T>(opts: CreateOptions, fn: (sandbox: Sandbox) => Promise<T> | T): Promise<T> {
  const sb = await Sandbox.create(opts);
  let threw = true;
  try {
    const out = await fn(sb);
    threw = false;
    return out;
  } finally {
    // A failure to clean up must not hide the body's own error.
    await sb.kill().catch((e) => {
      if (!threw) throw e;
    });
  }
}
