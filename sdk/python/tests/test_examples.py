"""The examples run (those that work offline) and print what they promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _env(client: Any) -> None:
    """Needs the daemon (the `client` fixture skips or fails without it)."""


def run_example(name: str, *args: str) -> str:
    p = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert p.returncode == 0, f"{name} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_quickstart() -> None:
    out = run_example("quickstart.py")
    assert "hello from Linux" in out and "ship it" in out and "exit code 3" in out


def test_data_script() -> None:
    out = run_example("data_script.py")
    assert "1000 rows, 3 regions" in out
    assert sum(int(line.split(":")[1].split()[0]) for line in out.splitlines()[1:]) == 1000


def test_pip_install_offline() -> None:
    out = run_example("pip_install.py")
    assert "Successfully installed greeting-1.0" in out and "hello, sandbox!" in out


def test_dev_server_followed() -> None:
    out = run_example("dev_server.py")
    assert "page: <h1>hello</h1>" in out
    assert out.count('"GET ') >= 3 and "server ended: SIGKILL" in out


def test_fork_compare() -> None:
    lines = run_example("fork_compare.py").splitlines()
    assert "numbers 1 2 3 4 5;" in lines[0]
    assert "numbers 1 2 3 4 5 6 7 8 9 10;" in lines[1]
    assert "numbers 5 4 3 2 1;" in lines[2]
    assert all("kept-by-every-copy" in line for line in lines)
