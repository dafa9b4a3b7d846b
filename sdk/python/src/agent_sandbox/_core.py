"""The request machinery shared by the sync and async clients.

An operation is a `Call` (what to send, whether it may be retried, how to
read the answer); `Transport` and `AsyncTransport` each have the one
function that sends a call (`call`) and the one that streams it
(`stream`), with the same retry rule (`Retry.delay`) and the same error
mapping (`raise_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import (
    Any,
    AsyncIterator,
    Callable,
    Dict,
    FrozenSet,
    Generic,
    Iterator,
    Mapping,
    Optional,
    TypeVar,
    Union,
)

import httpx

from .errors import ConnectionFailed, SandboxError, StreamError, error_for
from .models import CommandResult, Dropped, Event, Exited, Output, Started

__all__ = ["Retry", "Config"]

T = TypeVar("T")
Json = Dict[str, Any]
Content = Union[bytes, Callable[[], Iterator[bytes]], Callable[[], AsyncIterator[bytes]]]

DEFAULT_URL = "http://127.0.0.1:3000"
NDJSON = "application/x-ndjson"
NO_TIMEOUT = float("inf")


@dataclass
class Retry:
    """When and how transient errors are retried.

    Only idempotent calls (reads, uploads of replayable content, deletes,
    and the few POSTs that are idempotent) are retried, and only on the
    statuses in `statuses` with a transient code (never `quota_exceeded`,
    which frees only when a session ends). The wait is the daemon's
    `Retry-After` when it gives one, else exponential backoff with jitter,
    capped by `max_backoff`.
    """

    attempts: int = 4
    """Tries in all (1: no retry)."""
    backoff: float = 0.25
    """First wait in seconds; doubled each try."""
    max_backoff: float = 8.0
    """No wait longer than this (a longer `Retry-After` is cut to it)."""
    statuses: FrozenSet[int] = frozenset({429, 503})
    """Statuses that may be retried."""

    def delay(self, attempt: int, err: SandboxError) -> Optional[float]:
        """Seconds to wait before try `attempt + 1`, or None for no retry."""
        if attempt >= self.attempts:
            return None
        transient = err.status in self.statuses and err.code not in _PERMANENT
        if not transient and not isinstance(err, ConnectionFailed):
            return None
        if err.retry_after is not None:
            return min(float(err.retry_after), self.max_backoff)
        base = min(self.backoff * 2.0 ** (attempt - 1), self.max_backoff)
        return float(base * (0.5 + random.random() / 2))


_PERMANENT = frozenset({"quota_exceeded", "session_failed"})


@dataclass
class Config:
    """Where the daemon is and how to talk to it.

    `url` and `api_key` default to `AGENT_SANDBOX_URL` and
    `AGENT_SANDBOX_API_KEY` (then `http://127.0.0.1:3000`, no key).
    """

    url: str = ""
    api_key: Optional[str] = None
    timeout: float = 60.0
    """Seconds for a plain call (exec and streams get their own)."""
    retry: Retry = field(default_factory=Retry)

    def __post_init__(self) -> None:
        self.url = (self.url or os.environ.get("AGENT_SANDBOX_URL") or DEFAULT_URL).rstrip("/")
        if self.api_key is None:
            self.api_key = os.environ.get("AGENT_SANDBOX_API_KEY") or None

    def headers(self) -> Dict[str, str]:
        h = {"User-Agent": "agent-sandbox-python"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass
class Call(Generic[T]):
    """One API operation: the request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Optional[Mapping[str, Any]] = None
    json: Any = None
    content: Optional[Content] = None
    headers: Optional[Dict[str, str]] = None
    idempotent: bool = False
    answers: FrozenSet[int] = frozenset()
    """Error statuses that are an answer here, not an error (`/ready`'s 503)."""
    timeout: Optional[float] = None
    """Read timeout in seconds (None: the config's; `NO_TIMEOUT` for a
    stream, which may stay quiet as long as its command does)."""


def raise_for(resp: httpx.Response) -> None:
    """Raise the `SandboxError` subclass of an error answer."""
    if resp.status_code < 400:
        return
    code: Optional[str] = None
    message = resp.reason_phrase or f"HTTP {resp.status_code}"
    try:
        body = json.loads(resp.content)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):  # v1: {"error": {"code", "message"}}
            code, message = err.get("code"), err.get("message", message)
        elif isinstance(err, str):  # seed: {"error": "...", "code"}
            code, message = body.get("code"), err
    retry_after: Optional[float] = None
    if "retry-after" in resp.headers:
        try:
            retry_after = float(resp.headers["retry-after"])
        except ValueError:
            pass
    raise error_for(resp.status_code, code, message, retry_after)


def event_of(line: str) -> Optional[Event]:
    """One NDJSON line of a stream as an event (None for an unknown type)."""
    d = json.loads(line)
    kind = d.get("type")
    if kind == "stream":
        return Output.from_wire(d)
    if kind == "started":
        return Started(int(d.get("procId", 0)), int(d.get("pid", 0)))
    if kind == "result":
        return Exited(CommandResult.from_wire(d))
    if kind == "dropped":
        return Dropped(int(d.get("bytes", 0)))
    if kind == "error":
        e = d.get("error")
        if isinstance(e, dict):
            raise error_for(0, e.get("code"), e.get("message", ""))
        raise error_for(0, d.get("code"), str(e))
    return None


def json_body(resp: httpx.Response) -> Any:
    return resp.json()


def _params(call: Call[Any], owner: Optional[str]) -> Optional[Mapping[str, Any]]:
    if owner and call.path.startswith("/v1/sessions/"):
        return {**(call.params or {}), "owner": owner}
    return call.params


