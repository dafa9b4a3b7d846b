"""The sync client: `Sandbox` (one session) and `Client` (the daemon)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

import httpx

from . import _ops as ops
from ._core import Config, Retry, Transport
from ._files import CHUNK, Sink, Source, chunks_of, replayable, size_of, write_sink
from ._ops import Command, Duration, SecretLike, Signal
from .models import (
    CommandResult,
    CreatedKey,
    Egress,
    EntryInfo,
    Event,
    Exited,
    FailedCopy,
    FileStat,
    KeyRecord,
    Output,
    PortInfo,
    ProcessInfo,
    RunLimits,
    RunResult,
    SecretInfo,
    SessionInfo,
    Snapshot,
    Started,
    Template,
)

__all__ = [
    "run",
    "Client",
    "Sandbox",
    "Commands",
    "Process",
    "Pty",
    "Files",
    "Network",
    "Secrets",
    "Ports",
    "Keys",
    "Snapshots",
]

OnOutput = Callable[[str], object]


class Client:
    """A connection to the daemon (keep-alive, retries), and what is not
    one session's: listing, one-shot runs, templates, keys, snapshots.

    `url` and `api_key` default to `AGENT_SANDBOX_URL` /
    `AGENT_SANDBOX_API_KEY`; `timeout` is seconds for a plain call; `retry`
    says how transient errors are retried; `http_client` is an `httpx.Client`
    of your own (proxies, TLS, a mock transport: give it `base_url` and the
    auth header yourself, as `Config.headers()`). Use it as a context
    manager, or close it.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 60.0,
        retry: Optional[Retry] = None,
        config: Optional[Config] = None,
        http_client: Optional[httpx.Client] = None,
    ) -> None:
        self.config = config or Config(url or "", api_key, timeout, retry or Retry())
        self._t = Transport(self.config, http_client)
        self.keys = Keys(self._t)
        """Admin keys (needs an `admin` key)."""
        self.snapshots = Snapshots(self._t)
        """Snapshots of this key's sessions."""

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self, template: Optional[str] = None, **kwargs: Any) -> "Sandbox":
        """A new session (arguments as `Sandbox.create`), sharing this client."""
        return Sandbox.create(template, client=self, **kwargs)

    def create_many(self, from_snapshot: str, count: int, **kwargs: Any) -> Tuple[List["Sandbox"], List[FailedCopy]]:
        """`count` sessions (1..100) started together from a snapshot (other
        arguments as `Sandbox.create`): those that started, and those that
        failed (each removed). They share this client."""
        body = ops.create_body(from_snapshot=from_snapshot, count=count, **kwargs)
        infos, failed = self._t.call(ops.create_sessions(body))
        return [Sandbox(i, self) for i in infos], failed

    def connect(self, sandbox_id: str, owner: Optional[str] = None) -> "Sandbox":
        """The session `sandbox_id` (checked to exist), sharing this client;
        `owner`: another key's id, for an admin key."""
        return Sandbox.connect(sandbox_id, client=self, owner=owner)

    def list(self) -> List[SessionInfo]:
        """This key's sessions (an admin key: every key's)."""
        return self._t.call(ops.list_sessions())

    def run(self, language: str, code: str, limits: Optional[RunLimits] = None) -> RunResult:
        """Run one `python`, `node` or `bash` program in a sandbox made for
        the call and destroyed after it (`POST /v1/run`)."""
        return self._t.call(ops.run(language, code, limits))

    def templates(self) -> List[Template]:
        return self._t.call(ops.list_templates())

    def health(self) -> Dict[str, Any]:
        """`GET /health` (no key needed): status, uptime, version, backend."""
        return self._t.call(ops.health())

    def ready(self) -> Dict[str, Any]:
        """`GET /ready`: `ready` true when sessions can be created, else
        `reason` says what failed (answered, not raised, when not ready)."""
        return self._t.call(ops.ready())

    def metrics(self) -> str:
        """`GET /metrics` (`metrics` scope): OpenMetrics text."""
        return self._t.call(ops.metrics())


