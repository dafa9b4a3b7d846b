"""Overhead of the SDK: p50 of exec `true` through `commands.run` vs a raw
httpx POST of the same body, in the same process, on the same session,
50 runs each (interleaved, each first in turn, after a warm-up).

    python benches/overhead.py [--runs 50]
"""

import argparse
import statistics
import time
from typing import Callable, List

import httpx

from agent_sandbox import Client, Config, Sandbox, SessionInfo


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    n = ap.parse_args().runs
    with Client() as client, Sandbox.create(client=client) as sbx:
        raw = httpx.Client(base_url=client.config.url, headers=client.config.headers())
        url = f"/v1/sessions/{sbx.id}/exec"

        def via_raw() -> None:
            r = raw.post(url, json={"command": "true"})
            r.raise_for_status()
            assert r.json()["exitCode"] == 0

        def via_sdk() -> None:
            assert sbx.commands.run("true").exit_code == 0

        for _ in range(5):
            via_raw()
            via_sdk()
        sdk: List[float] = []
        http: List[float] = []
        for i in range(n):  # alternate which goes first: no order bias
            if i % 2:
                sdk.append(timed(via_sdk))
                http.append(timed(via_raw))
            else:
                http.append(timed(via_raw))
                sdk.append(timed(via_sdk))
        raw.close()

    def line(name: str, xs: List[float]) -> str:
        q = statistics.quantiles(xs, n=10)
        return f"{name:>9}: p50 {statistics.median(xs):7.2f} ms  p90 {q[-1]:7.2f} ms  min {min(xs):7.2f} ms"

    print(f"exec `true`, {n} runs each, same session {sbx.id}")
    print(line("SDK", sdk))
    print(line("raw httpx", http))
    print(f" overhead: p50 {statistics.median(sdk) - statistics.median(http):+.2f} ms")
    offline(n * 20)


def offline(n: int) -> None:
    """The SDK's own cost with the daemon out of the picture: both sides
    answered at once by an httpx MockTransport."""
    answer = {
        "exitCode": 0,
        "durationMs": 1,
        "timedOut": False,
        "signal": None,
        "resourceUsage": {"memoryMb": 0.3, "cpuPercent": 1.0, "source": "cgroup"},
        "output": [],
    }
    mock = httpx.MockTransport(lambda r: httpx.Response(200, json=answer))
    cfg = Config("http://mock.test", "k")
    client = Client(config=cfg, http_client=httpx.Client(base_url=cfg.url, headers=cfg.headers(), transport=mock))
    raw = httpx.Client(base_url=cfg.url, headers=cfg.headers(), transport=mock)
    sbx = Sandbox(SessionInfo(id="s", state="ready"), client)
    sdk = [timed(lambda: sbx.commands.run("true")) for _ in range(n)]
    http = [timed(lambda: raw.post("/v1/sessions/s/exec", json={"command": "true"}).json()) for _ in range(n)]
    d = (statistics.median(sdk) - statistics.median(http)) * 1000
    print(
        f"client-side only ({n} runs, MockTransport): SDK p50 {statistics.median(sdk) * 1000:.0f} us, "
        f"raw httpx p50 {statistics.median(http) * 1000:.0f} us, overhead {d:+.0f} us"
    )


if __name__ == "__main__":
    main()
