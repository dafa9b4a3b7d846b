"""The async client: the same surface, awaited (run with asyncio.run, no
plugin needed)."""

from __future__ import annotations

import asyncio
import io
import os
from typing import Any, Awaitable, Callable, List, TypeVar

import pytest

from agent_sandbox import (
    AsyncClient,
    AsyncSandbox,
    Egress,
    Exited,
    Output,
    RunLimits,
    Started,
    errors,
)

T = TypeVar("T")


def run(fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(fn())  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _env(client: Any) -> None:
    """Needs the daemon (the `client` fixture skips or fails without it)."""


def test_async_lifecycle_and_cleanup_on_raise() -> None:
    async def go() -> None:
        async with AsyncClient() as c:
            sbx = await AsyncSandbox.create("base", client=c, env={"X": "1"})
            try:
                assert sbx.id in {s.id for s in await c.list()}
                assert sbx.id in {s.id for s in await AsyncSandbox.list(client=c)}
                same = await AsyncSandbox.connect(sbx.id, client=c)
                assert (await same.info()).state == "ready"
                assert (await sbx.keepalive()).id == sbx.id
            finally:
                assert await sbx.kill() is True
            assert await sbx.kill() is False
            with pytest.raises(errors.SessionNotFound):
                await c.connect(sbx.id)
            sid = None
            with pytest.raises(ValueError):
                async with AsyncSandbox.create(client=c) as s:
                    sid = s.id
                    raise ValueError("inside")
            assert sid is not None and sid not in {s.id for s in await c.list()}
            made = await c.create(template="base")
            async with made:
                assert made.id in {s.id for s in await c.list()}
            assert made.id not in {s.id for s in await c.list()}

    run(go)


def test_async_commands_stream_background_pty() -> None:
    async def go() -> None:
        async with AsyncSandbox.create() as sbx:
            r = await sbx.commands.run("echo out; echo err >&2; exit 4", env={"A": "b"})
            assert (r.exit_code, r.stdout, r.stderr) == (4, "out\n", "err\n")
            r = await sbx.commands.run("cat /run/secrets/K", secrets={"K": "async-secret-42"})
            assert (r.exit_code, r.stdout) == (0, "****")
            assert (await sbx.commands.run("test -e /run/secrets/K")).exit_code == 1
            assert (await sbx.commands.run("printf '\\377\\000'", binary=True)).stdout_bytes == b"\xff\x00"
            events = [e async for e in sbx.commands.stream("echo 1; sleep 0.05; echo 2 >&2; sleep 0.05; echo 3")]
            assert isinstance(events[0], Started) and isinstance(events[-1], Exited)
            assert [(e.stream, e.data) for e in events if isinstance(e, Output)] == [
                ("stdout", "1\n"),
                ("stderr", "2\n"),
                ("stdout", "3\n"),
            ]
            seen: List[str] = []

            async def on_out(s: str) -> None:  # an async callback is awaited
                seen.append(s)

            cb = await sbx.commands.run("echo a; echo b", on_stdout=on_out, on_stderr=seen.append)
            assert "".join(seen) == "a\nb\n" == cb.stdout

            p = await sbx.commands.start("echo hi; touch /tmp/up; read l; echo got $l", tag="t")
            while not await sbx.files.exists("/tmp/up"):
                await asyncio.sleep(0.05)
            assert (await p.info()).running and p.proc_id in {i.proc_id for i in await sbx.commands.list()}
            assert (await sbx.commands.get(p.proc_id)).pid == p.pid
            stream = sbx.commands.attach(p.proc_id)
            first = await stream.__anext__()
            while not isinstance(first, Output):
                first = await stream.__anext__()
            assert first.data == "hi\n"
            await sbx.commands.send_stdin(p.proc_id, "x\n")
            rest = [e async for e in stream]
            assert "got x\n" in "".join(e.data for e in rest if isinstance(e, Output))

            s1 = await sbx.commands.start("sleep 100")
            await s1.signal("INT")
            assert (await s1.wait()).signal == "SIGINT"
            s2 = await sbx.commands.start("sleep 100")
            await s2.kill()
            s3 = await sbx.commands.start("sleep 100")
            await sbx.commands.signal(s3.proc_id, "TERM")
            s4 = await sbx.commands.start("sleep 100")
            await sbx.commands.kill(s4.proc_id)
            await sbx.commands.start("sleep 100")
            killed, remaining = await sbx.commands.kill_all()
            assert killed >= 1 and remaining == 0
            s5 = await sbx.commands.start("cat")
            await s5.send_stdin(b"zz", eof=True)
            assert (await s5.wait()).stdout == "zz"

            term = await sbx.pty.start("/bin/sh", rows=5, cols=9)
            await term.resize(21, 61)
            await sbx.pty.resize(term.proc_id, 22, 62)
            await term.send_stdin("stty size; exit\n")
            assert "22 62" in (await term.wait()).stdout

    run(go)


def test_async_files_network_state_run() -> None:
    async def go() -> None:
        async with AsyncClient() as c:
            async with AsyncSandbox.create(client=c) as sbx:
                await sbx.files.write("a/b.txt", "text", mode=0o600)
                assert await sbx.files.read("a/b.txt") == "text"
                assert await sbx.files.read_bytes("a/b.txt") == b"text"
                assert (await sbx.files.stat("a/b.txt")).mode & 0o777 == 0o600
                await sbx.files.mkdir("a/c")
                assert {e.name for e in await sbx.files.list("a")} == {"b.txt", "c"}
                await sbx.files.rename("a/b.txt", "a/c/d.txt")
                assert [e.path for e in await sbx.files.list("a", recursive=True) if e.type == "file"] == ["c/d.txt"]
                data = os.urandom(5 << 20)
                assert await sbx.files.upload("blob", io.BytesIO(data)) == len(data)
                out = io.BytesIO()
                assert await sbx.files.download("blob", out) == len(data)
                assert out.getvalue() == data
                await sbx.files.remove("a", recursive=True)
                assert not await sbx.files.exists("a")
                with pytest.raises(errors.FileNotFound):
                    await sbx.files.read("a/c/d.txt")

                assert (await sbx.network.get()).mode
                try:
                    await sbx.network.set(Egress(mode="none"))
                except errors.EgressNotApplied:
                    pass  # a daemon with --network off

                snap = await sbx.checkpoint()
                assert snap.id in {s.id for s in await c.snapshots.list()}
                assert (await c.snapshots.get(snap.id)).restorable
                copies, failed = await sbx.fork(1)
                assert not failed
                more, bad = await c.create_many(snap.id, 1)
                assert not bad and len(more) == 1
                await more[0].kill()
                async with copies[0] as copy:
                    assert await copy.files.read("blob", encoding="latin-1") == data.decode("latin-1")
                await c.snapshots.delete(snap.id)
                assert (await sbx.pause()).state == "paused"
                assert (await sbx.resume()).state == "ready"

            r = await c.run("node", "console.log(1 + 1)", RunLimits(timeout_ms=20000))
            assert r.stdout == "2\n" and r.exit_code == 0
            assert {t.name for t in await c.templates()} >= {"base"}
            assert (await c.health())["status"] == "ok"
            assert (await c.ready())["ready"] is True and "# EOF" in await c.metrics()
            k = await c.keys.create("sdk-py-async")
            async with AsyncClient(api_key=k.key) as theirs, AsyncSandbox.create(client=theirs) as other:
                mine = await c.connect(other.id, owner=k.record.id)
                assert (await mine.commands.run("echo x")).stdout == "x\n" and mine.owner == k.record.id
            assert k.record.id in {x.id for x in await c.keys.list()}
            assert (await c.keys.rotate(k.record.id)).key != k.key
            assert (await c.keys.revoke(k.record.id)).enabled is False
            await c.keys.delete(k.record.id)

    run(go)