def run(
    language: str,
    code: str,
    limits: Optional[RunLimits] = None,
    *,
    url: Optional[str] = None,
    api_key: Optional[str] = None,
) -> RunResult:
    """The one-shot call: `Client.run` on a client made for it.

    ```python
    print(agent_sandbox.run("python", "print(6 * 7)").stdout)  # 42
    ```
    """
    with Client(url, api_key) as c:
        return c.run(language, code, limits)


class Sandbox:
    """One session: a microVM of its own, destroyed by `kill()` or on leaving
    a `with` block (also when the block raises).

    ```python
    with Sandbox.create(template="base") as sbx:
        print(sbx.commands.run("echo hi").stdout)
    ```
    """

    def __init__(
        self, info: SessionInfo, client: Client, owns_client: bool = False, owner: Optional[str] = None
    ) -> None:
        self.id = info.id
        """The session id."""
        self.info_at_start = info
        """The session as it was when this handle was made."""
        self.client = client
        self.owner = owner
        """The key id this session belongs to, when reached with an admin
        key's `owner=` (else None: the client's own key)."""
        self._owns = owns_client
        self._t = t = client._t.owned_by(owner) if owner else client._t
        self.commands = Commands(t, self.id)
        self.pty = Pty(t, self.id)
        self.files = Files(t, self.id)
        self.network = Network(t, self.id)
        self.secrets = Secrets(t, self.id)
        self.ports = Ports(t, self.id)

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r})"

    # -- life cycle --

    @classmethod
    def create(
        cls,
        template: Optional[str] = None,
        *,
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
        secrets: Optional[Sequence[SecretLike]] = None,
        id: Optional[str] = None,
        client: Optional[Client] = None,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> "Sandbox":
        """Start a session and return once its sandbox is ready.

        `ttl`, `idle_timeout`, `paused_ttl`: seconds or text (`"30m"`);
        `on_idle`: `"destroy"` (default) or `"pause"`; `from_snapshot`: a
        snapshot id to start from instead of a template; `secrets`: a list
        of `Secret` (or dicts) the egress proxy injects, each command seeing
        only a placeholder (see `Secrets`; needs networking: else
        `EgressNotApplied`). Without `client` the sandbox makes (and closes)
        its own from `url`/`api_key`.
        """
        owns = client is None
        c = client or Client(url, api_key)
        body = ops.create_body(
            id=id,
            template=template,
            vcpus=vcpus,
            memory_mib=memory_mib,
            disk_mib=disk_mib,
            env=env,
            egress=egress,
            ttl=ttl,
            idle_timeout=idle_timeout,
            on_idle=on_idle,
            paused_ttl=paused_ttl,
            from_snapshot=from_snapshot,
            secrets=secrets,
        )
        try:
            info = c._t.call(ops.create_session(body))
        except BaseException:
            if owns:
                c.close()
            raise
        return cls(info, c, owns)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        client: Optional[Client] = None,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        owner: Optional[str] = None,
    ) -> "Sandbox":
        """A handle on an existing session (`SessionNotFound` if there is
        none). `owner`: the key id of another key's session (an admin key
        only; `SessionInfo.owner` in an admin's `list()`)."""
        owns = client is None
        c = client or Client(url, api_key)
        try:
            info = c._t.owned_by(owner).call(ops.get_session(sandbox_id))
        except BaseException:
            if owns:
                c.close()
            raise
        return cls(info, c, owns, owner)

    @staticmethod
    def list(
        *, client: Optional[Client] = None, url: Optional[str] = None, api_key: Optional[str] = None
    ) -> List[SessionInfo]:
        """The key's sessions."""
        if client is not None:
            return client.list()
        with Client(url, api_key) as c:
            return c.list()

    def info(self) -> SessionInfo:
        """The session as the daemon shows it now."""
        return self._t.call(ops.get_session(self.id))

    def keepalive(self) -> SessionInfo:
        """Reset the idle timer."""
        return self._t.call(ops.keepalive(self.id))

    def kill(self) -> bool:
        """Destroy the session and its sandbox: True if this call did, False
        if it was already gone (not an error)."""
        return self._t.call(ops.delete_session(self.id))

    def get_url(self, port: int, *, public: bool = False, ttl: Optional[Duration] = None) -> str:
        """A URL that reaches guest `port` from outside: `ports.get_url`."""
        return self.ports.get_url(port, public=public, ttl=ttl)

    def close(self) -> None:
        """Close the connection this sandbox made (the session stays)."""
        if self._owns:
            self.client.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        try:
            self.kill()
        finally:
            self.close()

    # -- state --

    def checkpoint(self, name: Optional[str] = None) -> Snapshot:
        """Save the whole session state as a snapshot; the session runs on."""
        return self._t.call(ops.checkpoint(self.id, name))

    def fork(self, count: int = 1) -> Tuple[List["Sandbox"], List[FailedCopy]]:
        """`count` new sessions started from a checkpoint of this one (the
        copies that started, and those that failed)."""
        infos, failed = self._t.call(ops.fork(self.id, count))
        return [self._sibling(i) for i in infos], failed

    def pause(self) -> SessionInfo:
        """Save the state and stop the VM; any exec or file call resumes it."""
        return self._t.call(ops.pause(self.id))

    def resume(self) -> SessionInfo:
        return self._t.call(ops.resume(self.id))

    def _sibling(self, info: SessionInfo) -> "Sandbox":
        if self._owns:  # its own connection, so it outlives this one
            return Sandbox(info, Client(config=self.client.config), True, self.owner)
        return Sandbox(info, self.client, owner=self.owner)


