"""Every API operation as a `Call`: the one place that knows routes,
field names and which calls are idempotent. The sync and async surfaces
only send these."""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import quote

import httpx

from ._core import NDJSON, NO_TIMEOUT, Call, Content, json_body
from .models import (
    CommandResult,
    CreatedKey,
    Egress,
    EntryInfo,
    FailedCopy,
    FileStat,
    KeyRecord,
    PortInfo,
    ProcessInfo,
    RunLimits,
    RunResult,
    Secret,
    SecretInfo,
    SessionInfo,
    Snapshot,
    Started,
    Template,
)

Json = Dict[str, Any]
Command = Union[str, Sequence[str]]
"""A shell command line (run by `/bin/sh -c`) or an argv (no shell)."""
Signal = Union[str, int]
Duration = Union[int, float, str]
"""Seconds, or text like `30m`, `2h`, `250ms`."""
SecretLike = Union[Secret, Mapping[str, Any]]
"""A `Secret`, or a plain dict of its wire fields (`name`, `value`, `hosts`,
`header`, `format`)."""

# Margin over a command's own timeout for the HTTP read of its answer.
_EXEC_MARGIN_S = 30.0
# The daemon's default `--exec-timeout` (10 min).
_DEFAULT_EXEC_S = 600.0


def _s(session: str) -> str:
    return "/v1/sessions/" + quote(session, safe="")


def _drop_none(d: Json) -> Json:
    return {k: v for k, v in d.items() if v is not None}


def _ok(resp: httpx.Response) -> None:
    return None


_STREAM = {"Accept": NDJSON}


# --- sessions ---------------------------------------------------------------


def create_body(
    *,
    id: Optional[str] = None,
    template: Optional[str] = None,
    vcpus: Optional[int] = None,
    memory_mib: Optional[int] = None,
    disk_mib: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    egress: Optional[Egress] = None,
    ttl: Optional[Duration] = None,
    idle_timeout: Optional[Duration] = None,
    on_idle: Optional[str] = None,
    paused_ttl: Optional[Duration] = None,
    from_snapshot: Optional[str] = None,
    count: Optional[int] = None,
    secrets: Optional[Sequence[SecretLike]] = None,
) -> Json:
    return _drop_none(
        {
            "id": id,
            "template": template,
            "vcpus": vcpus,
            "memoryMib": memory_mib,
            "diskMib": disk_mib,
            "env": dict(env) if env is not None else None,
            "egress": egress.to_wire() if egress is not None else None,
            "ttl": ttl,
            "idleTimeout": idle_timeout,
            "onIdle": on_idle,
            "pausedTtl": paused_ttl,
            "fromSnapshot": from_snapshot,
            "count": count,
            "secrets": secrets_wire(secrets) if secrets is not None else None,
        }
    )


def secrets_wire(secrets: Sequence[SecretLike]) -> List[Json]:
    """The wire list of `secrets` (a dict is sent as it is, a copy)."""
    if isinstance(secrets, (str, bytes, Mapping, Secret)):
        raise TypeError("secrets must be a list of Secret (or dicts), not a single one")
    return [s.to_wire() if isinstance(s, Secret) else dict(s) for s in secrets]


def create_session(body: Json) -> Call[SessionInfo]:
    return Call("POST", "/v1/sessions", lambda r: SessionInfo.from_wire(r.json()), json=body)


def create_sessions(body: Json) -> Call[Tuple[List[SessionInfo], List[FailedCopy]]]:
    return Call("POST", "/v1/sessions", lambda r: _copies(r.json()["sessions"]), json=body)


def _copies(items: List[Json]) -> Tuple[List[SessionInfo], List[FailedCopy]]:
    ok, failed = [], []
    for d in items:
        if "error" in d:
            e = d["error"]
            failed.append(FailedCopy(d.get("id", ""), e.get("code", ""), e.get("message", "")))
        else:
            ok.append(SessionInfo.from_wire(d))
    return ok, failed


def get_session(session: str) -> Call[SessionInfo]:
    return Call("GET", _s(session), lambda r: SessionInfo.from_wire(r.json()), idempotent=True)


def list_sessions() -> Call[List[SessionInfo]]:
    return Call(
        "GET",
        "/v1/sessions",
        lambda r: [SessionInfo.from_wire(d) for d in r.json()["sessions"]],
        idempotent=True,
    )


def delete_session(session: str) -> Call[bool]:
    return Call("DELETE", _s(session), lambda r: bool(r.json().get("destroyed", True)), idempotent=True)


