"""What is not one session's: one-shot runs, templates, health, admin keys
(with a per-key rate limit: 429 mapped and retried), error mapping of
unknown ids, network policy."""

from __future__ import annotations

import os
import time

import pytest

import agent_sandbox
from agent_sandbox import Client, Egress, Retry, RunLimits, Sandbox, errors


def test_one_shot_run(client: Client) -> None:
    r = client.run("python", "import sys; print(6 * 7); print('e', file=sys.stderr); sys.exit(2)")
    assert (r.exit_code, r.stdout, r.stderr) == (2, "42\n", "e\n")
    assert r.sandbox_id.startswith("run-") and r.language == "python"
    assert r.resource_usage is not None and r.duration_ms > 0
    assert r.sandbox_id not in {s.id for s in client.list()}  # destroyed with the run
    t = client.run("bash", "sleep 20", RunLimits(timeout_ms=500, max_memory_mb=64, cpu_cores=0.5))
    assert t.timed_out and t.signal == "SIGKILL"
    with pytest.raises(errors.BadRequest, match="language"):
        client.run("ruby", "puts 1")
    assert agent_sandbox.run("bash", "echo $((6 * 7))").stdout == "42\n"  # from the environment


def test_templates_and_health(client: Client) -> None:
    names = {t.name: t for t in client.templates()}
    assert "base" in names and names["base"].memory_mib > 0 and "bash" in names["base"].tools
    h = client.health()
    assert h["status"] == "ok"
    r = client.ready()
    assert r["status"] == "ready" and r["checks"]["accepting"] is True
    assert "agent_sandbox_sessions" in client.metrics()


def test_network_policy(sbx: Sandbox) -> None:
    assert sbx.network.get().mode in ("internet", "none", "allowlist", "denylist")
    if os.environ.get("AGENT_SANDBOX_TEST_NETWORK") == "on":
        # The wrapper's daemon has networking: the change is installed.
        got = sbx.network.set(Egress(mode="allowlist", domains=["pypi.org"]))
        assert got.mode == "allowlist" and got.domains == ["pypi.org"]
        assert sbx.network.get().mode == "allowlist"
        assert sbx.network.set(Egress(mode="none")).mode == "none"
        return
    # A daemon with `--network off`: a change cannot be installed, and says so.
    with pytest.raises(errors.EgressNotApplied) as e:
        sbx.network.set(Egress(mode="none"))
    assert e.value.status == 409


def test_unknown_ids_are_typed(client: Client, sbx: Sandbox) -> None:
    with pytest.raises(errors.SessionNotFound) as e:
        client.connect("sdk-no-such-session")
    assert (e.value.status, e.value.code) == (404, "session_not_found")
    with pytest.raises(errors.InvalidSessionId):
        client.connect("bad id!")
    with pytest.raises(errors.ProcessNotFound):
        sbx.commands.get(424242)
    with pytest.raises(errors.SnapshotNotFound):
        client.snapshots.get("snap-000000000000")
    with pytest.raises(errors.KeyNotFound):
        client.keys.revoke("knosuchkey000")


def test_keys_and_rate_limit(client: Client) -> None:
    in_a_day = int(time.time() * 1000) + 86_400_000
    created = client.keys.create("sdk-py-test", scopes=["exec"], requests_per_second=0.5, burst=1, expires_at=in_a_day)
    rec = created.record
    try:
        assert created.key.startswith(rec.key_prefix) and rec.scopes == ["exec"] and rec.enabled
        assert rec.requests_per_second == 0.5 and rec.burst == 1 and rec.expires_at == in_a_day
        assert rec.id in {k.id for k in client.keys.list()}
        # Burst 1: the second call at once is over the limit; no retries, it raises.
        with Client(api_key=created.key, retry=Retry(attempts=1)) as limited:
            limited.list()
            with pytest.raises(errors.RateLimited) as e:
                limited.list()
            assert e.value.status == 429 and e.value.retry_after and e.value.retry_after > 0
        # With retries (an idempotent GET), the wait on Retry-After absorbs it.
        with Client(api_key=created.key, retry=Retry(attempts=4, max_backoff=4)) as patient:
            assert patient.list() == []
        # An exec key may not manage keys.
        with Client(api_key=created.key) as weak, pytest.raises(errors.Forbidden):
            weak.keys.list()
        rotated = client.keys.rotate(rec.id)
        assert rotated.key != created.key and rotated.record.id == rec.id
        with Client(api_key=created.key) as old, pytest.raises(errors.Unauthorized):
            old.list()
        revoked = client.keys.revoke(rec.id)
        assert revoked.enabled is False
        with pytest.raises(errors.KeyRevoked):
            client.keys.rotate(rec.id)
    finally:
        client.keys.delete(rec.id)
    assert rec.id not in {k.id for k in client.keys.list()}


def test_admin_reaches_another_keys_session_with_owner(client: Client) -> None:
    other = client.keys.create("sdk-py-owner", scopes=["exec"])
    try:
        with Client(api_key=other.key) as theirs, Sandbox.create(client=theirs) as sbx:
            with pytest.raises(errors.SessionNotFound):
                client.connect(sbx.id)  # each key has its own namespace
            listed = {s.id: s.owner for s in client.list()}  # an admin lists every key's
            assert listed[sbx.id] == other.record.id
            mine = client.connect(sbx.id, owner=other.record.id)
            assert mine.owner == other.record.id
            mine.files.write("from-admin.txt", "hi")
            assert sbx.files.read("from-admin.txt") == "hi"
            assert mine.commands.run("cat from-admin.txt").stdout == "hi"
            assert [e.name for e in mine.files.list()] == ["from-admin.txt"]
            with pytest.raises(errors.Forbidden):
                Sandbox.connect(sbx.id, client=theirs, owner=other.record.id)  # owner= needs admin
            assert mine.kill() is True
            assert sbx.kill() is False  # the admin ended it
    finally:
        client.keys.delete(other.record.id)
