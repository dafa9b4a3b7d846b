"""Errors: one class per API error code, all under `SandboxError`.

The daemon answers every error as JSON with a `code` (docs/api.md, Basics);
`error_for` turns it into the class of that code (`CODES`), or
into a plain `SandboxError` for a code this SDK does not know yet.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "SandboxError",
    "ConnectionFailed",
    "StreamError",
    "CODES",
    "error_for",
    "BadRequest",
    "InvalidSessionId",
    "InvalidPath",
    "InvalidArgument",
    "UnknownTemplate",
    "InvalidShape",
    "NotADirectory",
    "IsADirectory",
    "SpawnFailed",
    "Unauthorized",
    "KeyExpired",
    "Forbidden",
    "PermissionDenied",
    "NotFound",
    "RouteNotFound",
    "SessionNotFound",
    "FileNotFound",
    "KeyNotFound",
    "ProcessNotFound",
    "SnapshotNotFound",
    "BuildNotFound",
    "TemplateNotFound",
    "TemplateBusy",
    "MethodNotAllowed",
    "RequestTimeout",
    "SessionExists",
    "AlreadyExists",
    "DirectoryNotEmpty",
    "EgressNotApplied",
    "SessionBusy",
    "SnapshotUnrestorable",
    "KeyRevoked",
    "Cancelled",
    "SessionClosed",
    "BodyTooLarge",
    "FileTooLarge",
    "ReplyTooLarge",
    "UriTooLong",
    "GuestIOError",
    "HeaderTooLarge",
    "RateLimited",
    "AuthThrottled",
    "QuotaExceeded",
    "InternalError",
    "CheckpointFailed",
    "NotSupported",
    "AgentError",
    "GuestReplyTooLarge",
    "AtCapacity",
    "Draining",
    "HostUnavailable",
    "Unavailable",
    "SandboxUnavailable",
    "SessionFailed",
    "TooManyConnections",
    "ReplyMemoryExhausted",
    "GuestTimeout",
    "SessionStartTimeout",
    "NoSpace",
]


class SandboxError(Exception):
    """An error answered by the daemon (or met on the way to it).

    Attributes:
        status: the HTTP status (0 when no answer arrived).
        code: the API's error code, e.g. `session_not_found`.
        message: the daemon's readable message.
        retry_after: seconds the daemon asked to wait (`Retry-After`), if any.
    """

    code_name: str = ""

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        code: Optional[str] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code if code is not None else self.code_name
        self.message = message
        self.retry_after = retry_after

    def __str__(self) -> str:
        head = f"{self.status} {self.code}" if self.status else self.code
        return f"{head}: {self.message}" if head else self.message

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, "
            f"message={self.message!r}, retry_after={self.retry_after!r})"
        )


class ConnectionFailed(SandboxError):
    """No answer from the daemon: refused connection, timeout, reset."""

    code_name = "connection_failed"


class StreamError(SandboxError):
    """A stream ended with an `error` event, or without a `result`."""

    code_name = "stream_error"


class BadRequest(SandboxError):
    """400: the request is malformed or a field is out of range."""

    code_name = "bad_request"


class InvalidSessionId(SandboxError):
    """400: a session id outside `[A-Za-z0-9_-]{1,64}`."""

    code_name = "invalid_session_id"


class InvalidPath(SandboxError):
    """400: a guest path that is empty, too long or has a NUL."""

    code_name = "invalid_path"


class InvalidArgument(SandboxError):
    """400: the guest refused an argument (e.g. a name over 255 bytes)."""

    code_name = "invalid"


class UnknownTemplate(SandboxError):
    """400: no template of that name has an image."""

    code_name = "unknown_template"


class InvalidShape(SandboxError):
    """400: vcpus/memoryMib/diskMib beyond the daemon's maxima."""

    code_name = "invalid_shape"


class NotADirectory(SandboxError):
    """400: a path component is not a directory."""

    code_name = "not_a_directory"


class IsADirectory(SandboxError):
    """400: the path is a directory."""

    code_name = "is_a_directory"


class SpawnFailed(SandboxError):
    """400: the command could not be started in the guest."""

    code_name = "spawn_failed"


class Unauthorized(SandboxError):
    """401: no key, or an invalid one."""

    code_name = "unauthorized"


class KeyExpired(SandboxError):
    """401: the key is past its `expiresAt`."""

    code_name = "key_expired"


class Forbidden(SandboxError):
    """403: the key lacks the scope this route needs."""

    code_name = "forbidden"


class PermissionDenied(SandboxError):
    """403: the guest refused access to the file."""

    code_name = "permission_denied"


class NotFound(SandboxError):
    """404: nothing there."""

    code_name = "not_found"


class RouteNotFound(SandboxError):
    """404: no such route."""

    code_name = "route_not_found"


class SessionNotFound(SandboxError):
    """404: no such session (for this key)."""

    code_name = "session_not_found"


class FileNotFound(SandboxError):
    """404: no such file in the guest."""

    code_name = "file_not_found"


class KeyNotFound(SandboxError):
    """404: no such API key id."""

    code_name = "key_not_found"


class ProcessNotFound(SandboxError):
    """404: the sandbox knows no such process."""

    code_name = "process_not_found"


class SnapshotNotFound(SandboxError):
    """404: no such snapshot (for this key)."""

    code_name = "snapshot_not_found"


class BuildNotFound(SandboxError):
    """404: no such template build (finished ones are kept a while)."""

    code_name = "build_not_found"


