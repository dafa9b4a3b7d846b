"""What the API answers, as dataclasses with snake_case attributes.

The wire is camelCase JSON (docs/openapi.yaml); each class's `from_wire`
reads it and keeps the whole object as `raw` (for fields this SDK does not
name yet).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Union

__all__ = [
    "ResourceUsage",
    "CommandResult",
    "Started",
    "Output",
    "Dropped",
    "Exited",
    "Event",
    "ProcessInfo",
    "EntryInfo",
    "FileStat",
    "Egress",
    "Secret",
    "SecretInfo",
    "PortInfo",
    "SessionInfo",
    "FailedCopy",
    "Snapshot",
    "RunResult",
    "RunLimits",
    "KeyRecord",
    "CreatedKey",
    "Template",
]

Json = Dict[str, Any]


@dataclass
class ResourceUsage:
    """What one command used, measured in the sandbox for it alone."""

    memory_mb: float
    """Peak memory in MiB."""
    cpu_percent: float
    """CPU time over run time, percent (above 100 on several cores)."""
    source: Optional[str] = None
    """`cgroup` or `rusage`."""

    @classmethod
    def from_wire(cls, d: Optional[Json]) -> Optional["ResourceUsage"]:
        if not d:
            return None
        return cls(float(d["memoryMb"]), float(d["cpuPercent"]), d.get("source"))


@dataclass
class CommandResult:
    """A finished command: `commands.run`, or the end of a stream."""

    exit_code: int
    """Exit code; 128+N when killed by signal N."""
    stdout: str
    stderr: str
    duration_ms: int
    """The command's run time in the guest, spawn to exit."""
    timed_out: bool
    resource_usage: Optional[ResourceUsage]
    signal: Optional[str] = None
    """The signal that ended it (`"SIGKILL"`), or None."""
    oom_killed: bool = False
    truncated: bool = False
    """Output went over the daemon's 16 MiB buffer."""
    proc_id: Optional[int] = None
    stdout_bytes: Optional[bytes] = None
    """The exact bytes of stdout, when run with `binary=True` (`stdout` is
    then their UTF-8 reading, invalid bytes replaced)."""
    stderr_bytes: Optional[bytes] = None
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "CommandResult":
        """From a buffered answer (with its `output` chunks) or a `result`
        event (without: the stream's `Output` events had them)."""
        result = cls(
            exit_code=int(d.get("exitCode", -1)),
            stdout="",
            stderr="",
            duration_ms=int(d["durationMs"] if d.get("durationMs") is not None else d.get("duration", 0)),
            timed_out=bool(d.get("timedOut", False)),
            resource_usage=ResourceUsage.from_wire(d.get("resourceUsage")),
            signal=d.get("signal"),
            oom_killed=bool(d.get("oomKilled", False)),
            truncated=bool(d.get("truncated", False)),
            proc_id=d.get("procId"),
            raw=d,
        )
        return result.with_output(Output.from_wire(c) for c in d.get("output") or [])

    def with_output(self, chunks: Iterable["Output"]) -> "CommandResult":
        """This result with `stdout`/`stderr` (and their bytes, for binary
        chunks) made of `chunks`, in order: the one place output is gathered."""
        text: Dict[str, List[str]] = {"stdout": [], "stderr": []}
        raw: Dict[str, List[bytes]] = {"stdout": [], "stderr": []}
        binary = False
        for c in chunks:
            key = "stderr" if c.stream == "stderr" else "stdout"
            text[key].append(c.data)
            raw[key].append(c.raw if c.raw is not None else c.data.encode())
            binary = binary or c.raw is not None
        if binary:  # decoded whole: a character split across chunks stays whole
            self.stdout_bytes, self.stderr_bytes = b"".join(raw["stdout"]), b"".join(raw["stderr"])
            self.stdout = self.stdout_bytes.decode("utf-8", "replace")
            self.stderr = self.stderr_bytes.decode("utf-8", "replace")
        else:
            self.stdout, self.stderr = "".join(text["stdout"]), "".join(text["stderr"])
        return self


@dataclass
class Started:
    """Stream event: the process started."""

    proc_id: int
    pid: int


@dataclass
class Output:
    """Stream event: a chunk of output, in the order the guest wrote it."""

    stream: str
    """`stdout` or `stderr`."""
    data: str
    """The chunk as text (binary chunks: their UTF-8 reading, invalid bytes replaced)."""
    ts: int
    """Unix ms."""
    raw: Optional[bytes] = None
    """The chunk's exact bytes, for output asked for with `binary=True`."""

    @classmethod
    def from_wire(cls, d: Json) -> "Output":
        stream, ts = d.get("stream", "stdout"), int(d.get("ts", 0))
        if d.get("encoding") == "base64":
            raw = base64.b64decode(d.get("data", ""))
            return cls(stream, raw.decode("utf-8", "replace"), ts, raw)
        return cls(stream, str(d.get("data", "")), ts)


