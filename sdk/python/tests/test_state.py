"""Checkpoints, sessions from a snapshot, fork, pause and resume."""

from __future__ import annotations

import pytest

from agent_sandbox import Client, Sandbox, errors


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
