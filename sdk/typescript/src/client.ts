/**
 * The HTTP layer: configuration, the one request function (auth, errors,
 * retries) and the NDJSON reader. Uses only the platform's `fetch`,
 * `ReadableStream` and `TextDecoder`.
 *
 * @module
 */
import { ConnectionError, SandboxError, errorFromBody } from "./errors.js";

/** Retries of transient answers (429 `rate_limited`/`auth_throttled`, any 503) on idempotent calls. */
export interface RetryOptions {
  /** Retries after the first try (default 3; 0 turns retries off). */
  retries?: number;
  /** First backoff in ms, doubled each retry, with jitter (default 200). */
  baseDelayMs?: number;
  /** Longest wait before one retry, ms (default 10000); a longer `Retry-After` is not waited for. */
  maxDelayMs?: number;
}

/** Where the daemon is and how to talk to it. */
export interface ClientOptions {
  /** Base URL, e.g. `http://127.0.0.1:3000`. Default: `AGENT_SANDBOX_URL`, else `http://127.0.0.1:3000`. */
  url?: string;
  /** API key. Default: `AGENT_SANDBOX_API_KEY` (none: requests go without a key). */
  apiKey?: string;
  /** Retry policy, or `false` for none. */
  retry?: RetryOptions | false;
  /** A `fetch` to use instead of the global one. */
  fetch?: typeof fetch;
  /** Extra headers on every request. */
  headers?: Record<string, string>;
}

/** A reused {@link Client}, or options to make one. */
export type ClientLike = Client | ClientOptions | undefined;

/** Query parameters; `undefined` values are left out. */
export type Query = Record<string, string | number | boolean | undefined>;

/** Request body: JSON (any value given as `json`), or raw bytes / a stream (`body`). */
export interface RequestOptions {
  query?: Query;
  json?: unknown;
  body?: BodyInit | Uint8Array | null;
  headers?: Record<string, string>;
  /** Safe to repeat (so 429/503 are retried). Default: GET, PUT, DELETE and HEAD are. */
  idempotent?: boolean;
  signal?: AbortSignal;
  /** Statuses besides 2xx answered as a `Response`, not thrown (`/ready`'s 503). */
  alsoOk?: number[];
}