@dataclass
class Dropped:
    """Stream event: the daemon dropped this many bytes of output (a slow reader)."""

    bytes: int


@dataclass
class Exited:
    """Stream event, the last one: the process ended.

    In `commands.stream` and `attach` its `result.stdout`/`stderr` are
    empty (the output came as `Output` events); `commands.run` with
    callbacks and `Process.wait` fill them in."""

    result: CommandResult


Event = Union[Started, Output, Dropped, Exited]
"""One event of a command's or background process's stream."""


@dataclass
class ProcessInfo:
    """A process of the session (running or recently finished)."""

    proc_id: int
    pid: int
    argv: List[str]
    running: bool
    tag: Optional[str] = None
    background: bool = False
    pty: bool = False
    started_at: Optional[int] = None
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "ProcessInfo":
        return cls(
            proc_id=int(d["procId"]),
            pid=int(d.get("pid", 0)),
            argv=list(d.get("argv") or []),
            running=bool(d.get("running", False)),
            tag=d.get("tag"),
            background=bool(d.get("background", False)),
            pty=bool(d.get("pty", False)),
            started_at=d.get("startedAt"),
            exit_code=d.get("exitCode"),
            signal=d.get("signal"),
            raw=d,
        )


@dataclass
class EntryInfo:
    """One entry of a directory listing."""

    path: str
    """Relative to the listed directory."""
    name: str
    type: str
    """`file`, `directory`, `symlink` or `other`."""
    size: int
    mode: int
    mtime: int
    """Unix ms."""

    @classmethod
    def from_wire(cls, d: Json) -> "EntryInfo":
        return cls(
            d["path"],
            d.get("name", d["path"].rsplit("/", 1)[-1]),
            d.get("type", "other"),
            int(d.get("size", 0)),
            int(d.get("mode", 0)),
            int(d.get("mtime", 0)),
        )


@dataclass
class FileStat:
    """A file's metadata."""

    path: str
    type: str
    """`file`, `directory`, `symlink` or `other`."""
    size: int
    mode: int
    mtime: int
    link_target: Optional[str] = None

    @classmethod
    def from_wire(cls, d: Json) -> "FileStat":
        return cls(
            d["path"],
            d.get("type", "other"),
            int(d.get("size", 0)),
            int(d.get("mode", 0)),
            int(d.get("mtime", 0)),
            d.get("linkTarget"),
        )


@dataclass
class Egress:
    """A session's network policy (docs/network.md)."""

    mode: str = "internet"
    """`internet`, `none`, `allowlist` or `denylist`."""
    rules: List[str] = field(default_factory=list)
    """`CIDR[:port[/proto]]`, for allowlist/denylist."""
    domains: List[str] = field(default_factory=list)
    denied_domains: List[str] = field(default_factory=list)
    bandwidth_kbps: Optional[int] = None
    bandwidth_burst_kbit: Optional[int] = None

    def to_wire(self) -> Json:
        d: Json = {"mode": self.mode}
        if self.rules:
            d["rules"] = list(self.rules)
        if self.domains:
            d["domains"] = list(self.domains)
        if self.denied_domains:
            d["deniedDomains"] = list(self.denied_domains)
        if self.bandwidth_kbps is not None:
            d["bandwidthKbps"] = self.bandwidth_kbps
        if self.bandwidth_burst_kbit is not None:
            d["bandwidthBurstKbit"] = self.bandwidth_burst_kbit
        return d

    @classmethod
    def from_wire(cls, d: Optional[Json]) -> "Egress":
        d = d or {}
        return cls(
            mode=d.get("mode", "internet"),
            rules=list(d.get("rules") or []),
            domains=list(d.get("domains") or []),
            denied_domains=list(d.get("deniedDomains") or []),
            bandwidth_kbps=d.get("bandwidthKbps"),
            bandwidth_burst_kbit=d.get("bandwidthBurstKbit"),
        )