def _timeout(cfg: Config, call: Call[Any]) -> httpx.Timeout:
    read = call.timeout if call.timeout is not None else cfg.timeout
    return httpx.Timeout(cfg.timeout, read=None if read == NO_TIMEOUT else read)


class Transport:
    """The sync HTTP side: one `httpx.Client` with keep-alive."""

    def __init__(self, config: Config, http: Optional[httpx.Client] = None) -> None:
        self.config = config
        self.http = http or httpx.Client(base_url=config.url, headers=config.headers())
        self.owner: Optional[str] = None

    def owned_by(self, owner: Optional[str]) -> "Transport":
        """This transport (same connections) sending `?owner=` on session
        routes: an admin key reaching another key's sessions."""
        view = copy.copy(self)
        view.owner = owner
        return view

    def close(self) -> None:
        self.http.close()

    def _send(self, call: Call[Any], lazy: bool = False) -> httpx.Response:
        """The one request function: send `call` (retried as the config
        says) and answer its response, read unless `lazy`; raise the
        `SandboxError` of an error answer."""
        attempt = 0
        while True:
            attempt += 1
            content = call.content() if callable(call.content) else call.content
            req = self.http.build_request(
                call.method,
                call.path,
                params=_params(call, self.owner),
                json=call.json,
                content=content,
                headers=call.headers,
                timeout=_timeout(self.config, call),
            )
            try:
                resp = self.http.send(req, stream=lazy)
            except httpx.TransportError as e:
                err: SandboxError = ConnectionFailed(f"{call.method} {call.path}: {e!r}")
            else:
                if resp.status_code < 400 or resp.status_code in call.answers:
                    return resp
                if lazy:
                    resp.read()
                    resp.close()
                try:
                    raise_for(resp)
                except SandboxError as e:
                    err = e
            wait = self.config.retry.delay(attempt, err) if call.idempotent else None
            if wait is None:
                raise err
            time.sleep(wait)

    def call(self, call: Call[T]) -> T:
        """Send `call`, retrying as the config says; its parsed answer."""
        return call.parse(self._send(call))

    @contextlib.contextmanager
    def open(self, call: Call[Any]) -> Iterator[httpx.Response]:
        """Send `call` and hand over its answer unread (a download)."""
        resp = self._send(call, lazy=True)
        try:
            yield resp
        finally:
            resp.close()

    def stream(self, call: Call[Any]) -> Iterator[Event]:
        """Send `call` for NDJSON and yield its events until `Exited`."""
        resp = self._send(call, lazy=True)
        try:
            for line in resp.iter_lines():
                if line.strip():
                    ev = event_of(line)
                    if ev is not None:
                        yield ev
                        if isinstance(ev, Exited):
                            return
        except httpx.TransportError as e:
            raise ConnectionFailed(f"stream {call.path}: {e!r}") from e
        finally:
            resp.close()
        raise StreamError(f"stream {call.path} ended without a result")


class AsyncTransport:
    """The async HTTP side: one `httpx.AsyncClient` with keep-alive."""

    def __init__(self, config: Config, http: Optional[httpx.AsyncClient] = None) -> None:
        self.config = config
        self.http = http or httpx.AsyncClient(base_url=config.url, headers=config.headers())
        self.owner: Optional[str] = None

    def owned_by(self, owner: Optional[str]) -> "AsyncTransport":
        """This transport (same connections) sending `?owner=` on session
        routes: an admin key reaching another key's sessions."""
        view = copy.copy(self)
        view.owner = owner
        return view

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, call: Call[Any], lazy: bool = False) -> httpx.Response:
        """The one request function: send `call` (retried as the config
        says) and answer its response, read unless `lazy`; raise the
        `SandboxError` of an error answer."""
        attempt = 0
        while True:
            attempt += 1
            content = call.content() if callable(call.content) else call.content
            req = self.http.build_request(
                call.method,
                call.path,
                params=_params(call, self.owner),
                json=call.json,
                content=content,
                headers=call.headers,
                timeout=_timeout(self.config, call),
            )
            try:
                resp = await self.http.send(req, stream=lazy)
            except httpx.TransportError as e:
                err: SandboxError = ConnectionFailed(f"{call.method} {call.path}: {e!r}")
            else:
                if resp.status_code < 400 or resp.status_code in call.answers:
                    return resp
                if lazy:
                    await resp.aread()
                    await resp.aclose()
                try:
                    raise_for(resp)
                except SandboxError as e:
                    err = e
            wait = self.config.retry.delay(attempt, err) if call.idempotent else None
            if wait is None:
                raise err
            await asyncio.sleep(wait)

    async def call(self, call: Call[T]) -> T:
        """Send `call`, retrying as the config says; its parsed answer."""
        return call.parse(await self._send(call))

    @contextlib.asynccontextmanager
    async def open(self, call: Call[Any]) -> AsyncIterator[httpx.Response]:
        """Send `call` and hand over its answer unread (a download)."""
        resp = await self._send(call, lazy=True)
        try:
            yield resp
        finally:
            await resp.aclose()

    async def stream(self, call: Call[Any]) -> AsyncIterator[Event]:
        """Send `call` for NDJSON and yield its events until `Exited`."""
        resp = await self._send(call, lazy=True)
        try:
            async for line in resp.aiter_lines():
                if line.strip():
                    ev = event_of(line)
                    if ev is not None:
                        yield ev
                        if isinstance(ev, Exited):
                            return
        except httpx.TransportError as e:
            raise ConnectionFailed(f"stream {call.path}: {e!r}") from e
        finally:
            await resp.aclose()
        raise StreamError(f"stream {call.path} ended without a result")
