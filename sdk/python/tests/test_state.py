"""Checkpoints, sessions from a snapshot, fork, pause and resume."""

from __future__ import annotations

import threading

import pytest

from agent_sandbox import Client, Sandbox, errors

from conftest import wait_for


def test_checkpoint_restore_and_delete(client: Client) -> None:
    with Sandbox.create(client=client) as src:
        src.files.write("state.txt", "before")
        snap = src.checkpoint("sdk-py")
        try:
            assert snap.id.startswith("snap-") and snap.name == "sdk-py"
            assert snap.session_id == src.id and snap.restorable and snap.size_bytes > 0
            assert snap.id in {s.id for s in client.snapshots.list()}
            assert client.snapshots.get(snap.id).template == snap.template
            src.files.write("state.txt", "after")  # the source runs on
            with Sandbox.create(client=client, from_snapshot=snap.id) as copy:
                assert copy.info_at_start.template == snap.template
                assert copy.files.read("state.txt") == "before"
            made, failed = client.create_many(snap.id, 2, env={"N": "many"})
            try:
                assert failed == [] and len(made) == 2 and made[0].id != made[1].id
                assert [s.commands.run("cat state.txt; echo $N").stdout for s in made] == ["beforemany\n"] * 2
            finally:
                for s in made:
                    s.kill()
            with pytest.raises(errors.BadRequest, match="count"):
                client.create_many(snap.id, 101)
            assert src.files.read("state.txt") == "after"
        finally:
            client.snapshots.delete(snap.id)
        with pytest.raises(errors.SnapshotNotFound):
            client.snapshots.get(snap.id)


def test_fork_and_compare(client: Client) -> None:
    with Sandbox.create(client=client) as src:
        src.commands.run("echo shared > /workspace/f")
        copies, failed = src.fork(1)
        assert failed == [] and len(copies) == 1
        with copies[0] as copy:
            assert copy.id != src.id
            assert copy.files.read("f") == "shared\n"
            copy.files.write("f", "copy\n")
            assert src.files.read("f") == "shared\n"  # apart from here on
            assert copy.files.read("f") == "copy\n"


def test_pause_resume_keeps_processes_and_files(client: Client) -> None:
    with Sandbox.create(client=client) as sbx:
        sbx.files.write("p.txt", "kept")
        bg = sbx.commands.start("sleep 600", tag="survivor")
        paused = sbx.pause()
        assert paused.state == "paused" and (paused.snapshot_bytes or 0) > 0
        assert sbx.info().state == "paused"
        resumed = sbx.resume()
        assert resumed.state == "ready"
        assert sbx.files.read("p.txt") == "kept"
        assert bg.info().running
        sbx.pause()
        # Any exec resumes a paused session.
        assert sbx.commands.run("cat p.txt").stdout == "kept"
        assert sbx.info().state == "ready"


def test_busy_session_refuses_checkpoint(client: Client) -> None:
    with Sandbox.create(client=client) as sbx:
        done = threading.Event()
        worker = threading.Thread(target=lambda: (sbx.commands.run("sleep 3; echo x"), done.set()))
        worker.start()
        try:
            wait_for(lambda: any(p.running and not p.background for p in sbx.commands.list()), what="the command")
            with pytest.raises(errors.SessionBusy) as e:
                sbx.checkpoint()
            assert e.value.status == 409
            with pytest.raises(errors.SessionBusy):
                sbx.pause()
        finally:
            worker.join()
        assert done.is_set()