@dataclass
class Secret:
    """A credential the egress proxy injects (`Sandbox.create(secrets=)`,
    `sbx.secrets.set`): the guest's commands get `name` set to a
    placeholder (`asbx-secret-<32 hex>`), never `value`; the proxy puts the
    value in place of the placeholder in the `header` of HTTPS requests to
    `hosts` (docs/api.md, "Injected secrets"). Needs per-session networking.

    Its `repr` leaves the value out.
    """

    name: str
    """The environment variable holding the placeholder (`[A-Za-z_][A-Za-z0-9_]{0,63}`)."""
    value: str = field(repr=False)
    """The credential (4 characters to 8192 bytes); sent at create or set, never shown back."""
    hosts: List[str]
    """Where the value may go: names (`api.example.com`) or `*.suffix` wildcards (1-16)."""
    header: Optional[str] = None
    """The request header it goes into (None: `Authorization`)."""
    format: Optional[str] = None
    """The header's whole value, `{value}` standing for the secret (`"Bearer {value}"`);
    None: the placeholder inside the header is replaced and the rest kept."""

    def to_wire(self) -> Json:
        d: Json = {"name": self.name, "value": self.value, "hosts": list(self.hosts)}
        if self.header is not None:
            d["header"] = self.header
        if self.format is not None:
            d["format"] = self.format
        return d


@dataclass
class SecretInfo:
    """What the daemon shows of an injected secret: never its value."""

    name: str
    hosts: List[str]
    header: str
    """The header it goes into (`Authorization` unless the secret named one)."""
    placeholder: str
    """What the guest's `$NAME` holds: `asbx-secret-` and 32 hex digits."""
    format: Optional[str] = None
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "SecretInfo":
        return cls(
            name=d["name"],
            hosts=list(d.get("hosts") or []),
            header=d.get("header") or "Authorization",
            placeholder=d.get("placeholder", ""),
            format=d.get("format"),
            raw=d,
        )


@dataclass
class PortInfo:
    """A guest port open to the outside through the daemon's preview
    listener (`sbx.ports.expose`)."""

    port: int
    url: str
    """The path form, `<preview>/ports/<token>/` (the guest sees `/` and below)."""
    public: bool
    """True: the URL alone reaches it. False: a request also needs the owner's
    API key (`Authorization: Bearer ...`, `Client.config.headers()`), which the
    guest never sees."""
    expires_at: int
    """Unix ms; the URL answers 404 after it."""
    created_at: int = 0
    """Unix ms."""
    host_url: Optional[str] = None
    """`<port>-<session>.<preview domain>/?asbx_token=<token>`, when the daemon
    has a `--preview-domain` (opening it sets the token as a host-only cookie)."""
    session_id: str = ""
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "PortInfo":
        return cls(
            port=int(d["port"]),
            url=d["url"],
            public=bool(d.get("public", False)),
            expires_at=int(d.get("expiresAt", 0)),
            created_at=int(d.get("createdAt", 0)),
            host_url=d.get("hostUrl"),
            session_id=d.get("sessionId", ""),
            raw=d,
        )


@dataclass
class SessionInfo:
    """A session as the daemon shows it."""

    id: str
    state: str
    """`starting`, `ready`, `failed`, `paused` or `closing`."""
    template: Optional[str] = None
    vcpus: Optional[int] = None
    memory_mib: Optional[int] = None
    disk_mib: Optional[int] = None
    owner: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    egress: Optional[Egress] = None
    created_at: Optional[int] = None
    last_used_at: Optional[int] = None
    expires_at: Optional[int] = None
    idle_timeout_ms: Optional[int] = None
    on_idle: Optional[str] = None
    paused_ttl_ms: Optional[int] = None
    snapshot_bytes: Optional[int] = None
    paused_at: Optional[int] = None
    paused_expires_at: Optional[int] = None
    busy: bool = False
    secrets: List[SecretInfo] = field(default_factory=list)
    """Its injected secrets (names, hosts, placeholders; never a value)."""
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "SessionInfo":
        return cls(
            id=d.get("id") or d["sessionId"],
            state=d.get("state", ""),
            template=d.get("template"),
            vcpus=d.get("vcpus"),
            memory_mib=d.get("memoryMib"),
            disk_mib=d.get("diskMib"),
            owner=d.get("owner"),
            env=dict(d.get("env") or {}),
            egress=Egress.from_wire(d["egress"]) if d.get("egress") else None,
            created_at=d.get("createdAt"),
            last_used_at=d.get("lastUsedAt"),
            expires_at=d.get("expiresAt"),
            idle_timeout_ms=d.get("idleTimeoutMs"),
            on_idle=d.get("onIdle"),
            paused_ttl_ms=d.get("pausedTtlMs"),
            snapshot_bytes=d.get("snapshotBytes"),
            paused_at=d.get("pausedAt"),
            paused_expires_at=d.get("pausedExpiresAt"),
            busy=bool(d.get("busy", False)),
            secrets=[SecretInfo.from_wire(x) for x in d.get("secrets") or []],
            raw=d,
        )