class Process:
    """A background process (from `commands.start` or `pty.start`)."""

    def __init__(self, t: Transport, session: str, proc_id: int, pid: int = 0) -> None:
        self._t, self._s = t, session
        self.proc_id = proc_id
        self.pid = pid

    def __repr__(self) -> str:
        return f"Process(proc_id={self.proc_id}, pid={self.pid})"

    def info(self) -> ProcessInfo:
        return self._t.call(ops.get_process(self._s, self.proc_id))

    def attach(self, replay: bool = True, binary: bool = False) -> Iterator[Event]:
        """Its output as events (what it printed so far first, unless
        `replay=False`), ending with `Exited` when it exits; `binary=True`:
        `Output.raw` has the exact bytes."""
        return self._t.stream(ops.attach(self._s, self.proc_id, replay, binary))

    def wait(
        self, on_stdout: Optional[OnOutput] = None, on_stderr: Optional[OnOutput] = None, binary: bool = False
    ) -> CommandResult:
        """Follow its output until it exits; the result with all of it
        (`binary=True`: its bytes too)."""
        return _gather(self.attach(binary=binary), on_stdout, on_stderr)

    def send_stdin(self, data: Union[str, bytes], eof: bool = False) -> int:
        """Write to its stdin (`eof=True` closes it after); bytes delivered."""
        return self._t.call(ops.send_stdin(self._s, self.proc_id, data, eof))

    def signal(self, sig: Signal = "SIGTERM") -> None:
        self._t.call(ops.signal(self._s, self.proc_id, sig))

    def kill(self) -> None:
        self.signal("SIGKILL")

    def resize(self, rows: int, cols: int) -> None:
        """Resize its terminal (PTY processes)."""
        self._t.call(ops.resize(self._s, self.proc_id, rows, cols))


