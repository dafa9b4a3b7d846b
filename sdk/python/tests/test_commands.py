"""Commands: buffered run, streaming order, callbacks, background processes
(attach after output, stdin, signals, kill_all), PTY resize."""

from __future__ import annotations

from typing import List

import pytest

from agent_sandbox import Exited, Output, Sandbox, Started, errors

from conftest import wait_for


def test_run_result(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert r.timed_out is False and r.signal is None
    assert r.duration_ms > 0
    assert r.resource_usage is not None and r.resource_usage.memory_mb > 0
    assert r.resource_usage.source in ("cgroup", "rusage")


def test_run_argv_cwd_env_stdin(sbx: Sandbox) -> None:
    assert sbx.commands.run(["printf", "%s|", "a b", "$HOME"]).stdout == "a b|$HOME|"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("echo $A-$SDK_TEST", env={"A": "x"}).stdout == "x-1\n"
    assert sbx.commands.run("cat", stdin="text in").stdout == "text in"
    assert sbx.commands.run("od -An -tx1", stdin=b"\x00\xff").stdout.split() == ["00", "ff"]


def test_run_with_secret_files_masks_their_values(sbx: Sandbox) -> None:
    value = "sdk-secret-0a1b2c3d4e5f"
    r = sbx.commands.run(
        "stat -c %a /run/secrets/TOKEN; cat /run/secrets/TOKEN; echo; "
        "cat /run/secrets/TOKEN >&2",
        secrets={"TOKEN": value},
    )
    assert (r.exit_code, r.stdout, r.stderr) == (0, "400\n****\n", "****")
    # Streamed (callbacks) as well; the file is gone after each command.
    seen: List[str] = []
    sbx.commands.run("cat /run/secrets/TOKEN", secrets={"TOKEN": value}, on_stdout=seen.append)
    assert "".join(seen) == "****"
    assert sbx.commands.run("test -e /run/secrets/TOKEN").exit_code == 1
    with pytest.raises(errors.BadRequest) as e:
        sbx.commands.run("true", secrets={"a/b": value})
    assert "secret name" in str(e.value) and value not in str(e.value)


def test_run_timeout(sbx: Sandbox) -> None:
    r = sbx.commands.run("sleep 30", timeout=0.5)
    assert r.timed_out is True
    assert r.signal == "SIGKILL" and r.exit_code == 137


def test_stream_order(sbx: Sandbox) -> None:
    script = "for i in 1 2 3 4; do echo o$i; sleep 0.05; echo e$i >&2; sleep 0.05; done; exit 5"
    events = list(sbx.commands.stream(script))
    assert isinstance(events[0], Started) and events[0].proc_id > 0
    assert isinstance(events[-1], Exited) and events[-1].result.exit_code == 5
    outs = [e for e in events if isinstance(e, Output)]
    got = [(e.stream, line) for e in outs for line in e.data.splitlines()]
    want = [(s, f"{tag}{i}") for i in range(1, 5) for s, tag in (("stdout", "o"), ("stderr", "e"))]
    assert got == want
    ts = [e.ts for e in outs]
    assert ts == sorted(ts)


def test_callbacks_see_output_in_order(sbx: Sandbox) -> None:
    out: List[str] = []
    err: List[str] = []
    r = sbx.commands.run(
        "for i in 1 2 3; do echo $i; echo x$i >&2; sleep 0.05; done", on_stdout=out.append, on_stderr=err.append
    )
    assert "".join(out) == "1\n2\n3\n" == r.stdout
    assert "".join(err) == "x1\nx2\nx3\n" == r.stderr
    assert r.exit_code == 0


def test_background_attach_after_it_printed(sbx: Sandbox) -> None:
    p = sbx.commands.start("echo ready; touch /tmp/printed; read line; echo got $line", tag="sdk-bg")
    assert p.proc_id > 0 and p.pid > 0
    wait_for(lambda: sbx.files.exists("/tmp/printed"), what="the process to print")
    info = p.info()
    assert info.running and info.tag == "sdk-bg" and info.background
    assert p.proc_id in {i.proc_id for i in sbx.commands.list()}
    assert sbx.commands.get(p.proc_id).pid == p.pid
    events = sbx.commands.attach(p.proc_id)  # replays what it printed before we came
    first = next(e for e in events if isinstance(e, Output))
    assert first.data == "ready\n"
    assert p.send_stdin("hello\n") == 6
    rest = list(events)
    assert "".join(e.data for e in rest if isinstance(e, Output)) == "got hello\n"
    assert isinstance(rest[-1], Exited) and rest[-1].result.exit_code == 0
    assert p.info().running is False


def test_wait_gathers_output_and_stdin_eof(sbx: Sandbox) -> None:
    p = sbx.commands.start("wc -c")
    sbx.commands.send_stdin(p.proc_id, b"12345", eof=True)
    r = p.wait()
    assert r.stdout.strip() == "5" and r.exit_code == 0


def test_signal_kill_and_kill_all(sbx: Sandbox) -> None:
    p = sbx.commands.start("sleep 300")
    p.signal("TERM")
    r = p.wait()
    assert r.signal == "SIGTERM" and r.exit_code == 143
    q = sbx.commands.start(["sleep", "301"])
    sbx.commands.kill(q.proc_id)
    assert q.wait().signal == "SIGKILL"
    a, b = sbx.commands.start("sleep 302"), sbx.commands.start("sleep 303")
    sbx.commands.signal(a.proc_id, 19)  # SIGSTOP by number: still there for kill_all
    killed, remaining = sbx.commands.kill_all()
    assert killed >= 2 and remaining == 0
    # Their records note the exit a moment after the answer (the agent's
    # pump, after the reaper): wait for it rather than read a list at once.
    assert a.wait().signal == "SIGKILL" and b.wait().signal == "SIGKILL"
    running = {i.proc_id for i in sbx.commands.list() if i.running}
    assert a.proc_id not in running and b.proc_id not in running
    with pytest.raises(errors.ProcessNotFound):
        sbx.commands.get(999_999)


def test_pty_resize_seen_by_stty(sbx: Sandbox) -> None:
    term = sbx.pty.start("/bin/sh", rows=10, cols=20)
    term.send_stdin("stty size\n")
    seen = ""
    for ev in term.attach():
        if isinstance(ev, Output):
            seen += ev.data
            if "10 20" in seen:
                break
    assert "10 20" in seen
    term.resize(33, 77)
    sbx.pty.resize(term.proc_id, 40, 120)
    term.send_stdin("stty size; exit\n")
    r = term.wait()
    assert r.exit_code == 0
    assert "40 120" in r.stdout and "\r\n" in r.stdout  # a terminal: CRLF, all on stdout
    assert r.stderr == ""


def test_leaving_a_stream_early_cancels_the_command(sbx: Sandbox) -> None:
    proc = None
    # (The daemon notices the closed connection when the command next writes.)
    for ev in sbx.commands.stream("echo up; while true; do echo tick; sleep 0.2; done"):
        if isinstance(ev, Started):
            proc = ev.proc_id
        if isinstance(ev, Output):
            break
    assert proc is not None

    def ended() -> bool:
        return not any(p.proc_id == proc and p.running for p in sbx.commands.list())

    wait_for(ended, timeout=20, what="the abandoned command to be killed")


def test_binary_output_keeps_exact_bytes(sbx: Sandbox) -> None:
    want = bytes(range(256))
    sbx.files.write("/tmp/all.bin", want)
    r = sbx.commands.run("cat /tmp/all.bin; printf '\\377' >&2", binary=True)
    assert r.stdout_bytes == want and r.stderr_bytes == b"\xff"
    assert r.stdout == want.decode("utf-8", "replace")
    text = sbx.commands.run("cat /tmp/all.bin")  # the default: UTF-8 text, invalid bytes replaced
    assert text.stdout_bytes is None and "\ufffd" in text.stdout
    raw = b"".join(e.raw or b"" for e in sbx.commands.stream("cat /tmp/all.bin", binary=True) if isinstance(e, Output))
    assert raw == want
    p = sbx.commands.start("cat /tmp/all.bin")
    assert p.wait(binary=True).stdout_bytes == want
    cb: List[str] = []
    r2 = sbx.commands.run("printf 'caf\\303\\251'", binary=True, on_stdout=cb.append)
    assert r2.stdout_bytes == "café".encode() and r2.stdout == "café" and "".join(cb) == r2.stdout
