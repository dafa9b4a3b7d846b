/**
 * Calls outside one session: one-shot runs, templates, snapshots, admin keys, health.
 *
 * @module
 */
import { Client, type ClientLike } from "./client.js";
import type { Health, KeyRecord, Readiness, KeyWithSecret, RunLimits, RunResult, Snapshot, Template } from "./types.js";

/** A language {@link run} takes. */
export type Language = "python" | "node" | "bash";

/**
 * Runs one program in a sandbox made for the call and destroyed after it
 * (`POST /v1/run`). Answers whatever the program's exit.
 */
export function run(language: Language, code: string, limits: RunLimits = {}, client?: ClientLike): Promise<RunResult> {
  return Client.of(client).json<RunResult>("POST", "/v1/run", { json: { language, code, limits } });
}

/** The templates with a built image. */
export async function templates(client?: ClientLike): Promise<Template[]> {
  return (await Client.of(client).json<{ templates: Template[] }>("GET", "/v1/templates")).templates;
}

/** `GET /health` (needs no key). */
export function health(client?: ClientLike): Promise<Health> {
  return Client.of(client).json<Health>("GET", "/health");
}

/** `GET /ready` (needs no key): whether the daemon can start sessions now, check by check. */
export function ready(client?: ClientLike): Promise<Readiness> {
  return Client.of(client).json<Readiness>("GET", "/ready", { alsoOk: [503] });
}

/** `GET /metrics` (the `metrics` scope): OpenMetrics text. */
export async function metrics(client?: ClientLike): Promise<string> {
  return (await Client.of(client).request("GET", "/metrics")).text();
}

/** Snapshots of the key (every key's for an admin key). Take one with `sandbox.checkpoint()`. */
export class Snapshots {
  readonly client: Client;
  constructor(client?: ClientLike) {
    this.client = Client.of(client);
  }
  async list(): Promise<Snapshot[]> {
    return (await this.client.json<{ snapshots: Snapshot[] }>("GET", "/v1/snapshots")).snapshots;
  }
  get(id: string): Promise<Snapshot> {
    return this.client.json<Snapshot>("GET", `/v1/snapshots/${encodeURIComponent(id)}`);
  }
  /** Removes it; sessions started from it run on. */
  async delete(id: string): Promise<void> {
    await this.client.request("DELETE", `/v1/snapshots/${encodeURIComponent(id)}`);
  }
}

/** What a new key gets. */
export interface KeyCreateOptions {
  name: string;
  /** Default `["exec"]`. */
  scopes?: ("exec" | "admin" | "metrics")[];
  /** Requests per second, or with a burst. Default: the daemon's. */
  rateLimit?: number | { requestsPerSecond: number; burst?: number };
  /** Ms since the epoch, in the future; default never. */
  expiresAt?: number;
}

/** API keys (needs an `admin` key). */
export class Keys {
  readonly client: Client;
  constructor(client?: ClientLike) {
    this.client = Client.of(client);
  }
  async list(): Promise<KeyRecord[]> {
    return (await this.client.json<{ keys: KeyRecord[] }>("GET", "/admin/keys")).keys;
  }
  /** A new key: its secret is in the answer only. */
  async create(opts: KeyCreateOptions): Promise<KeyWithSecret> {
    const r = await this.client.json<KeyWithSecret>("POST", "/admin/keys", { json: opts });
    return { key: r.key, record: r.record };
  }
  /** Revokes it; its sessions end. */
  async revoke(id: string): Promise<KeyRecord> {
    return (await this.client.json<{ record: KeyRecord }>("POST", `/admin/keys/${encodeURIComponent(id)}/revoke`, { idempotent: true })).record;
  }
  /** A new secret, same id, scopes and sessions. */
  async rotate(id: string): Promise<KeyWithSecret> {
    const r = await this.client.json<KeyWithSecret>("POST", `/admin/keys/${encodeURIComponent(id)}/rotate`);
    return { key: r.key, record: r.record };
  }
  /** Deletes it; its sessions end. */
  async delete(id: string): Promise<void> {
    await this.client.request("DELETE", `/admin/keys/${encodeURIComponent(id)}`);
  }
}
