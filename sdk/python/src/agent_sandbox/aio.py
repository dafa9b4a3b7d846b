"""The async client: `AsyncSandbox` and `AsyncClient`, the surface of the sync
one (`agent_sandbox.sandbox`) with `await`."""

from __future__ import annotations

import inspect
from types import TracebackType
from typing import (
    Any,
    AsyncIterator,
    Callable,
    Coroutine,
    Dict,
    Generator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    Union,
)

import httpx

from . import _ops as ops
from ._core import AsyncTransport, Config, Retry
from ._files import CHUNK, Sink, Source, async_chunks_of, async_write_sink, replayable, size_of
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
    "Opening",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncCommands",
    "AsyncProcess",
    "AsyncPty",
    "AsyncFiles",
    "AsyncNetwork",
    "AsyncSecrets",
    "AsyncPorts",
    "AsyncKeys",
    "AsyncSnapshots",
]

OnOutput = Callable[[str], object]


class AsyncClient:
    """A connection to the daemon (keep-alive, retries), and what is not
    one session's: listing, one-shot runs, templates, keys, snapshots.

    `url` and `api_key` default to `AGENT_SANDBOX_URL` /
    `AGENT_SANDBOX_API_KEY`; `timeout` is seconds for a plain call; `retry`
    says how transient errors are retried; `http_client` is an `httpx.AsyncClient`
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
        http_client: Optional[httpx.AsyncClient] = None,
    ) -> None:
        self.config = config or Config(url or "", api_key, timeout, retry or Retry())
        self._t = AsyncTransport(self.config, http_client)
        self.keys = AsyncKeys(self._t)
        """Admin keys (needs an `admin` key)."""
        self.snapshots = AsyncSnapshots(self._t)
        """Snapshots of this key's sessions."""

    async def close(self) -> None:
        await self._t.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(self, template: Optional[str] = None, **kwargs: Any) -> "AsyncSandbox":
        """A new session (arguments as `AsyncSandbox.create`), sharing this client."""
        return await AsyncSandbox.create(template, client=self, **kwargs)

    async def create_many(
        self, from_snapshot: str, count: int, **kwargs: Any
    ) -> Tuple[List["AsyncSandbox"], List[FailedCopy]]:
        """`count` sessions (1..100) started together from a snapshot (other
        arguments as `AsyncSandbox.create`): those that started, and those that
        failed (each removed). They share this client."""
        body = ops.create_body(from_snapshot=from_snapshot, count=count, **kwargs)
        infos, failed = await self._t.call(ops.create_sessions(body))
        return [AsyncSandbox(i, self) for i in infos], failed

    async def connect(self, sandbox_id: str, owner: Optional[str] = None) -> "AsyncSandbox":
        """The session `sandbox_id` (checked to exist), sharing this client;
        `owner`: another key's id, for an admin key."""
        return await AsyncSandbox.connect(sandbox_id, client=self, owner=owner)

    async def list(self) -> List[SessionInfo]:
        """This key's sessions (an admin key: every key's)."""
        return await self._t.call(ops.list_sessions())

    async def run(self, language: str, code: str, limits: Optional[RunLimits] = None) -> RunResult:
        """Run one `python`, `node` or `bash` program in a sandbox made for
        the call and destroyed after it (`POST /v1/run`)."""
        return await self._t.call(ops.run(language, code, limits))

    async def templates(self) -> List[Template]:
        return await self._t.call(ops.list_templates())

    async def health(self) -> Dict[str, Any]:
        """`GET /health` (no key needed): status, uptime, version, backend."""
        return await self._t.call(ops.health())

    async def ready(self) -> Dict[str, Any]:
        """`GET /ready`: `ready` true when sessions can be created, else
        `reason` says what failed (answered, not raised, when not ready)."""
        return await self._t.call(ops.ready())

    async def metrics(self) -> str:
        """`GET /metrics` (`metrics` scope): OpenMetrics text."""
        return await self._t.call(ops.metrics())