def keepalive(session: str) -> Call[SessionInfo]:
    return Call("POST", _s(session) + "/keepalive", lambda r: SessionInfo.from_wire(r.json()), idempotent=True)


def list_templates() -> Call[List[Template]]:
    return Call(
        "GET",
        "/v1/templates",
        lambda r: [Template.from_wire(d) for d in r.json()["templates"]],
        idempotent=True,
    )


def health() -> Call[Json]:
    return Call("GET", "/health", json_body, idempotent=True)


def ready() -> Call[Json]:
    # 503 with `{"status": "not_ready", ...}` is the answer, not an error to retry.
    return Call("GET", "/ready", json_body, answers=frozenset({503}))


def metrics() -> Call[str]:
    return Call("GET", "/metrics", lambda r: r.text, idempotent=True)


# --- commands -----------------------------------------------------------------


def exec_body(
    cmd: Command,
    *,
    cwd: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    timeout: Optional[float] = None,
    stdin: Union[str, bytes, None] = None,
    pty: Optional[Tuple[int, int]] = None,
    background: bool = False,
    tag: Optional[str] = None,
    binary: bool = False,
    secrets: Optional[Mapping[str, str]] = None,
) -> Json:
    """The exec body; `timeout` in seconds (the wire takes milliseconds);
    `binary`: output as base64 chunks (exact bytes); `secrets`: files
    /run/secrets/NAME for this command only, masked in its output."""
    body: Json = {"command": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    if isinstance(stdin, bytes):
        body["stdinBase64"] = base64.b64encode(stdin).decode()
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout is not None:
        body["timeout"] = max(1, int(timeout * 1000))
    if pty is not None:
        body["pty"] = {"rows": pty[0], "cols": pty[1]}
    if background:
        body["background"] = True
    if binary:
        body["encoding"] = "base64"
    if secrets:
        body["secrets"] = dict(secrets)
    return _drop_none({**body, "cwd": cwd, "env": dict(env) if env else None, "tag": tag})


def _exec_read_timeout(body: Json) -> float:
    return float(body.get("timeout", _DEFAULT_EXEC_S * 1000)) / 1000 + _EXEC_MARGIN_S


def exec_buffered(session: str, body: Json) -> Call[CommandResult]:
    return Call(
        "POST",
        _s(session) + "/exec",
        lambda r: CommandResult.from_wire(r.json()),
        json=body,
        timeout=_exec_read_timeout(body),
    )


def exec_stream(session: str, body: Json) -> Call[None]:
    """Streamed with `Transport.stream` (events, not a parsed answer)."""
    return Call("POST", _s(session) + "/exec", _ok, json=body, headers=_STREAM, timeout=NO_TIMEOUT)


def exec_background(session: str, body: Json) -> Call[Started]:
    def parse(r: httpx.Response) -> Started:
        d = r.json()
        return Started(int(d["procId"]), int(d.get("pid", 0)))

    return Call("POST", _s(session) + "/exec", parse, json={**body, "background": True})


def _p(session: str, proc: int) -> str:
    return f"{_s(session)}/processes/{int(proc)}"


def list_processes(session: str) -> Call[List[ProcessInfo]]:
    return Call(
        "GET",
        _s(session) + "/processes",
        lambda r: [ProcessInfo.from_wire(d) for d in r.json()["processes"]],
        idempotent=True,
    )


def get_process(session: str, proc: int) -> Call[ProcessInfo]:
    return Call("GET", _p(session, proc), lambda r: ProcessInfo.from_wire(r.json()), idempotent=True)


def attach(session: str, proc: int, replay: bool = True, binary: bool = False) -> Call[None]:
    params = {"replay": "true" if replay else "false"}
    if binary:
        params["encoding"] = "base64"
    return Call(
        "GET",
        _p(session, proc) + "/output",
        _ok,
        params=params,
        headers=_STREAM,
        idempotent=True,
        timeout=NO_TIMEOUT,
    )


def send_stdin(session: str, proc: int, data: Union[str, bytes], eof: bool = False) -> Call[int]:
    raw = data.encode() if isinstance(data, str) else data
    return Call(
        "POST",
        _p(session, proc) + "/stdin",
        lambda r: int(r.json().get("bytes", len(raw))),
        params={"eof": "true" if eof else "false"},
        content=raw,
        headers={"Content-Type": "application/octet-stream"},
    )


def signal(session: str, proc: int, sig: Signal = "SIGTERM") -> Call[None]:
    return Call("POST", _p(session, proc) + "/signal", _ok, json={"signal": sig})


def resize(session: str, proc: int, rows: int, cols: int) -> Call[None]:
    return Call("POST", _p(session, proc) + "/resize", _ok, json={"rows": rows, "cols": cols}, idempotent=True)


def kill_all(session: str) -> Call[Tuple[int, int]]:
    def parse(r: httpx.Response) -> Tuple[int, int]:
        d = r.json()
        return int(d["killed"]), int(d["remaining"])

    return Call("DELETE", _s(session) + "/processes", parse, idempotent=True, timeout=30.0)


# --- files ------------------------------------------------------------------


def _f(session: str, what: str) -> str:
    return f"{_s(session)}/files/{what}"


def read_bytes(session: str, path: str) -> Call[bytes]:
    return Call("GET", _f(session, "content"), lambda r: r.content, params={"path": path}, idempotent=True)


def download(session: str, path: str) -> Call[None]:
    """Streamed with `Transport.open` (the body is not read here)."""
    return Call("GET", _f(session, "content"), _ok, params={"path": path}, idempotent=True)


def write(
    session: str, path: str, content: Content, mode: Optional[int], size: Optional[int], replayable: bool = True
) -> Call[int]:
    """PUT of the raw bytes; `content` bytes or a function making a fresh
    iterator of chunks, retried only when it can send the same bytes again
    (`replayable`: not a pipe or socket read once)."""
    params: Json = {"path": path}
    if mode is not None:
        params["mode"] = format(mode, "o")
    headers = {"Content-Type": "application/octet-stream"}
    if size is not None:
        # Known up front: the daemon refuses an over-limit body before reading it.
        headers["Content-Length"] = str(size)
    return Call(
        "PUT",
        _f(session, "content"),
        lambda r: int(r.json().get("bytes", 0)),
        params=params,
        content=content,
        headers=headers,
        idempotent=replayable,
        timeout=600.0,
    )


def stat(session: str, path: str) -> Call[FileStat]:
    return Call(
        "GET", _f(session, "stat"), lambda r: FileStat.from_wire(r.json()), params={"path": path}, idempotent=True
    )


def list_files(session: str, path: str = ".", recursive: bool = False) -> Call[List[EntryInfo]]:
    return Call(
        "GET",
        _f(session, "list"),
        lambda r: [EntryInfo.from_wire(d) for d in r.json()["files"]],
        params={"path": path, "recursive": "true" if recursive else "false"},
        idempotent=True,
    )


def mkdir(session: str, path: str, parents: bool = True) -> Call[None]:
    return Call("POST", _f(session, "mkdir"), _ok, json={"path": path, "parents": parents}, idempotent=parents)


def remove(session: str, path: str, recursive: bool = False) -> Call[None]:
    return Call("POST", _f(session, "remove"), _ok, json={"path": path, "recursive": recursive})


def rename(session: str, src: str, dst: str, overwrite: bool = True) -> Call[None]:
    return Call("POST", _f(session, "rename"), _ok, json={"from": src, "to": dst, "overwrite": overwrite})


# --- network ------------------------------------------------------------------


def get_network(session: str) -> Call[Egress]:
    return Call("GET", _s(session) + "/network", lambda r: Egress.from_wire(r.json()["egress"]), idempotent=True)


def set_network(session: str, egress: Egress) -> Call[Egress]:
    return Call(
        "PUT",
        _s(session) + "/network",
        lambda r: Egress.from_wire(r.json()["egress"]),
        json=egress.to_wire(),
        idempotent=True,
    )


# --- injected secrets ------------------------------------------------------------


def _secret_list(r: httpx.Response) -> List[SecretInfo]:
    return [SecretInfo.from_wire(d) for d in r.json()["secrets"]]


def get_secrets(session: str) -> Call[List[SecretInfo]]:
    return Call("GET", _s(session) + "/secrets", _secret_list, idempotent=True)


def set_secrets(session: str, secrets: Sequence[SecretLike]) -> Call[List[SecretInfo]]:
    # The whole set replaced: sending it again is the same set (same placeholders).
    return Call("PUT", _s(session) + "/secrets", _secret_list, json={"secrets": secrets_wire(secrets)}, idempotent=True)


# --- preview ports ------------------------------------------------------------------


def expose_port(session: str, port: int, ttl: Optional[Duration], public: bool) -> Call[PortInfo]:
    # Not retried: opening an open port again gives it a new token.
    body: Json = _drop_none({"port": port, "ttl": ttl, "public": public})
    return Call("POST", _s(session) + "/ports", lambda r: PortInfo.from_wire(r.json()), json=body)


def list_ports(session: str) -> Call[List[PortInfo]]:
    return Call(
        "GET",
        _s(session) + "/ports",
        lambda r: [PortInfo.from_wire(d) for d in r.json()["ports"]],
        idempotent=True,
    )


def close_port(session: str, port: int) -> Call[None]:
    return Call("DELETE", f"{_s(session)}/ports/{int(port)}", _ok, idempotent=True)


# --- one-shot runs --------------------------------------------------------------


def run(language: str, code: str, limits: Optional[RunLimits]) -> Call[RunResult]:
    body: Json = {"language": language, "code": code}
    if limits is not None:
        body["limits"] = limits.to_wire()
    ms = (limits.timeout_ms if limits and limits.timeout_ms else 15000) / 1000
    return Call("POST", "/v1/run", lambda r: RunResult.from_wire(r.json()), json=body, timeout=ms + 120)


# --- snapshots, fork, pause ---------------------------------------------------------


def checkpoint(session: str, name: Optional[str]) -> Call[Snapshot]:
    return Call(
        "POST",
        _s(session) + "/snapshots",
        lambda r: Snapshot.from_wire(r.json()),
        json=_drop_none({"name": name}),
        timeout=300.0,
    )


def fork(session: str, count: int) -> Call[Tuple[List[SessionInfo], List[FailedCopy]]]:
    return Call(
        "POST", _s(session) + "/fork", lambda r: _copies(r.json()["sessions"]), json={"count": count}, timeout=300.0
    )


def pause(session: str) -> Call[SessionInfo]:
    return Call(
        "POST", _s(session) + "/pause", lambda r: SessionInfo.from_wire(r.json()), idempotent=True, timeout=300.0
    )


def resume(session: str) -> Call[SessionInfo]:
    return Call(
        "POST", _s(session) + "/resume", lambda r: SessionInfo.from_wire(r.json()), idempotent=True, timeout=300.0
    )


def list_snapshots() -> Call[List[Snapshot]]:
    return Call(
        "GET", "/v1/snapshots", lambda r: [Snapshot.from_wire(d) for d in r.json()["snapshots"]], idempotent=True
    )


def get_snapshot(snapshot: str) -> Call[Snapshot]:
    return Call(
        "GET", "/v1/snapshots/" + quote(snapshot, safe=""), lambda r: Snapshot.from_wire(r.json()), idempotent=True
    )


def delete_snapshot(snapshot: str) -> Call[None]:
    return Call("DELETE", "/v1/snapshots/" + quote(snapshot, safe=""), _ok, idempotent=True)


# --- admin keys -------------------------------------------------------------------


def _created(r: httpx.Response) -> CreatedKey:
    d = r.json()
    return CreatedKey(d["key"], KeyRecord.from_wire(d.get("record") or d))


def create_key(
    name: str,
    scopes: Optional[Sequence[str]],
    requests_per_second: Optional[float],
    burst: Optional[float],
    expires_at: Optional[int],
) -> Call[CreatedKey]:
    body: Json = {"name": name}
    if scopes is not None:
        body["scopes"] = list(scopes)
    if requests_per_second is not None:
        body["rateLimit"] = _drop_none({"requestsPerSecond": requests_per_second, "burst": burst})
    if expires_at is not None:
        body["expiresAt"] = expires_at
    return Call("POST", "/admin/keys", _created, json=body)


def list_keys() -> Call[List[KeyRecord]]:
    return Call("GET", "/admin/keys", lambda r: [KeyRecord.from_wire(d) for d in r.json()["keys"]], idempotent=True)


def revoke_key(key_id: str) -> Call[KeyRecord]:
    return Call(
        "POST",
        f"/admin/keys/{quote(key_id, safe='')}/revoke",
        lambda r: KeyRecord.from_wire(r.json().get("record") or r.json()),
        idempotent=True,
    )


def rotate_key(key_id: str) -> Call[CreatedKey]:
    return Call("POST", f"/admin/keys/{quote(key_id, safe='')}/rotate", _created)


def delete_key(key_id: str) -> Call[None]:
    return Call("DELETE", f"/admin/keys/{quote(key_id, safe='')}", _ok, idempotent=True)
