"""Fixtures: a real daemon from the environment.

- `AGENT_SANDBOX_URL`, `AGENT_SANDBOX_API_KEY`: the daemon (an admin key).
- `AGENT_SANDBOX_LIMITED_URL`, `AGENT_SANDBOX_LIMITED_KEY`: a second daemon
  with a low `--rate-limit` and `--max-sessions 1` (the 429/503 tests).
- `AGENT_SANDBOX_OFFNET_URL`, `AGENT_SANDBOX_OFFNET_KEY`: a third daemon (VMs)
  with `--network off` and no preview listener (the refusals of secrets and
  ports).
- `AGENT_SANDBOX_SDK_STRICT=1` (the Rust wrapper sets it): a missing daemon
  is a failure, not a skip.

Tests keep few sessions alive at once (the machine is small): one shared
sandbox per module (`sbx`), others made and destroyed inside a test.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator, Tuple

import pytest

from agent_sandbox import Client, Sandbox

STRICT = os.environ.get("AGENT_SANDBOX_SDK_STRICT") == "1"


def _need(*names: str) -> None:
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        why = f"{', '.join(missing)} not set"
        if STRICT:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def client() -> Iterator[Client]:
    _need("AGENT_SANDBOX_URL", "AGENT_SANDBOX_API_KEY")
    with Client() as c:
        yield c


@pytest.fixture(scope="module")
def sbx(client: Client) -> Iterator[Sandbox]:
    """One sandbox shared by a module's tests (destroyed after them)."""
    with Sandbox.create(client=client, env={"SDK_TEST": "1"}) as s:
        yield s


@pytest.fixture(scope="session")
def limited() -> Tuple[str, str]:
    _need("AGENT_SANDBOX_LIMITED_URL", "AGENT_SANDBOX_LIMITED_KEY")
    return os.environ["AGENT_SANDBOX_LIMITED_URL"], os.environ["AGENT_SANDBOX_LIMITED_KEY"]


@pytest.fixture(scope="session")
def offnet() -> Tuple[str, str]:
    _need("AGENT_SANDBOX_OFFNET_URL", "AGENT_SANDBOX_OFFNET_KEY")
    return os.environ["AGENT_SANDBOX_OFFNET_URL"], os.environ["AGENT_SANDBOX_OFFNET_KEY"]


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` until it holds (a wait on a condition, not a sleep)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def session_ids(client: Client) -> set:
    return {s.id for s in client.list()}


def gone(client: Client, sid: str) -> bool:
    return sid not in session_ids(client)