class Opening:
    """A sandbox being created: `await` it for the `AsyncSandbox`, or use it
    in `async with` (the sandbox is destroyed on exit, also on an error)."""

    def __init__(self, coro: Coroutine[Any, Any, "AsyncSandbox"]) -> None:
        self._coro = coro
        self._sbx: Optional["AsyncSandbox"] = None

    def __await__(self) -> Generator[Any, None, "AsyncSandbox"]:
        return self._coro.__await__()

    async def __aenter__(self) -> "AsyncSandbox":
        self._sbx = await self._coro
        return self._sbx

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if self._sbx is not None:
            await self._sbx.__aexit__(exc_type, exc, tb)


class AsyncSandbox:
    """One session, as `Sandbox` but async: destroyed by `await kill()` or on
    leaving an `async with` block (also when the block raises).

    ```python
    async with AsyncSandbox.create(template="base") as sbx:
        print((await sbx.commands.run("echo hi")).stdout)
    ```
    """

    def __init__(
        self, info: SessionInfo, client: AsyncClient, owns_client: bool = False, owner: Optional[str] = None
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
        self.commands = AsyncCommands(t, self.id)
        self.pty = AsyncPty(t, self.id)
        self.files = AsyncFiles(t, self.id)
        self.network = AsyncNetwork(t, self.id)
        self.secrets = AsyncSecrets(t, self.id)
        self.ports = AsyncPorts(t, self.id)

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r})"

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
        client: Optional[AsyncClient] = None,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
    ) -> "Opening":
        """Start a session and return once its sandbox is ready.

        `ttl`, `idle_timeout`, `paused_ttl`: seconds or text (`"30m"`);
        `on_idle`: `"destroy"` (default) or `"pause"`; `from_snapshot`: a
        snapshot id to start from instead of a template; `secrets`: a list
        of `Secret` (or dicts) the egress proxy injects, each command seeing
        only a placeholder (see `AsyncSecrets`; needs networking: else
        `EgressNotApplied`). Without `client` the sandbox makes (and closes)
        its own from `url`/`api_key`.

        Await it (`sbx = await AsyncSandbox.create()`) or enter it
        (`async with AsyncSandbox.create() as sbx:`).
        """

        async def go() -> "AsyncSandbox":
            owns = client is None
            c = client or AsyncClient(url, api_key)
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
                info = await c._t.call(ops.create_session(body))
            except BaseException:
                if owns:
                    await c.close()
                raise
            return cls(info, c, owns)

        return Opening(go())

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        client: Optional[AsyncClient] = None,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        owner: Optional[str] = None,
    ) -> "AsyncSandbox":
        """A handle on an existing session (`SessionNotFound` if there is
        none). `owner`: the key id of another key's session (an admin key
        only; `SessionInfo.owner` in an admin's `list()`)."""
        owns = client is None
        c = client or AsyncClient(url, api_key)
        try:
            info = await c._t.owned_by(owner).call(ops.get_session(sandbox_id))
        except BaseException:
            if owns:
                await c.close()
            raise
        return cls(info, c, owns, owner)

    @staticmethod
    async def list(
        *, client: Optional[AsyncClient] = None, url: Optional[str] = None, api_key: Optional[str] = None
    ) -> List[SessionInfo]:
        """The key's sessions."""
        if client is not None:
            return await client.list()
        async with AsyncClient(url, api_key) as c:
            return await c.list()

    async def info(self) -> SessionInfo:
        """The session as the daemon shows it now."""
        return await self._t.call(ops.get_session(self.id))

    async def keepalive(self) -> SessionInfo:
        """Reset the idle timer."""
        return await self._t.call(ops.keepalive(self.id))

    async def kill(self) -> bool:
        """Destroy the session and its sandbox: True if this call did, False
        if it was already gone (not an error)."""
        return await self._t.call(ops.delete_session(self.id))

    async def get_url(self, port: int, *, public: bool = False, ttl: Optional[Duration] = None) -> str:
        """A URL that reaches guest `port` from outside: `ports.get_url`."""
        return await self.ports.get_url(port, public=public, ttl=ttl)

    async def close(self) -> None:
        """Close the connection this sandbox made (the session stays)."""
        if self._owns:
            await self.client.close()

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        try:
            await self.kill()
        finally:
            await self.close()

    # -- state --

    async def checkpoint(self, name: Optional[str] = None) -> Snapshot:
        """Save the whole session state as a snapshot; the session runs on."""
        return await self._t.call(ops.checkpoint(self.id, name))

    async def fork(self, count: int = 1) -> Tuple[List["AsyncSandbox"], List[FailedCopy]]:
        """`count` new sessions started from a checkpoint of this one (the
        copies that started, and those that failed)."""
        infos, failed = await self._t.call(ops.fork(self.id, count))
        return [self._sibling(i) for i in infos], failed

    async def pause(self) -> SessionInfo:
        """Save the state and stop the VM; any exec or file call resumes it."""
        return await self._t.call(ops.pause(self.id))

    async def resume(self) -> SessionInfo:
        return await self._t.call(ops.resume(self.id))

    def _sibling(self, info: SessionInfo) -> "AsyncSandbox":
        if self._owns:  # its own connection, so it outlives this one
            return AsyncSandbox(info, AsyncClient(config=self.client.config), True, self.owner)
        return AsyncSandbox(info, self.client, owner=self.owner)


