/**
 * Errors: one class per API error code (docs/api.md, src/api/errors.rs),
 * all extending {@link SandboxError}. {@link errorFor} picks the class of an
 * answer's `code`; an unknown code gives a plain `SandboxError`.
 *
 * @module
 */

/** Any error the daemon answered (or, with status 0, the client could not reach it). */
export class SandboxError extends Error {
  /** The API error code this class stands for (`""` on the base class). */
  static readonly code: string = "";
  /** HTTP status (0 when no answer came: a network failure, or an error line in a stream). */
  readonly status: number;
  /** The API's error code, such as `session_not_found`. */
  readonly code: string;
  /** Seconds the daemon asked to wait before retrying (`Retry-After`), when it said. */
  readonly retryAfter: number | undefined;

  constructor(message: string, status: number, code: string, retryAfter?: number) {
    super(message);
    this.name = new.target.name;
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

// 400: bad input.
/** `bad_request`: the body or a parameter is invalid (the message names the field). */
export class BadRequest extends SandboxError { static override readonly code = "bad_request"; }
/** `invalid_session_id`: a session id outside `[A-Za-z0-9_-]{1,64}`. */
export class InvalidSessionId extends SandboxError { static override readonly code = "invalid_session_id"; }
/** `invalid_path`: a guest path that is empty, too long or holds a NUL. */
export class InvalidPath extends SandboxError { static override readonly code = "invalid_path"; }
/** `invalid`: the guest refused an argument (a name over 255 bytes, for instance). */
export class InvalidArgument extends SandboxError { static override readonly code = "invalid"; }
/** `unknown_template`: no such template. */
export class UnknownTemplate extends SandboxError { static override readonly code = "unknown_template"; }
/** `invalid_shape`: vcpus / memoryMib / diskMib beyond the daemon's or host's maxima. */
export class InvalidShape extends SandboxError { static override readonly code = "invalid_shape"; }
/** `not_a_directory`: a path component is not a directory. */
export class NotADirectory extends SandboxError { static override readonly code = "not_a_directory"; }
/** `is_a_directory`: a file operation on a directory. */
export class IsADirectory extends SandboxError { static override readonly code = "is_a_directory"; }
/** `spawn_failed`: the command could not be started (no such program, bad cwd). */
export class SpawnFailed extends SandboxError { static override readonly code = "spawn_failed"; }
// 401 / 403.
/** `unauthorized`: no key, or an unknown one. */
export class Unauthorized extends SandboxError { static override readonly code = "unauthorized"; }
/** `key_expired`: the key is past its `expiresAt`. */
export class KeyExpired extends SandboxError { static override readonly code = "key_expired"; }
/** `forbidden`: the key lacks the scope. */
export class Forbidden extends SandboxError { static override readonly code = "forbidden"; }
/** `permission_denied`: the guest refused a file operation. */
export class PermissionDenied extends SandboxError { static override readonly code = "permission_denied"; }
// 404.
/** `not_found`: nothing there. */
export class NotFound extends SandboxError { static override readonly code = "not_found"; }
/** `route_not_found`: no such route (a daemon older than this SDK?). */
export class RouteNotFound extends SandboxError { static override readonly code = "route_not_found"; }
/** `session_not_found`: no such session for this key. */
export class SessionNotFound extends SandboxError { static override readonly code = "session_not_found"; }
/** `file_not_found`: no such file in the guest. */
export class FileNotFound extends SandboxError { static override readonly code = "file_not_found"; }
/** `key_not_found`: no such key id. */
export class KeyNotFound extends SandboxError { static override readonly code = "key_not_found"; }
/** `process_not_found`: no such process in the session. */
export class ProcessNotFound extends SandboxError { static override readonly code = "process_not_found"; }
/** `snapshot_not_found`: no such snapshot for this key. */
export class SnapshotNotFound extends SandboxError { static override readonly code = "snapshot_not_found"; }
/** `build_not_found`: no such template build (finished ones are kept a while). */
export class BuildNotFound extends SandboxError { static override readonly code = "build_not_found"; }
/** `template_not_found`: no template of that name built from an image. */
export class TemplateNotFound extends SandboxError { static override readonly code = "template_not_found"; }
// 405 / 408.
/** `method_not_allowed`. */
export class MethodNotAllowed extends SandboxError { static override readonly code = "method_not_allowed"; }
/** `request_timeout`: the request head or body came too slowly. */
export class RequestTimeout extends SandboxError { static override readonly code = "request_timeout"; }
// 409 / 410.
/** `session_exists`: a session with that id exists. */
export class SessionExists extends SandboxError { static override readonly code = "session_exists"; }
/** `key_revoked`: a revoked key cannot be rotated. */
export class KeyRevoked extends SandboxError { static override readonly code = "key_revoked"; }
/** `already_exists`: the target path exists. */
export class AlreadyExists extends SandboxError { static override readonly code = "already_exists"; }
/** `directory_not_empty`: remove a non-empty directory without `recursive`. */
export class DirectoryNotEmpty extends SandboxError { static override readonly code = "directory_not_empty"; }
/** `cancelled`: the operation was cancelled (a kill-all, a shutdown). */
export class Cancelled extends SandboxError { static override readonly code = "cancelled"; }
/** `egress_not_applied`: the new network policy could not be installed (the old one stays). */
export class EgressNotApplied extends SandboxError { static override readonly code = "egress_not_applied"; }
/** `session_busy`: a foreground command runs; checkpoint / fork / pause refused at once. */
export class SessionBusy extends SandboxError { static override readonly code = "session_busy"; }
/** `template_busy`: the template is in use, being built, or built-in. */
export class TemplateBusy extends SandboxError { static override readonly code = "template_busy"; }
/** `snapshot_unrestorable`: this host cannot load the snapshot. */
export class SnapshotUnrestorable extends SandboxError { static override readonly code = "snapshot_unrestorable"; }
/** `session_closed`: the session ended while the request ran. */
export class SessionClosed extends SandboxError { static override readonly code = "session_closed"; }
// 413 / 414 / 431.
/** `body_too_large`: the request body is over `--max-body` / `--max-file`. */
export class BodyTooLarge extends SandboxError { static override readonly code = "body_too_large"; }
/** `file_too_large`: the file is over `--max-file`. */
export class FileTooLarge extends SandboxError { static override readonly code = "file_too_large"; }
/** `reply_too_large`: the JSON reply would be too large to build. */
export class ReplyTooLarge extends SandboxError { static override readonly code = "reply_too_large"; }
/** `uri_too_long`: the request target is over 8 KiB. */
export class UriTooLong extends SandboxError { static override readonly code = "uri_too_long"; }
/** `header_too_large`: the request head is over 32 KiB or 64 headers. */
export class HeaderTooLarge extends SandboxError { static override readonly code = "header_too_large"; }
// 422.
/** `guest_io_error`: an I/O error inside the guest. */
export class GuestIoError extends SandboxError { static override readonly code = "guest_io_error"; }
// 429.
/** `rate_limited`: over the key's rate limit; `retryAfter` says how long to wait. */
export class RateLimited extends SandboxError {
  static override readonly code: string = "rate_limited";
  /** Seconds to wait (the daemon's `Retry-After`; 1 when it sent none). */
  declare readonly retryAfter: number;
  constructor(message: string, status: number, code: string, retryAfter?: number) {
    super(message, status, code, retryAfter ?? 1);
  }
}
/** `auth_throttled`: too many failed authentications from this address. */
export class AuthThrottled extends RateLimited { static override readonly code = "auth_throttled"; }
/** `quota_exceeded`: the key holds its maximum of sessions / vCPUs / memory / snapshots (not retried). */
export class QuotaExceeded extends SandboxError { static override readonly code = "quota_exceeded"; }
// 5xx.
/** `internal`: a daemon bug or host failure. */
export class InternalError extends SandboxError { static override readonly code = "internal"; }
/** `checkpoint_failed`: writing a snapshot failed (507 when the disk is full). */
export class CheckpointFailed extends SandboxError { static override readonly code = "checkpoint_failed"; }
/** `not_supported`: the backend cannot do this (checkpoints on local-process). */
export class NotSupported extends SandboxError { static override readonly code = "not_supported"; }
/** `agent_error`: the guest agent failed or answered unexpectedly. */
export class AgentError extends SandboxError { static override readonly code = "agent_error"; }
/** `guest_reply_too_large`: the guest's answer went over a host-side bound. */
export class GuestReplyTooLarge extends SandboxError { static override readonly code = "guest_reply_too_large"; }
/** `unavailable`: the daemon is shutting down. */
export class Unavailable extends SandboxError { static override readonly code = "unavailable"; }
/** `at_capacity`: the daemon runs its maximum of sessions. */
export class AtCapacity extends SandboxError { static override readonly code = "at_capacity"; }
/** `draining`: this host drains and takes no new sessions (behind a router the create goes to another host). */
export class Draining extends SandboxError { static override readonly code = "draining"; }
/** `host_unavailable`: behind a router, the host that holds the session does not answer. */
export class HostUnavailable extends SandboxError { static override readonly code = "host_unavailable"; }
/** `too_many_connections`: over the daemon's connection limits. */
export class TooManyConnections extends SandboxError { static override readonly code = "too_many_connections"; }
/** `reply_memory_exhausted`: the daemon's reply memory is spent for now. */
export class ReplyMemoryExhausted extends SandboxError { static override readonly code = "reply_memory_exhausted"; }
/** `sandbox_unavailable`: the session's sandbox is gone. */
export class SandboxUnavailable extends SandboxError { static override readonly code = "sandbox_unavailable"; }
/** `session_failed`: the session's sandbox failed to start. */
export class SessionFailed extends SandboxError { static override readonly code = "session_failed"; }
/** `timeout`: the guest did not answer in time. */
export class Timeout extends SandboxError { static override readonly code = "timeout"; }
/** `session_start_timeout`: the sandbox did not become ready in time. */
export class SessionStartTimeout extends SandboxError { static override readonly code = "session_start_timeout"; }
/** `no_space`: the guest's disk is full. */
export class NoSpace extends SandboxError { static override readonly code = "no_space"; }
/** `connection_error` (client side, status 0): the daemon could not be reached. */
export class ConnectionError extends SandboxError { static override readonly code = "connection_error"; }

/** A constructor of one of the error classes. */
export type ErrorClass = new (message: string, status: number, code: string, retryAfter?: number) => SandboxError;

/** Every code's class, keyed by the code (the one table). */
export const ERROR_CLASSES: Readonly<Record<string, ErrorClass & { code: string }>> = Object.freeze(
  Object.fromEntries(
    [
      BadRequest, InvalidSessionId, InvalidPath, InvalidArgument, UnknownTemplate, InvalidShape,
      NotADirectory, IsADirectory, SpawnFailed, Unauthorized, KeyExpired, Forbidden,
      PermissionDenied, NotFound, RouteNotFound, SessionNotFound, FileNotFound, KeyNotFound,
      ProcessNotFound, SnapshotNotFound, BuildNotFound, TemplateNotFound, TemplateBusy, MethodNotAllowed, RequestTimeout, SessionExists,
      KeyRevoked, AlreadyExists, DirectoryNotEmpty, Cancelled, EgressNotApplied, SessionBusy,
      SnapshotUnrestorable, SessionClosed, BodyTooLarge, FileTooLarge, ReplyTooLarge, UriTooLong,
      HeaderTooLarge, GuestIoError, RateLimited, AuthThrottled, QuotaExceeded, InternalError,
      CheckpointFailed, NotSupported, AgentError, GuestReplyTooLarge, Unavailable, AtCapacity,
      Draining, HostUnavailable, TooManyConnections, ReplyMemoryExhausted, SandboxUnavailable, SessionFailed, Timeout,
      SessionStartTimeout, NoSpace, ConnectionError,
    ].map((c) => [c.code, c]),
  ),
);

/** The error for an answer's `code` (its class from {@link ERROR_CLASSES}, else `SandboxError`). */
export function errorFor(status: number, code: string, message: string, retryAfter?: number): SandboxError {
  const Class: ErrorClass = ERROR_CLASSES[code] ?? SandboxError;
  return new Class(message || `${code || "error"} (HTTP ${status})`, status, code, retryAfter);
}

/**
 * The error of an error body in either shape the daemon uses: v1's
 * `{"error": {code, message}}` or the seed routes' `{"error": message, code}`.
 */
export function errorFromBody(status: number, body: unknown, retryAfter?: number): SandboxError {
  const b = (body ?? {}) as { error?: unknown; code?: unknown; message?: unknown };
  let code = "";
  let message = "";
  if (b.error && typeof b.error === "object") {
    const e = b.error as { code?: unknown; message?: unknown };
    code = typeof e.code === "string" ? e.code : "";
    message = typeof e.message === "string" ? e.message : "";
  } else {
    code = typeof b.code === "string" ? b.code : "";
    message = typeof b.error === "string" ? b.error : typeof b.message === "string" ? b.message : "";
  }
  return errorFor(status, code, message, retryAfter);
}
