"""No daemon: the error table, error bodies, the retry rule and the wire
encodings, through httpx's MockTransport."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable, List, Optional

import httpx
import pytest

from agent_sandbox import Client, CommandResult, Egress, Retry, Sandbox, Secret, SecretInfo, SessionInfo, errors
from agent_sandbox import _ops as ops
from agent_sandbox._core import Config, event_of


def mock_client(handler: Callable[[httpx.Request], httpx.Response], retry: Optional[Retry] = None) -> Client:
    cfg = Config("http://sandbox.test", "k", retry=retry or Retry())
    http = httpx.Client(base_url=cfg.url, headers=cfg.headers(), transport=httpx.MockTransport(handler))
    return Client(config=cfg, http_client=http)


def err(status: int, code: str, retry_after: str = "") -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after else {}
    return httpx.Response(status, json={"error": {"code": code, "message": f"{code}!"}}, headers=headers)


FAST = Retry(attempts=3, backoff=0.001, max_backoff=0.01)


def test_every_code_has_its_class() -> None:
    assert len(errors.CODES) >= 50
    for code, cls in errors.CODES.items():
        assert issubclass(cls, errors.SandboxError) and cls.code_name == code
        e = errors.error_for(400, code, "m")
        assert type(e) is cls and e.code == code and e.message == "m"
    assert errors.CODES["session_not_found"] is errors.SessionNotFound
    assert errors.CODES["rate_limited"] is errors.RateLimited
    assert errors.CODES["at_capacity"] is errors.AtCapacity
    unknown = errors.error_for(418, "teapot", "short and stout")
    assert type(unknown) is errors.SandboxError and unknown.code == "teapot"


def test_error_bodies_both_shapes_and_not_json() -> None:
    bodies = iter(
        [
            err(404, "session_not_found"),
            httpx.Response(404, json={"error": "no session", "code": "session_not_found"}),  # seed shape
            httpx.Response(502, text="<html>bad gateway</html>"),
        ]
    )
    with mock_client(lambda r: next(bodies)) as c:
        with pytest.raises(errors.SessionNotFound) as a:
            c.connect("x")
        assert (a.value.status, a.value.message) == (404, "session_not_found!")
        with pytest.raises(errors.SessionNotFound, match="no session"):
            c.connect("x")
        with pytest.raises(errors.SandboxError) as b:
            c.connect("x")
        assert b.value.status == 502 and b.value.code == "http_502"


def test_idempotent_call_retried_on_429_and_503() -> None:
    seen: List[str] = []
    replies = iter([err(429, "rate_limited", "0"), err(503, "at_capacity"), httpx.Response(200, json={"sessions": []})])

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r.method)
        return next(replies)

    with mock_client(handler, FAST) as c:
        assert c.list() == []
    assert seen == ["GET", "GET", "GET"]


def test_retries_give_up_after_attempts_with_the_last_error() -> None:
    n = []

    def handler(r: httpx.Request) -> httpx.Response:
        n.append(1)
        return err(503, "too_many_connections", "0")

    with mock_client(handler, FAST) as c, pytest.raises(errors.TooManyConnections) as e:
        c.list()
    assert len(n) == 3 and e.value.retry_after == 0


def test_non_idempotent_and_permanent_errors_not_retried() -> None:
    n = []

    def handler(r: httpx.Request) -> httpx.Response:
        n.append(r.url.path)
        if r.url.path == "/v1/sessions" and r.method == "GET":
            return err(429, "quota_exceeded")
        return err(429, "rate_limited", "0")

    with mock_client(handler, FAST) as c:
        with pytest.raises(errors.RateLimited):
            c.run("bash", "true")  # POST /v1/run: not idempotent
        with pytest.raises(errors.QuotaExceeded):
            c.list()  # a quota frees only when a session ends
    assert n == ["/v1/run", "/v1/sessions"]


def test_retry_after_is_capped() -> None:
    r = Retry(attempts=5, max_backoff=2.0)
    assert r.delay(1, errors.RateLimited("x", status=429, retry_after=30)) == 2.0
    assert r.delay(1, errors.RateLimited("x", status=429, retry_after=1)) == 1.0
    assert r.delay(5, errors.RateLimited("x", status=429, retry_after=1)) is None
    assert r.delay(1, errors.SessionNotFound("x", status=404)) is None
    d = r.delay(2, errors.AtCapacity("x", status=503))
    assert d is not None and 0 < d <= 2.0


def test_connection_failure_is_typed() -> None:
    def handler(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=r)

    with mock_client(handler, Retry(attempts=1)) as c, pytest.raises(errors.ConnectionFailed):
        c.list()


def test_exec_body_wire_names() -> None:
    b = ops.exec_body("ls", cwd="/w", env={"A": "1"}, timeout=1.5, stdin=b"\x00", pty=(3, 4), tag="t")
    assert b == {
        "command": "ls",
        "cwd": "/w",
        "env": {"A": "1"},
        "timeout": 1500,
        "stdinBase64": "AA==",
        "pty": {"rows": 3, "cols": 4},
        "tag": "t",
    }
    assert ops.exec_body(["a", "b"], stdin="s") == {"argv": ["a", "b"], "stdin": "s"}
    body = ops.create_body(
        memory_mib=512, idle_timeout="5m", on_idle="pause", egress=Egress("allowlist", domains=["x.org"])
    )
    assert body == {
        "memoryMib": 512,
        "idleTimeout": "5m",
        "onIdle": "pause",
        "egress": {"mode": "allowlist", "domains": ["x.org"]},
    }


def test_results_and_events_from_wire() -> None:
    r = CommandResult.from_wire(
        {
            "exitCode": 1,
            "durationMs": 7,
            "duration": 9,
            "timedOut": False,
            "signal": None,
            "resourceUsage": {"memoryMb": 1.5, "cpuPercent": 20.0, "source": "cgroup"},
            "output": [
                {"stream": "stdout", "data": "a"},
                {"stream": "stderr", "data": "b"},
                {"stream": "stdout", "data": "Yw==", "encoding": "base64"},
            ],
        }
    )
    assert (r.exit_code, r.stdout, r.stderr, r.duration_ms) == (1, "ac", "b", 7)
    assert r.resource_usage is not None and r.resource_usage.memory_mb == 1.5
    with pytest.raises(errors.SessionClosed):
        event_of(json.dumps({"type": "error", "error": {"code": "session_closed", "message": "gone"}}))
    assert event_of('{"type": "future-kind"}') is None


def test_with_block_kills_on_exception_offline() -> None:
    calls: List[str] = []

    def handler(r: httpx.Request) -> httpx.Response:
        calls.append(f"{r.method} {r.url.path}")
        if r.method == "POST":
            return httpx.Response(201, json={"id": "s1", "state": "ready"})
        return httpx.Response(200, json={"destroyed": True})

    with mock_client(handler) as c:
        with pytest.raises(KeyError):
            with Sandbox.create(client=c):
                raise KeyError("x")
    assert calls == ["POST /v1/sessions", "DELETE /v1/sessions/s1"]


def test_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_SANDBOX_URL", "http://h:1/")
    monkeypatch.setenv("AGENT_SANDBOX_API_KEY", "asbx_x")
    c = Config()
    assert c.url == "http://h:1" and c.headers()["Authorization"] == "Bearer asbx_x"
    assert Config("http://other", "k2").headers()["Authorization"] == "Bearer k2"


def test_readme_quick_start_is_the_example() -> None:
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    example = (root / "examples" / "quickstart.py").read_text()
    assert block == example and len(example.splitlines()) == 10


def test_owner_goes_only_to_session_routes() -> None:
    seen: List[str] = []

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(f"{r.method} {r.url.path}?{r.url.query.decode()}")
        if r.url.path == "/v1/snapshots":
            return httpx.Response(200, json={"snapshots": []})
        if r.url.path.endswith("/processes"):
            return httpx.Response(200, json={"processes": []})
        return httpx.Response(200, json={"id": "s1", "state": "ready", "destroyed": True})

    with mock_client(handler) as c:
        sbx = c.connect("s1", owner="kother")
        sbx.commands.list()
        c.snapshots.list()
        sbx.kill()
        c.connect("s1")
    assert seen == [
        "GET /v1/sessions/s1?owner=kother",
        "GET /v1/sessions/s1/processes?owner=kother",
        "GET /v1/snapshots?",
        "DELETE /v1/sessions/s1?owner=kother",
        "GET /v1/sessions/s1?",
    ]


def test_ready_answers_not_ready_without_retrying() -> None:
    n: List[int] = []

    def handler(r: httpx.Request) -> httpx.Response:
        n.append(1)
        return httpx.Response(503, json={"status": "not_ready", "ready": False, "reason": "at capacity"})

    with mock_client(handler, FAST) as c:
        assert c.ready()["reason"] == "at capacity"
    assert len(n) == 1


def test_binary_chunks_gathered_whole() -> None:
    # "é" split across two base64 chunks: each chunk alone is invalid UTF-8.
    r = CommandResult.from_wire(
        {
            "exitCode": 0,
            "output": [
                {"stream": "stdout", "data": "w w==".replace(" ", ""), "encoding": "base64"},
                {"stream": "stdout", "data": "qQ==", "encoding": "base64"},
            ],
        }
    )
    assert r.stdout_bytes == b"\xc3\xa9" and r.stdout == "é" and r.stderr_bytes == b""
    assert ops.exec_body("x", binary=True)["encoding"] == "base64"


def test_uploads_retried_only_when_the_bytes_can_be_sent_again() -> None:
    bodies: List[bytes] = []

    def handler(r: httpx.Request) -> httpx.Response:
        bodies.append(r.read())
        if len(bodies) == 1:
            return err(503, "reply_memory_exhausted", "0")
        return httpx.Response(201, json={"path": "/f", "bytes": len(bodies[-1])})

    with mock_client(handler, FAST) as c:
        sbx = Sandbox(SessionInfo(id="s1", state="ready"), c)
        f = io.BytesIO(b"xxpayload")
        f.seek(2)
        assert sbx.files.upload("/f", f, chunk_size=3) == 7  # seekable: sent again, whole
        assert bodies == [b"payload", b"payload"]
        bodies.clear()

        class Pipe(io.RawIOBase):
            data = io.BytesIO(b"once")

            def readable(self) -> bool:
                return True

            def readinto(self, b: bytearray) -> int:  # type: ignore[override]
                chunk = self.data.read(len(b))
                b[: len(chunk)] = chunk
                return len(chunk)

        with pytest.raises(errors.ReplyMemoryExhausted):
            sbx.files.upload("/f", Pipe())  # read once: not retried
        assert bodies == [b"once"]


def test_secrets_and_ports_wire() -> None:
    """The create body's `secrets`, the secrets and ports routes and their
    answers, and `close` of a port that is not open, offline."""
    seen: List[httpx.Request] = []
    info = {
        "name": "TOKEN",
        "hosts": ["api.test"],
        "header": "Authorization",
        "format": None,
        "placeholder": "asbx-secret-" + "0" * 32,
    }
    port = {
        "sessionId": "s1",
        "port": 8000,
        "public": False,
        "url": "http://p.test:9/ports/ab/",
        "createdAt": 1,
        "expiresAt": 2,
    }

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r)
        key = (r.method, r.url.path)
        if key == ("POST", "/v1/sessions"):
            return httpx.Response(201, json={"id": "s1", "state": "ready", "secrets": [info]})
        if key in (("GET", "/v1/sessions/s1/secrets"), ("PUT", "/v1/sessions/s1/secrets")):
            return httpx.Response(200, json={"sessionId": "s1", "secrets": [info]})
        if key == ("POST", "/v1/sessions/s1/ports"):
            return httpx.Response(201, json=port)
        if key == ("GET", "/v1/sessions/s1/ports"):
            return httpx.Response(200, json={"sessionId": "s1", "ports": [port]})
        if key == ("DELETE", "/v1/sessions/s1/ports/8000"):
            return httpx.Response(200, json={"sessionId": "s1", "port": 8000, "closed": True})
        return err(404, "not_found")

    secret = Secret("TOKEN", "sk-offline-value", ["api.test"], format="Bearer {value}")
    assert "sk-offline-value" not in repr(secret)
    with mock_client(handler) as c:
        sbx = c.create(secrets=[secret, {"name": "B", "value": "bbbb", "hosts": ["b.test"], "header": "X-Key"}])
        assert json.loads(seen[-1].content)["secrets"] == [
            {"name": "TOKEN", "value": "sk-offline-value", "hosts": ["api.test"], "format": "Bearer {value}"},
            {"name": "B", "value": "bbbb", "hosts": ["b.test"], "header": "X-Key"},
        ]
        assert sbx.info_at_start.secrets == [
            SecretInfo("TOKEN", ["api.test"], "Authorization", info["placeholder"], raw=info)
        ]
        assert [s.name for s in sbx.secrets.list()] == ["TOKEN"]
        sbx.secrets.set([])
        assert json.loads(seen[-1].content) == {"secrets": []}
        with pytest.raises(TypeError):
            sbx.secrets.set(secret)  # type: ignore[arg-type]
        p = sbx.ports.expose(8000, ttl="2h")
        assert json.loads(seen[-1].content) == {"port": 8000, "ttl": "2h", "public": False}
        assert (p.port, p.url, p.public, p.expires_at, p.host_url) == (8000, port["url"], False, 2, None)
        assert sbx.ports.list() == [p]
        assert sbx.get_url(8000) == port["url"]  # open and not public: reused, nothing opened
        assert seen[-1].method == "GET"
        assert sbx.ports.close(8000) is True
        assert sbx.ports.close(9000) is False  # not open: 404 not_found, answered False