class AsyncProcess:
    """A background process (from `commands.start` or `pty.start`)."""

    def __init__(self, t: AsyncTransport, session: str, proc_id: int, pid: int = 0) -> None:
        self._t, self._s = t, session
        self.proc_id = proc_id
        self.pid = pid

    def __repr__(self) -> str:
        return f"AsyncProcess(proc_id={self.proc_id}, pid={self.pid})"

    async def info(self) -> ProcessInfo:
        return await self._t.call(ops.get_process(self._s, self.proc_id))

    def attach(self, replay: bool = True, binary: bool = False) -> AsyncIterator[Event]:
        """Its output as events (what it printed so far first, unless
        `replay=False`), ending with `Exited` when it exits; `binary=True`:
        `Output.raw` has the exact bytes."""
        return self._t.stream(ops.attach(self._s, self.proc_id, replay, binary))

    async def wait(
        self, on_stdout: Optional[OnOutput] = None, on_stderr: Optional[OnOutput] = None, binary: bool = False
    ) -> CommandResult:
        """Follow its output until it exits; the result with all of it
        (`binary=True`: its bytes too)."""
        return await _gather(self.attach(binary=binary), on_stdout, on_stderr)

    async def send_stdin(self, data: Union[str, bytes], eof: bool = False) -> int:
        """Write to its stdin (`eof=True` closes it after); bytes delivered."""
        return await self._t.call(ops.send_stdin(self._s, self.proc_id, data, eof))

    async def signal(self, sig: Signal = "SIGTERM") -> None:
        await self._t.call(ops.signal(self._s, self.proc_id, sig))

    async def kill(self) -> None:
        await self.signal("SIGKILL")

    async def resize(self, rows: int, cols: int) -> None:
        """Resize its terminal (PTY processes)."""
        await self._t.call(ops.resize(self._s, self.proc_id, rows, cols))


async def _gather(
    events: AsyncIterator[Event], on_stdout: Optional[OnOutput], on_stderr: Optional[OnOutput]
) -> CommandResult:
    outs: List[Output] = []
    async for ev in events:
        if isinstance(ev, Output):
            outs.append(ev)
            cb = on_stdout if ev.stream == "stdout" else on_stderr
            if cb is not None:
                got = cb(ev.data)
                if inspect.isawaitable(got):
                    await got
        elif isinstance(ev, Exited):
            return ev.result.with_output(outs)
    raise AssertionError("unreachable: the stream raises without a result")