@dataclass
class FailedCopy:
    """A session of a fork (or a create with `count`) that failed to start."""

    id: str
    code: str
    message: str


@dataclass
class Snapshot:
    """A saved session state, to start sessions from (`from_snapshot`)."""

    id: str
    session_id: str
    template: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    size_bytes: int
    paused_ms: int
    created_at: int
    restorable: bool
    name: Optional[str] = None
    problem: Optional[str] = None
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "Snapshot":
        return cls(
            id=d["id"],
            session_id=d.get("sessionId", ""),
            template=d.get("template", ""),
            vcpus=int(d.get("vcpus", 0)),
            memory_mib=int(d.get("memoryMib", 0)),
            disk_mib=int(d.get("diskMib", 0)),
            size_bytes=int(d.get("sizeBytes", 0)),
            paused_ms=int(d.get("pausedMs", 0)),
            created_at=int(d.get("createdAt", 0)),
            restorable=bool(d.get("restorable", False)),
            name=d.get("name"),
            problem=d.get("problem"),
            raw=d,
        )


@dataclass
class RunLimits:
    """Limits of a one-shot `run` (each None: the daemon's default)."""

    timeout_ms: Optional[int] = None
    max_memory_mb: Optional[int] = None
    cpu_cores: Optional[float] = None
    allow_network: Optional[bool] = None

    def to_wire(self) -> Json:
        d = {
            "timeoutMs": self.timeout_ms,
            "maxMemoryMb": self.max_memory_mb,
            "cpuCores": self.cpu_cores,
            "allowNetwork": self.allow_network,
        }
        return {k: v for k, v in d.items() if v is not None}


@dataclass
class RunResult:
    """The answer of a one-shot `run` (`POST /v1/run`)."""

    sandbox_id: str
    """The run's session id (already destroyed)."""
    exit_code: int
    stdout: str
    stderr: str
    duration_ms: int
    timed_out: bool
    resource_usage: Optional[ResourceUsage]
    language: Optional[str] = None
    template: Optional[str] = None
    signal: Optional[str] = None
    oom_killed: bool = False
    truncated: bool = False
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "RunResult":
        return cls(
            sandbox_id=d.get("sandboxId", ""),
            exit_code=int(d.get("exitCode", -1)),
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            duration_ms=int(d.get("durationMs", 0)),
            timed_out=bool(d.get("timedOut", False)),
            resource_usage=ResourceUsage.from_wire(d.get("resourceUsage")),
            language=d.get("language"),
            template=d.get("template"),
            signal=d.get("signal"),
            oom_killed=bool(d.get("oomKilled", False)),
            truncated=bool(d.get("truncated", False)),
            raw=d,
        )


@dataclass
class KeyRecord:
    """An API key's record (never its secret)."""

    id: str
    name: str
    key_prefix: str
    scopes: List[str]
    requests_per_second: Optional[float]
    burst: Optional[float]
    created_at: int
    expires_at: Optional[int]
    enabled: bool
    expired: bool = False
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "KeyRecord":
        rl = d.get("rateLimit") or {}
        return cls(
            id=d["id"],
            name=d.get("name", ""),
            key_prefix=d.get("keyPrefix", ""),
            scopes=list(d.get("scopes") or []),
            requests_per_second=rl.get("requestsPerSecond"),
            burst=rl.get("burst"),
            created_at=int(d.get("createdAt", 0)),
            expires_at=d.get("expiresAt"),
            enabled=bool(d.get("enabled", True)),
            expired=bool(d.get("expired", False)),
            raw=d,
        )


@dataclass
class CreatedKey:
    """A new (or rotated) key: the secret, shown only here, and its record."""

    key: str
    record: KeyRecord


@dataclass
class Template:
    """A template sessions can start from."""

    name: str
    display_name: str
    version: str
    description: str
    tools: List[str]
    vcpus: int
    memory_mib: int
    default: bool
    raw: Json = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: Json) -> "Template":
        return cls(
            name=d["name"],
            display_name=str(d.get("displayName") or d["name"]),
            version=d.get("version", "0"),
            description=d.get("description", ""),
            tools=list(d.get("tools") or []),
            vcpus=int(d.get("vcpus", 0)),
            memory_mib=int(d.get("memoryMib", 0)),
            default=bool(d.get("default", False)),
            raw=d,
        )