function env(name: string): string | undefined {
  const g = globalThis as { process?: { env?: Record<string, string | undefined> }; Deno?: { env?: { get(n: string): string | undefined } } };
  const v = g.process?.env?.[name];
  if (v !== undefined) return v;
  try {
    return g.Deno?.env?.get(name);
  } catch {
    return undefined; // Deno without --allow-env
  }
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** A connection to one daemon. Cheap; share one between many sandboxes. */
export class Client {
  /** Base URL without a trailing slash. */
  readonly url: string;
  readonly #apiKey: string | undefined;
  readonly #retry: Required<RetryOptions>;
  readonly #fetch: typeof fetch;
  readonly #headers: Record<string, string>;

  constructor(options: ClientOptions = {}) {
    this.url = (options.url ?? env("AGENT_SANDBOX_URL") ?? "http://127.0.0.1:3000").replace(/\/+$/, "");
    this.#apiKey = options.apiKey ?? env("AGENT_SANDBOX_API_KEY");
    const r = options.retry === false ? { retries: 0 } : options.retry ?? {};
    this.#retry = { retries: r.retries ?? 3, baseDelayMs: r.baseDelayMs ?? 200, maxDelayMs: r.maxDelayMs ?? 10_000 };
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#headers = options.headers ?? {};
  }

  /**
   * The header that authenticates a request as this client's key
   * (`{ authorization: "Bearer ..." }`; empty without a key): what a request
   * to a preview URL of a port that is not public needs.
   */
  authHeaders(): Record<string, string> {
    return this.#apiKey ? { authorization: `Bearer ${this.#apiKey}` } : {};
  }

  /** `client` itself when it is one, else a new client from the options. */
  static of(client: ClientLike): Client {
    return client instanceof Client ? client : new Client(client);
  }

  /**
   * Sends one request and answers its `Response` when the status is 2xx;
   * an error answer is thrown as its {@link SandboxError} subclass.
   * Transient answers of idempotent requests are retried per {@link RetryOptions}.
   */
  async request(method: string, path: string, opts: RequestOptions = {}): Promise<Response> {
    const url = new URL(this.url + path);
    for (const [k, v] of Object.entries(opts.query ?? {})) if (v !== undefined) url.searchParams.set(k, String(v));
    const headers: Record<string, string> = { ...this.#headers, ...opts.headers };
    if (this.#apiKey) headers["authorization"] = `Bearer ${this.#apiKey}`;
    let body = opts.body as BodyInit | null | undefined;
    if (opts.json !== undefined) {
      body = JSON.stringify(opts.json);
      headers["content-type"] = "application/json";
    }
    const streamed = typeof ReadableStream !== "undefined" && body instanceof ReadableStream;
    const idempotent = (opts.idempotent ?? ["GET", "PUT", "DELETE", "HEAD"].includes(method)) && !streamed;
    const init: RequestInit & { duplex?: "half" } = { method, headers, body: body ?? null, signal: opts.signal ?? null };
    if (streamed) init.duplex = "half"; // fetch's rule for a streamed request body
    for (let attempt = 0; ; attempt++) {
      let res: Response;
      try {
        res = await this.#fetch(url, init);
      } catch (e) {
        if ((e as Error)?.name === "AbortError") throw e;
        const cause = (e as { cause?: { message?: string } })?.cause?.message;
        throw new ConnectionError(`${method} ${url.pathname}: ${(e as Error)?.message ?? e}${cause ? ` (${cause})` : ""}`, 0, "connection_error");
      }
      if (res.ok || opts.alsoOk?.includes(res.status)) return res;
      const err = await errorOf(res);
      const delay = this.#retryDelay(err, attempt);
      if (!idempotent || delay === undefined) throw err;
      await sleep(delay);
    }
  }

  /** {@link Client.request} and its JSON body. */
  async json<T>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const res = await this.request(method, path, opts);
    return (await res.json()) as T;
  }

  /** How long to wait before retrying after `err`, or undefined for not retrying. */
  #retryDelay(err: SandboxError, attempt: number): number | undefined {
    const transient = err.status === 503 || (err.status === 429 && err.code !== "quota_exceeded");
    if (!transient || attempt >= this.#retry.retries) return undefined;
    const backoff = this.#retry.baseDelayMs * 2 ** attempt * (0.5 + Math.random() / 2);
    const delay = Math.max(backoff, (err.retryAfter ?? 0) * 1000);
    return delay > this.#retry.maxDelayMs ? undefined : delay;
  }
}

/** The {@link SandboxError} of a non-2xx response. */
export async function errorOf(res: Response): Promise<SandboxError> {
  const ra = res.headers.get("retry-after");
  const retryAfter = ra !== null && /^\d+$/.test(ra.trim()) ? Number(ra) : undefined;
  const text = await res.text().catch(() => "");
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    body = { error: { code: "", message: text.slice(0, 500) || res.statusText } };
  }
  return errorFromBody(res.status, body, retryAfter);
}

/**
 * The JSON objects of an NDJSON body, one per line, as they arrive.
 * Breaking out of the loop cancels the body (the daemon then stops a
 * foreground command).
 */
export async function* ndjson(body: ReadableStream<Uint8Array> | null): AsyncGenerator<Record<string, unknown>> {
  if (!body) return;
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let done = false;
  try {
    while (!done) {
      const chunk = await reader.read();
      done = chunk.done;
      buf += done ? decoder.decode() : decoder.decode(chunk.value, { stream: true });
      let nl: number;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (line) yield JSON.parse(line) as Record<string, unknown>;
      }
    }
    if (buf.trim()) yield JSON.parse(buf) as Record<string, unknown>;
  } finally {
    if (!done) await reader.cancel().catch(() => undefined);
    reader.releaseLock();
  }
}