def _gather(events: Iterator[Event], on_stdout: Optional[OnOutput], on_stderr: Optional[OnOutput]) -> CommandResult:
    outs: List[Output] = []
    for ev in events:
        if isinstance(ev, Output):
            outs.append(ev)
            cb = on_stdout if ev.stream == "stdout" else on_stderr
            if cb is not None:
                cb(ev.data)
        elif isinstance(ev, Exited):
            return ev.result.with_output(outs)
    raise AssertionError("unreachable: the stream raises without a result")


class Commands:
    """Commands in the session: foreground (`run`, `stream`) and background."""

    def __init__(self, t: Transport, session: str) -> None:
        self._t, self._s = t, session

    def run(
        self,
        cmd: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Union[str, bytes, None] = None,
        on_stdout: Optional[OnOutput] = None,
        on_stderr: Optional[OnOutput] = None,
        binary: bool = False,
        secrets: Optional[Mapping[str, str]] = None,
    ) -> CommandResult:
        """Run `cmd` (a shell line, or an argv list) to its end.

        `timeout` in seconds (then `timed_out` and SIGKILL); with
        `on_stdout`/`on_stderr` the output is streamed to them as it comes;
        `binary=True` keeps the exact bytes (`stdout_bytes`, `stderr_bytes`).
        `secrets={NAME: value}`: files `/run/secrets/NAME` (0400) for this
        command only, each value masked as `****` in its output.
        A non-zero exit is a result, not an exception.
        """
        body = ops.exec_body(
            cmd, cwd=cwd, env=env, timeout=timeout, stdin=stdin, binary=binary, secrets=secrets
        )
        if on_stdout is None and on_stderr is None:
            return self._t.call(ops.exec_buffered(self._s, body))
        return _gather(self._t.stream(ops.exec_stream(self._s, body)), on_stdout, on_stderr)

    def stream(
        self,
        cmd: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Union[str, bytes, None] = None,
        binary: bool = False,
    ) -> Iterator[Event]:
        """Run `cmd`, yielding `Started`, `Output`... and last `Exited` as the
        guest produces them (`binary=True`: `Output.raw` has the bytes).
        Leaving the loop early closes the stream, and the daemon kills the
        command (when it next writes output)."""
        body = ops.exec_body(cmd, cwd=cwd, env=env, timeout=timeout, stdin=stdin, binary=binary)
        return self._t.stream(ops.exec_stream(self._s, body))

    def start(
        self,
        cmd: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        tag: Optional[str] = None,
    ) -> Process:
        """Start `cmd` in the background; it runs on after this returns."""
        body = ops.exec_body(cmd, cwd=cwd, env=env, timeout=timeout, tag=tag, background=True)
        s: Started = self._t.call(ops.exec_background(self._s, body))
        return Process(self._t, self._s, s.proc_id, s.pid)

    def list(self) -> List[ProcessInfo]:
        """Processes started in the session (running and recently finished)."""
        return self._t.call(ops.list_processes(self._s))

    def get(self, proc_id: int) -> Process:
        """A handle on process `proc_id` (`ProcessNotFound` if unknown)."""
        p = self._t.call(ops.get_process(self._s, proc_id))
        return Process(self._t, self._s, p.proc_id, p.pid)

    def attach(self, proc_id: int, replay: bool = True, binary: bool = False) -> Iterator[Event]:
        return Process(self._t, self._s, proc_id).attach(replay, binary)

    def send_stdin(self, proc_id: int, data: Union[str, bytes], eof: bool = False) -> int:
        return Process(self._t, self._s, proc_id).send_stdin(data, eof)

    def signal(self, proc_id: int, sig: Signal = "SIGTERM") -> None:
        Process(self._t, self._s, proc_id).signal(sig)

    def kill(self, proc_id: int) -> None:
        Process(self._t, self._s, proc_id).kill()

    def kill_all(self) -> Tuple[int, int]:
        """SIGKILL every process in the sandbox; (killed, remaining)."""
        return self._t.call(ops.kill_all(self._s))


