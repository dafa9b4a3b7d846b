"""Injected secrets and preview ports against the real daemon: the guest
sees a placeholder, never the value; the set is replaced live; a guest web
server is reached from here through `ports.expose(...).url`, with the key
unless public, and nothing after `close`.

The Rust wrapper's daemon has networking (`AGENT_SANDBOX_TEST_NETWORK=on`)
and a preview listener (`AGENT_SANDBOX_TEST_PREVIEW=on`); against a daemon
without them the tests check the typed refusals instead. One `dev` session
serves the whole module (it carries the secret from its creation)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets as rand
from typing import Iterator, List, Tuple

import httpx
import pytest

from agent_sandbox import AsyncClient, AsyncSandbox, Client, Sandbox, Secret, errors

from conftest import wait_for

NETWORK = os.environ.get("AGENT_SANDBOX_TEST_NETWORK") == "on"
PREVIEW = os.environ.get("AGENT_SANDBOX_TEST_PREVIEW") == "on"

NAME = "SDK_TOKEN"
# Random, so no image or earlier run holds it.
VALUE = "sk-sdk-py-" + rand.token_hex(12)
PAGE = "<h1>preview " + rand.token_hex(6) + "</h1>\n"


@pytest.fixture(scope="module")
def net(client: Client) -> Iterator[Sandbox]:
    """The module's session (`dev`: python3 for the web server); with
    networking, created with the secret."""
    secrets = [Secret(NAME, VALUE, ["api.test"], format="Bearer {value}")] if NETWORK else None
    with Sandbox.create("dev", client=client, secrets=secrets) as s:
        yield s


@pytest.fixture(scope="module")
def web() -> Iterator[httpx.Client]:
    """Plain HTTP from the test process (no proxy from the environment)."""
    with httpx.Client(timeout=30, trust_env=False) as h:
        yield h


def test_a_secret_is_a_placeholder_in_the_guest(client: Client, net: Sandbox) -> None:
    if not NETWORK:
        with pytest.raises(errors.EgressNotApplied):
            Sandbox.create("dev", client=client, secrets=[Secret(NAME, VALUE, ["api.test"])])
        return
    (info,) = net.info_at_start.secrets
    placeholder = info.placeholder
    assert placeholder.startswith("asbx-secret-") and len(placeholder) == len("asbx-secret-") + 32
    int(placeholder[len("asbx-secret-") :], 16)
    r = net.commands.run(f"printenv {NAME}")
    assert r.exit_code == 0 and r.stdout == placeholder + "\n"
    assert VALUE not in r.stdout
    (listed,) = net.secrets.list()
    assert (listed.name, listed.hosts, listed.header, listed.format) == (
        NAME,
        ["api.test"],
        "Authorization",
        "Bearer {value}",
    )
    assert listed.placeholder == placeholder
    # The value is in no answer: not the list, not the session's GET.
    assert VALUE not in json.dumps(listed.raw)
    assert VALUE not in json.dumps(net.info().raw)
    assert net.info().secrets[0].placeholder == placeholder


def test_secrets_replaced_live_and_removed(net: Sandbox) -> None:
    if not NETWORK:
        with pytest.raises(errors.EgressNotApplied):
            net.secrets.set([Secret(NAME, VALUE, ["api.test"])])
        return
    before = {s.name: s.placeholder for s in net.secrets.list()}
    other = "other-" + rand.token_hex(8)
    got = net.secrets.set(
        [
            Secret(NAME, "sk-rotated-" + rand.token_hex(8), ["api.test"]),
            {"name": "OTHER_KEY", "value": other, "hosts": ["*.other.test"], "header": "X-Api-Key"},
        ]
    )
    by = {s.name: s for s in got}
    assert set(by) == {NAME, "OTHER_KEY"}
    assert by[NAME].placeholder == before[NAME]  # a name kept keeps its placeholder
    assert (by["OTHER_KEY"].hosts, by["OTHER_KEY"].header) == (["*.other.test"], "X-Api-Key")
    out = net.commands.run("printenv OTHER_KEY").stdout
    assert out == by["OTHER_KEY"].placeholder + "\n" and other not in out
    # A bad secret: 400 naming it, never echoing the value.
    with pytest.raises(errors.BadRequest) as e:
        net.secrets.set([Secret("SHORT", "q7z", ["a.test"])])
    assert "SHORT" in str(e.value) and "q7z" not in str(e.value)
    assert {s.name for s in net.secrets.list()} == {NAME, "OTHER_KEY"}  # the refused set changed nothing
    # None: the next command has no such variable.
    assert net.secrets.set([]) == []
    assert net.secrets.list() == []
    assert net.commands.run(f"printenv {NAME}").exit_code == 1
    assert net.commands.run("echo ${OTHER_KEY:-gone}").stdout == "gone\n"


def test_a_guest_server_through_its_preview_url(client: Client, net: Sandbox, web: httpx.Client) -> None:
    if not PREVIEW:
        with pytest.raises(errors.NotSupported):
            net.ports.expose(8000)
        return
    net.files.write("site/index.html", PAGE)
    server = net.commands.start(["python3", "-m", "http.server", "8000", "--directory", "site"], tag="preview")
    key = client.config.headers()
    oks: List[int] = []  # requests that reached the server (each is a line of its log)

    def get(url: str, auth: bool = True) -> httpx.Response:
        r = web.get(url, headers=key if auth else {})
        if r.status_code == 200:
            oks.append(1)
        return r

    try:
        p = net.ports.expose(8000)
        assert (p.port, p.public) == (8000, False) and p.url.startswith("http://")
        assert p.session_id == net.id and p.expires_at > p.created_at
        # 502 until the server listens.
        wait_for(lambda: get(p.url + "index.html").status_code == 200, 60, "the guest server through the preview")
        r = get(p.url + "index.html")
        assert (r.status_code, r.text) == (200, PAGE)
        # Not public: the key is needed (and nothing reaches the guest without it).
        assert get(p.url + "index.html", auth=False).status_code == 401
        assert web.get(p.url, headers={"Authorization": "Bearer asbx_wrong"}).status_code == 401
        assert [(x.port, x.url, x.public) for x in net.ports.list()] == [(8000, p.url, False)]
        assert net.get_url(8000) == p.url  # open with the same `public`: reused

        # Opened again, public: a new URL; the old one is gone.
        pub = net.ports.expose(8000, ttl=600, public=True)
        assert pub.url != p.url and pub.public
        assert pub.expires_at - pub.created_at <= 600_000
        assert get(p.url + "index.html").status_code == 404
        r = get(pub.url + "index.html", auth=False)
        assert (r.status_code, r.text) == (200, PAGE)
        assert net.ports.get_url(8000, public=True) == pub.url

        # Closed: 404 with or without the key, and nothing reaches the guest.
        assert net.ports.close(8000) is True
        assert get(pub.url + "index.html", auth=False).status_code == 404
        assert get(pub.url + "index.html").status_code == 404
        assert net.ports.close(8000) is False
        assert [x.port for x in net.ports.list()] == []

        with pytest.raises(errors.BadRequest):
            net.ports.expose(0)
        with pytest.raises(errors.BadRequest):
            net.ports.expose(8000, ttl="25h")
    finally:
        server.kill()
    log = server.wait().stderr
    assert log.count('"GET ') == len(oks) == log.count('"GET /index.html HTTP/1.1" 200'), log


def test_refusals_without_networking_or_a_preview_listener(offnet: Tuple[str, str]) -> None:
    """A daemon with `--network off` and no `--preview-listen`: typed errors."""
    url, key = offnet
    with Client(url, key) as c:
        with pytest.raises(errors.EgressNotApplied) as e:
            Sandbox.create("base", client=c, secrets=[Secret(NAME, VALUE, ["api.test"])])
        assert (e.value.status, e.value.code) == (409, "egress_not_applied")
        assert VALUE not in str(e.value)
        assert c.list() == []  # refused before any session was made
        with Sandbox.create("base", client=c) as sbx:
            assert sbx.secrets.list() == [] and sbx.info_at_start.secrets == []
            with pytest.raises(errors.EgressNotApplied):
                sbx.secrets.set([{"name": NAME, "value": VALUE, "hosts": ["api.test"]}])
            assert sbx.secrets.set([]) == []  # none needs nothing
            with pytest.raises(errors.NotSupported) as n:
                sbx.ports.expose(8000)
            assert (n.value.status, n.value.code) == (501, "not_supported")
            assert sbx.ports.list() == []
            assert sbx.ports.close(8000) is False


def test_async_secrets_and_ports(net: Sandbox, web: httpx.Client) -> None:
    """The async twins, on the module's session."""

    async def go() -> None:
        async with AsyncClient() as c:
            sbx = await AsyncSandbox.connect(net.id, client=c)
            if NETWORK:
                (s,) = await sbx.secrets.set([Secret("ASYNC_KEY", VALUE, ["api.test"])])
                assert s.name == "ASYNC_KEY" and s.placeholder.startswith("asbx-secret-")
                assert [x.name for x in await sbx.secrets.list()] == ["ASYNC_KEY"]
                out = (await sbx.commands.run("printenv ASYNC_KEY")).stdout
                assert out == s.placeholder + "\n"
                assert await sbx.secrets.set([]) == []
            else:
                with pytest.raises(errors.EgressNotApplied):
                    await sbx.secrets.set([Secret("ASYNC_KEY", VALUE, ["api.test"])])
            if PREVIEW:
                p = await sbx.ports.expose(8001, public=True)
                assert [x.url for x in await sbx.ports.list()] == [p.url]
                assert await sbx.get_url(8001, public=True) == p.url
                # Nothing listens on 8001 in the guest: the listener says so.
                assert web.get(p.url).status_code == 502
                assert await sbx.ports.close(8001) is True
                assert await sbx.ports.close(8001) is False
                assert web.get(p.url).status_code == 404
            else:
                with pytest.raises(errors.NotSupported):
                    await sbx.ports.expose(8001)

    asyncio.run(go())
