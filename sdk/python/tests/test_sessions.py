"""Session life cycle: create / connect / list / info / keepalive / kill, and
cleanup on leaving `with` even when the body raises."""

from __future__ import annotations

import pytest

from agent_sandbox import Client, Sandbox, errors

from conftest import gone, session_ids


def test_create_connect_list_kill(client: Client) -> None:
    sbx = Sandbox.create("base", client=client, env={"GREETING": "hi"}, ttl="10m", idle_timeout=300, on_idle="destroy")
    try:
        assert sbx.info_at_start.state == "ready"
        assert sbx.info_at_start.template == "base"
        assert sbx.info_at_start.env == {"GREETING": "hi"}
        assert sbx.info_at_start.idle_timeout_ms == 300_000
        assert sbx.info_at_start.on_idle == "destroy"
        assert sbx.id in session_ids(client)
        assert sbx.id in {s.id for s in Sandbox.list(client=client)}
        assert sbx.id in {s.id for s in Sandbox.list()}  # its own client, from the environment
        again = Sandbox.connect(sbx.id, client=client)
        assert again.id == sbx.id
        assert again.commands.run("echo $GREETING").stdout == "hi\n"
        before = sbx.info().last_used_at or 0
        assert (sbx.keepalive().last_used_at or 0) >= before
    finally:
        assert sbx.kill() is True
    assert gone(client, sbx.id)
    with pytest.raises(errors.SessionNotFound):
        Sandbox.connect(sbx.id, client=client)
    assert sbx.kill() is False  # already gone: no error


def test_create_with_own_client_and_explicit_id(client: Client) -> None:
    # No client: the sandbox makes its own from the environment, closed on exit.
    with Sandbox.create(id="sdk-py-explicit") as sbx:
        assert sbx.id == "sdk-py-explicit"
        with pytest.raises(errors.SessionExists):
            Sandbox.create(id="sdk-py-explicit", client=client)
    assert gone(client, "sdk-py-explicit")


def test_with_block_destroys_on_exception(client: Client) -> None:
    sid = None
    with pytest.raises(RuntimeError, match="boom"):
        with Sandbox.create(client=client) as sbx:
            sid = sbx.id
            assert sid in session_ids(client)
            raise RuntimeError("boom")
    assert sid is not None and gone(client, sid)
    with pytest.raises(errors.SessionNotFound):
        Sandbox.connect(sid, client=client)


def test_create_refusals_are_typed(client: Client) -> None:
    with pytest.raises(errors.UnknownTemplate) as e:
        Sandbox.create("no-such-template", client=client)
    assert e.value.status == 400 and e.value.code == "unknown_template"
    with pytest.raises(errors.InvalidShape):
        Sandbox.create(client=client, vcpus=64)


def test_client_create(client: Client) -> None:
    one = client.create("base", env={"N": "one"})
    with one:
        assert one.commands.run("echo $N").stdout == "one\n"
    assert gone(client, one.id)