class TemplateNotFound(SandboxError):
    """404: no template of that name built from an image."""

    code_name = "template_not_found"


class TemplateBusy(SandboxError):
    """409: the template is in use, being built, or built-in."""

    code_name = "template_busy"


class MethodNotAllowed(SandboxError):
    """405: the route has no such method."""

    code_name = "method_not_allowed"


class RequestTimeout(SandboxError):
    """408: the request head or body came too slowly."""

    code_name = "request_timeout"


class SessionExists(SandboxError):
    """409: a session of that id exists."""

    code_name = "session_exists"


class AlreadyExists(SandboxError):
    """409: the target file exists."""

    code_name = "already_exists"


class DirectoryNotEmpty(SandboxError):
    """409: remove a non-empty directory without `recursive`."""

    code_name = "directory_not_empty"


class EgressNotApplied(SandboxError):
    """409: the network policy could not be installed."""

    code_name = "egress_not_applied"


class SessionBusy(SandboxError):
    """409: a foreground command runs (checkpoint, fork, pause)."""

    code_name = "session_busy"


class SnapshotUnrestorable(SandboxError):
    """409: this host cannot load the snapshot."""

    code_name = "snapshot_unrestorable"


class KeyRevoked(SandboxError):
    """409: a revoked key cannot be rotated."""

    code_name = "key_revoked"


class Cancelled(SandboxError):
    """409: the operation was cancelled."""

    code_name = "cancelled"


class SessionClosed(SandboxError):
    """410: the session ended while the request ran."""

    code_name = "session_closed"


class BodyTooLarge(SandboxError):
    """413: the request body is over `--max-body` / `--max-file`."""

    code_name = "body_too_large"


class FileTooLarge(SandboxError):
    """413: the file is over `--max-file`."""

    code_name = "file_too_large"


class ReplyTooLarge(SandboxError):
    """413: the reply would be too large to build."""

    code_name = "reply_too_large"


class UriTooLong(SandboxError):
    """414: the request target is over 8 KiB."""

    code_name = "uri_too_long"


class GuestIOError(SandboxError):
    """422: an I/O error inside the guest."""

    code_name = "guest_io_error"


class HeaderTooLarge(SandboxError):
    """431: the request head is over 32 KiB or 64 headers."""

    code_name = "header_too_large"


class RateLimited(SandboxError):
    """429: over the key's rate limit; see `retry_after`."""

    code_name = "rate_limited"


class AuthThrottled(SandboxError):
    """429: too many failed authentications from this address."""

    code_name = "auth_throttled"


class QuotaExceeded(SandboxError):
    """429: over a per-key quota (sessions, vCPUs, memory, snapshots)."""

    code_name = "quota_exceeded"


class InternalError(SandboxError):
    """500: the daemon failed."""

    code_name = "internal"


class CheckpointFailed(SandboxError):
    """500/507: writing the checkpoint failed."""

    code_name = "checkpoint_failed"


class NotSupported(SandboxError):
    """501: the backend cannot do this (e.g. checkpoints on local-process)."""

    code_name = "not_supported"


class AgentError(SandboxError):
    """502: the guest agent failed."""

    code_name = "agent_error"


class GuestReplyTooLarge(SandboxError):
    """502: the guest's answer went over a host-side bound."""

    code_name = "guest_reply_too_large"


class AtCapacity(SandboxError):
    """503: `--max-sessions` sessions exist; see `retry_after`."""

    code_name = "at_capacity"


class Draining(SandboxError):
    """503: this host drains and takes no new sessions (behind a router a
    create goes to another host)."""

    code_name = "draining"


class HostUnavailable(SandboxError):
    """503: behind a router, the host that holds the session does not
    answer; its sessions are unreachable until it is back."""

    code_name = "host_unavailable"


class Unavailable(SandboxError):
    """503: the daemon is shutting down."""

    code_name = "unavailable"


class SandboxUnavailable(SandboxError):
    """503: the sandbox is gone or unreachable."""

    code_name = "sandbox_unavailable"


class SessionFailed(SandboxError):
    """503: the session's sandbox failed."""

    code_name = "session_failed"


class TooManyConnections(SandboxError):
    """503: over the daemon's connection limits."""

    code_name = "too_many_connections"


class ReplyMemoryExhausted(SandboxError):
    """503: the daemon's reply memory is spent."""

    code_name = "reply_memory_exhausted"


class GuestTimeout(SandboxError):
    """504: the guest did not answer in time."""

    code_name = "timeout"


class SessionStartTimeout(SandboxError):
    """504: the sandbox did not start in time."""

    code_name = "session_start_timeout"


class NoSpace(SandboxError):
    """507: the guest's disk is full."""

    code_name = "no_space"


def _codes() -> Dict[str, Type[SandboxError]]:
    table: Dict[str, Type[SandboxError]] = {}
    todo = list(SandboxError.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.code_name and cls not in (ConnectionFailed, StreamError):
            table[cls.code_name] = cls
    return table


CODES: Dict[str, Type[SandboxError]] = _codes()
"""Every API error code and its class: the one table of codes."""


def error_for(status: int, code: Optional[str], message: str, retry_after: Optional[float] = None) -> SandboxError:
    """The exception for an API error: the class of `code`, else `SandboxError`."""
    cls = CODES.get(code or "", SandboxError)
    return cls(message, status=status, code=code or f"http_{status}", retry_after=retry_after)