class AsyncCommands:
    """Commands in the session: foreground (`run`, `stream`) and background."""

    def __init__(self, t: AsyncTransport, session: str) -> None:
        self._t, self._s = t, session

    async def run(
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
            return await self._t.call(ops.exec_buffered(self._s, body))
        return await _gather(self._t.stream(ops.exec_stream(self._s, body)), on_stdout, on_stderr)

    def stream(
        self,
        cmd: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Union[str, bytes, None] = None,
        binary: bool = False,
    ) -> AsyncIterator[Event]:
        """Run `cmd`, yielding `Started`, `Output`... and last `Exited` as the
        guest produces them (`binary=True`: `Output.raw` has the bytes).
        To leave the loop early, `await it.aclose()`
        (else the loop closes it later): the daemon then kills the command
        (when it next writes output)."""
        body = ops.exec_body(cmd, cwd=cwd, env=env, timeout=timeout, stdin=stdin, binary=binary)
        return self._t.stream(ops.exec_stream(self._s, body))

    async def start(
        self,
        cmd: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        tag: Optional[str] = None,
    ) -> AsyncProcess:
        """Start `cmd` in the background; it runs on after this returns."""
        body = ops.exec_body(cmd, cwd=cwd, env=env, timeout=timeout, tag=tag, background=True)
        s: Started = await self._t.call(ops.exec_background(self._s, body))
        return AsyncProcess(self._t, self._s, s.proc_id, s.pid)

    async def list(self) -> List[ProcessInfo]:
        """Processes started in the session (running and recently finished)."""
        return await self._t.call(ops.list_processes(self._s))

    async def get(self, proc_id: int) -> AsyncProcess:
        """A handle on process `proc_id` (`ProcessNotFound` if unknown)."""
        p = await self._t.call(ops.get_process(self._s, proc_id))
        return AsyncProcess(self._t, self._s, p.proc_id, p.pid)

    def attach(self, proc_id: int, replay: bool = True, binary: bool = False) -> AsyncIterator[Event]:
        return AsyncProcess(self._t, self._s, proc_id).attach(replay, binary)

    async def send_stdin(self, proc_id: int, data: Union[str, bytes], eof: bool = False) -> int:
        return await AsyncProcess(self._t, self._s, proc_id).send_stdin(data, eof)

    async def signal(self, proc_id: int, sig: Signal = "SIGTERM") -> None:
        await AsyncProcess(self._t, self._s, proc_id).signal(sig)

    async def kill(self, proc_id: int) -> None:
        await AsyncProcess(self._t, self._s, proc_id).kill()

    async def kill_all(self) -> Tuple[int, int]:
        """SIGKILL every process in the sandbox; (killed, remaining)."""
        return await self._t.call(ops.kill_all(self._s))


class AsyncPty:
    """Programs on a terminal."""

    def __init__(self, t: AsyncTransport, session: str) -> None:
        self._t, self._s = t, session

    async def start(
        self,
        cmd: Command = "/bin/sh",
        *,
        rows: int = 24,
        cols: int = 80,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        tag: Optional[str] = None,
    ) -> AsyncProcess:
        """Start `cmd` on a `rows` x `cols` terminal in the background; type
        with `send_stdin`, read with `attach` (all output is `stdout`)."""
        body = ops.exec_body(cmd, cwd=cwd, env=env, pty=(rows, cols), tag=tag, background=True)
        s: Started = await self._t.call(ops.exec_background(self._s, body))
        return AsyncProcess(self._t, self._s, s.proc_id, s.pid)

    async def resize(self, proc_id: int, rows: int, cols: int) -> None:
        await self._t.call(ops.resize(self._s, proc_id, rows, cols))


class AsyncFiles:
    """The session's files. Relative paths are under its workspace."""

    def __init__(self, t: AsyncTransport, session: str) -> None:
        self._t, self._s = t, session

    async def read(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read_bytes(path)).decode(encoding)

    async def read_bytes(self, path: str) -> bytes:
        return await self._t.call(ops.read_bytes(self._s, path))

    async def write(self, path: str, data: Union[str, bytes], mode: Optional[int] = None) -> int:
        """Write the whole file atomically (parents made); bytes written.
        `mode` as an int, e.g. `0o755`."""
        raw = data.encode() if isinstance(data, str) else data
        return await self._t.call(ops.write(self._s, path, raw, mode, len(raw)))

    async def upload(self, path: str, source: Source, mode: Optional[int] = None, chunk_size: int = CHUNK) -> int:
        """Stream a local file (a path, or a binary file object) to `path`
        without holding it in memory; bytes written."""
        return await self._t.call(
            ops.write(self._s, path, async_chunks_of(source, chunk_size), mode, size_of(source), replayable(source))
        )

    async def download(self, path: str, dest: Sink, chunk_size: int = CHUNK) -> int:
        """Stream `path` to a local file (a path, or a binary file object);
        bytes received."""
        async with self._t.open(ops.download(self._s, path)) as resp:
            return await async_write_sink(dest, resp.aiter_bytes(chunk_size))

    async def list(self, path: str = ".", recursive: bool = False) -> List[EntryInfo]:
        return await self._t.call(ops.list_files(self._s, path, recursive))

    async def stat(self, path: str) -> FileStat:
        return await self._t.call(ops.stat(self._s, path))

    async def exists(self, path: str) -> bool:
        from .errors import FileNotFound

        try:
            await self.stat(path)
            return True
        except FileNotFound:
            return False

    async def mkdir(self, path: str, parents: bool = True) -> None:
        await self._t.call(ops.mkdir(self._s, path, parents))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._t.call(ops.remove(self._s, path, recursive))

    async def rename(self, src: str, dst: str, overwrite: bool = True) -> None:
        await self._t.call(ops.rename(self._s, src, dst, overwrite))


class AsyncNetwork:
    """The session's egress policy."""

    def __init__(self, t: AsyncTransport, session: str) -> None:
        self._t, self._s = t, session

    async def get(self) -> Egress:
        return await self._t.call(ops.get_network(self._s))

    async def set(self, egress: Egress) -> Egress:
        """Replace the policy (`EgressNotApplied` if it could not be; the old
        one stays)."""
        return await self._t.call(ops.set_network(self._s, egress))


class AsyncSecrets:
    """The session's injected secrets, as `Secrets` (awaited)."""

    def __init__(self, t: AsyncTransport, session: str) -> None:
        self._t, self._s = t, session

    async def list(self) -> List[SecretInfo]:
        """Names, hosts, headers and placeholders (never a value)."""
        return await self._t.call(ops.get_secrets(self._s))

    async def set(self, secrets: Sequence[SecretLike]) -> List[SecretInfo]:
        """Replace the whole set, live (`[]`: none); see `Secrets.set`."""
        return await self._t.call(ops.set_secrets(self._s, secrets))


class AsyncPorts:
    """Guest ports reached from outside (preview URLs), as `Ports` (awaited)."""

    def __init__(self, t: AsyncTransport, session: str) -> None:
        self._t, self._s = t, session

    async def expose(self, port: int, ttl: Optional[Duration] = None, public: bool = False) -> PortInfo:
        """Open guest `port`; see `Ports.expose`."""
        return await self._t.call(ops.expose_port(self._s, port, ttl, public))

    async def list(self) -> List[PortInfo]:
        """The open ports (expired ones are gone)."""
        return await self._t.call(ops.list_ports(self._s))

    async def close(self, port: int) -> bool:
        """Close `port`: True if this call closed it, False if it was not open."""
        from .errors import NotFound

        try:
            await self._t.call(ops.close_port(self._s, port))
            return True
        except NotFound:
            return False

    async def get_url(self, port: int, *, public: bool = False, ttl: Optional[Duration] = None) -> str:
        """The URL of guest `port`; see `Ports.get_url`."""
        for p in await self.list():
            if p.port == port and p.public == public:
                return p.url
        return (await self.expose(port, ttl, public)).url


class AsyncKeys:
    """API keys (`admin` scope)."""

    def __init__(self, t: AsyncTransport) -> None:
        self._t = t

    async def create(
        self,
        name: str,
        *,
        scopes: Optional[List[str]] = None,
        requests_per_second: Optional[float] = None,
        burst: Optional[float] = None,
        expires_at: Optional[int] = None,
    ) -> CreatedKey:
        """A new key; its secret is in the answer only. `expires_at`: Unix ms."""
        return await self._t.call(ops.create_key(name, scopes, requests_per_second, burst, expires_at))

    async def list(self) -> List[KeyRecord]:
        return await self._t.call(ops.list_keys())

    async def revoke(self, key_id: str) -> KeyRecord:
        return await self._t.call(ops.revoke_key(key_id))

    async def rotate(self, key_id: str) -> CreatedKey:
        return await self._t.call(ops.rotate_key(key_id))

    async def delete(self, key_id: str) -> None:
        await self._t.call(ops.delete_key(key_id))


class AsyncSnapshots:
    """The key's snapshots (make one with `AsyncSandbox.checkpoint`)."""

    def __init__(self, t: AsyncTransport) -> None:
        self._t = t

    async def list(self) -> List[Snapshot]:
        return await self._t.call(ops.list_snapshots())

    async def get(self, snapshot_id: str) -> Snapshot:
        return await self._t.call(ops.get_snapshot(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        await self._t.call(ops.delete_snapshot(snapshot_id))
