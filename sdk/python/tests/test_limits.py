"""Against the second daemon (`--rate-limit 2 --rate-burst 2 --max-sessions
1`): 429 `rate_limited` with `Retry-After`, mapped and retried; 503
`at_capacity` mapped (and creation never retried)."""

from __future__ import annotations

import time
from typing import Tuple

import pytest

from agent_sandbox import Client, Retry, Sandbox, errors


def test_rate_limited_is_mapped_then_absorbed_by_retries(limited: Tuple[str, str]) -> None:
    url, key = limited
    with Client(url, key, retry=Retry(attempts=1)) as eager:
        with pytest.raises(errors.RateLimited) as e:
            for _ in range(20):  # a burst of 2: the third call at once is over
                eager.list()
    assert e.value.status == 429 and e.value.code == "rate_limited"
    assert e.value.retry_after is not None and e.value.retry_after >= 1
    with Client(url, key, retry=Retry(attempts=6, max_backoff=2)) as patient:
        for _ in range(6):
            assert isinstance(patient.list(), list)


def _create_past_the_rate_limit(c: Client) -> Sandbox:
    end = time.monotonic() + 30
    while True:
        try:
            return Sandbox.create(client=c)
        except errors.RateLimited as e:  # creation is not retried by the SDK
            if time.monotonic() > end:
                raise
            time.sleep(e.retry_after or 1)


def test_at_capacity(limited: Tuple[str, str]) -> None:
    url, key = limited
    with Client(url, key) as c:
        with _create_past_the_rate_limit(c) as first:
            with pytest.raises(errors.AtCapacity) as e:
                _create_past_the_rate_limit(c)
            assert e.value.status == 503 and e.value.retry_after is not None
            assert first.info().state == "ready"  # a GET: retried past the rate limit