class Pty:
    """Programs on a terminal."""

    def __init__(self, t: Transport, session: str) -> None:
        self._t, self._s = t, session

    def start(
        self,
        cmd: Command = "/bin/sh",
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        tag: Optional[str] = None,
    ) -> Process:
        """Start `cmd` on a `rows` x `cols` terminal in the background; type
        with `send_stdin`, read with `attach` (all output is `stdout`)."""
        body = ops.exec_body(cmd, cwd=cwd, env=env, pty=(rows, cols), tag=tag, background=True)
        s: Started = self._t.call(ops.exec_background(self._s, body))
        return Process(self._t, self._s, s.proc_id, s.pid)

    def resize(self, proc_id: int, rows: int, cols: int) -> None:
        self._t.call(ops.resize(self._s, proc_id, rows, cols))


class Files:
    """The session's files. Relative paths are under its workspace."""

    def __init__(self, t: Transport, session: str) -> None:
        self._t, self._s = t, session

    def read(self, path: str, encoding: str = "utf-8") -> str:
        return self.read_bytes(path).decode(encoding)

    def read_bytes(self, path: str) -> bytes:
        return self._t.call(ops.read_bytes(self._s, path))

    def write(self, path: str, data: Union[str, bytes], mode: Optional[int] = None) -> int:
        """Write the whole file atomically (parents made); bytes written.
        `mode` as an int, e.g. `0o755`."""
        raw = data.encode() if isinstance(data, str) else data
        return self._t.call(ops.write(self._s, path, raw, mode, len(raw)))

    def upload(self, path: str, source: Source, mode: Optional[int] = None, chunk_size: int = CHUNK) -> int:
        """Stream a local file (a path, or a binary file object) to `path`
        without holding it in memory; bytes written."""
        return self._t.call(
            ops.write(self._s, path, chunks_of(source, chunk_size), mode, size_of(source), replayable(source))
        )

    def download(self, path: str, dest: Sink, chunk_size: int = CHUNK) -> int:
        """Stream `path` to a local file (a path, or a binary file object);
        bytes received."""
        with self._t.open(ops.download(self._s, path)) as resp:
            return write_sink(dest, resp.iter_bytes(chunk_size))

    def list(self, path: str = ".", recursive: bool = False) -> List[EntryInfo]:
        return self._t.call(ops.list_files(self._s, path, recursive))

    def stat(self, path: str) -> FileStat:
        return self._t.call(ops.stat(self._s, path))

    def exists(self, path: str) -> bool:
        from .errors import FileNotFound

        try:
            self.stat(path)
            return True
        except FileNotFound:
            return False

    def mkdir(self, path: str, parents: bool = True) -> None:
        self._t.call(ops.mkdir(self._s, path, parents))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._t.call(ops.remove(self._s, path, recursive))

    def rename(self, src: str, dst: str, overwrite: bool = True) -> None:
        self._t.call(ops.rename(self._s, src, dst, overwrite))


class Network:
    """The session's egress policy."""

    def __init__(self, t: Transport, session: str) -> None:
        self._t, self._s = t, session

    def get(self) -> Egress:
        return self._t.call(ops.get_network(self._s))

    def set(self, egress: Egress) -> Egress:
        """Replace the policy (`EgressNotApplied` if it could not be; the old
        one stays)."""
        return self._t.call(ops.set_network(self._s, egress))


class Secrets:
    """The session's injected secrets (credentials the guest never holds).

    Each command sees `NAME=asbx-secret-<32 hex>`, a placeholder; the egress
    proxy replaces it with the value in the named header of HTTPS requests
    to the secret's hosts, and refuses it (403) anywhere else. Values are
    never shown back: `list` answers `SecretInfo`s.

    ```python
    sbx = Sandbox.create(secrets=[Secret("OPENAI_API_KEY", key, ["api.openai.com"], format="Bearer {value}")])
    ```
    """

    def __init__(self, t: Transport, session: str) -> None:
        self._t, self._s = t, session

    def list(self) -> List[SecretInfo]:
        """Names, hosts, headers and placeholders (never a value)."""
        return self._t.call(ops.get_secrets(self._s))

    def set(self, secrets: Sequence[SecretLike]) -> List[SecretInfo]:
        """Replace the whole set, live (`[]`: none; a name kept keeps its
        placeholder); the next command sees the new variables. A paused
        session gets them when it resumes. `EgressNotApplied` without
        per-session networking; `BadRequest` names a bad secret, never its
        value."""
        return self._t.call(ops.set_secrets(self._s, secrets))


class Ports:
    """Guest ports reached from outside through the daemon's preview
    listener (`serve --preview-listen ADDR`; else `NotSupported`).

    ```python
    sbx.commands.start("python3 -m http.server 8000")
    p = sbx.ports.expose(8000)
    httpx.get(p.url, headers=sbx.client.config.headers())  # not public: the key too
    ```
    """

    def __init__(self, t: Transport, session: str) -> None:
        self._t, self._s = t, session

    def expose(self, port: int, ttl: Optional[Duration] = None, public: bool = False) -> PortInfo:
        """Open guest `port` (1-65535) for `ttl` (seconds or `"2h"`; default
        1 h, at most 24 h and the session's life). `public=False`: requests
        also need the owner's API key (`Authorization: Bearer`), which the
        guest never sees; `public=True`: the URL alone. An open port gets a
        new URL (the old one stops working)."""
        return self._t.call(ops.expose_port(self._s, port, ttl, public))

    def list(self) -> List[PortInfo]:
        """The open ports (expired ones are gone)."""
        return self._t.call(ops.list_ports(self._s))

    def close(self, port: int) -> bool:
        """Close `port`: its URLs answer 404 from now on. True if this call
        closed it, False if it was not open (not an error)."""
        from .errors import NotFound

        try:
            self._t.call(ops.close_port(self._s, port))
            return True
        except NotFound:
            return False

    def get_url(self, port: int, *, public: bool = False, ttl: Optional[Duration] = None) -> str:
        """The URL of guest `port`: that of its open grant when it has one
        with the same `public`, else a new grant's (`expose(port, ttl,
        public)`, which replaces a grant with the other `public`)."""
        for p in self.list():
            if p.port == port and p.public == public:
                return p.url
        return self.expose(port, ttl, public).url


class Keys:
    """API keys (`admin` scope)."""

    def __init__(self, t: Transport) -> None:
        self._t = t

    def create(
        self,
        name: str,
        *,
        scopes: Optional[List[str]] = None,
        requests_per_second: Optional[float] = None,
        burst: Optional[float] = None,
        expires_at: Optional[int] = None,
    ) -> CreatedKey:
        """A new key; its secret is in the answer only. `expires_at`: Unix ms."""
        return self._t.call(ops.create_key(name, scopes, requests_per_second, burst, expires_at))

    def list(self) -> List[KeyRecord]:
        return self._t.call(ops.list_keys())

    def revoke(self, key_id: str) -> KeyRecord:
        return self._t.call(ops.revoke_key(key_id))

    def rotate(self, key_id: str) -> CreatedKey:
        return self._t.call(ops.rotate_key(key_id))

    def delete(self, key_id: str) -> None:
        self._t.call(ops.delete_key(key_id))


class Snapshots:
    """The key's snapshots (make one with `Sandbox.checkpoint`)."""

    def __init__(self, t: Transport) -> None:
        self._t = t

    def list(self) -> List[Snapshot]:
        return self._t.call(ops.list_snapshots())

    def get(self, snapshot_id: str) -> Snapshot:
        return self._t.call(ops.get_snapshot(snapshot_id))

    def delete(self, snapshot_id: str) -> None:
        self._t.call(ops.delete_snapshot(snapshot_id))
