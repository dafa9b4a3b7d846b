"""Files: text/bytes, modes, listings, mkdir/rename/remove, streamed
transfers (a 64 MiB binary round trip byte-exact), file errors."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from agent_sandbox import Sandbox, errors

MIB = 1 << 20


def test_write_read_text_and_bytes(sbx: Sandbox) -> None:
    assert sbx.files.write("t/hello.txt", "héllo\n") == len("héllo\n".encode())
    assert sbx.files.read("t/hello.txt") == "héllo\n"
    blob = bytes(range(256))
    sbx.files.write("/tmp/blob", blob)
    assert sbx.files.read_bytes("/tmp/blob") == blob
    assert sbx.commands.run("cat /workspace/t/hello.txt").stdout == "héllo\n"


def test_mode_stat_list(sbx: Sandbox) -> None:
    sbx.files.write("m/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    st = sbx.files.stat("m/run.sh")
    assert st.type == "file" and st.size == 19 and st.mode & 0o777 == 0o755
    assert st.path.endswith("/m/run.sh") and st.mtime > 0
    assert sbx.commands.run("./m/run.sh").stdout == "ran\n"
    sbx.files.mkdir("m/deep/er")
    assert sbx.files.stat("m/deep/er").type == "directory"
    top = {e.name: e for e in sbx.files.list("m")}
    assert set(top) == {"run.sh", "deep"} and top["deep"].type == "directory"
    assert top["run.sh"].size == 19
    everything = {e.path for e in sbx.files.list("m", recursive=True)}
    assert {"run.sh", "deep", "deep/er"} <= everything


def test_rename_remove_exists(sbx: Sandbox) -> None:
    sbx.files.write("r/a.txt", "a")
    sbx.files.write("r/b.txt", "b")
    with pytest.raises(errors.AlreadyExists):
        sbx.files.rename("r/a.txt", "r/b.txt", overwrite=False)
    sbx.files.rename("r/a.txt", "r/c.txt")
    assert not sbx.files.exists("r/a.txt") and sbx.files.read("r/c.txt") == "a"
    with pytest.raises(errors.DirectoryNotEmpty):
        sbx.files.remove("r")
    sbx.files.remove("r/b.txt")
    sbx.files.remove("r", recursive=True)
    assert not sbx.files.exists("r")
    sbx.files.write("nd/file", "x")
    with pytest.raises(errors.NotADirectory):
        sbx.files.mkdir("nd/file/x")  # a file as a parent
    with pytest.raises(errors.NotADirectory):
        sbx.files.list("nd/file")


def test_64_mib_round_trip_byte_exact(sbx: Sandbox, tmp_path: Path) -> None:
    data = os.urandom(64 * MIB)
    src, dst = tmp_path / "up.bin", tmp_path / "down.bin"
    src.write_bytes(data)
    assert sbx.files.upload("/tmp/big.bin", src) == len(data)
    want = hashlib.sha256(data).hexdigest()
    assert sbx.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == want
    assert sbx.files.download("/tmp/big.bin", dst) == len(data)
    assert dst.read_bytes() == data
    # File objects work too (uploaded from where they stand, streamed back).
    f = io.BytesIO(b"skip" + data[: 3 * MIB])
    f.seek(4)
    assert sbx.files.upload("/tmp/part.bin", f) == 3 * MIB
    out = io.BytesIO()
    sbx.files.download("/tmp/part.bin", out)
    assert out.getvalue() == data[: 3 * MIB]
    sbx.files.remove("/tmp/big.bin")


def test_file_errors(sbx: Sandbox) -> None:
    with pytest.raises(errors.FileNotFound) as e:
        sbx.files.read("no/such/file")
    assert e.value.status == 404 and "no/such/file" in e.value.message
    with pytest.raises(errors.InvalidPath):
        sbx.files.read("bad\0path")
    with pytest.raises(errors.InvalidPath):
        sbx.files.stat("")
    with pytest.raises(errors.IsADirectory):
        sbx.files.read_bytes("/tmp")
    with pytest.raises(errors.InvalidArgument):
        sbx.files.read("n" * 300)  # a name over 255 bytes


def test_over_limit_bodies(sbx: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(errors.BodyTooLarge) as e:
        sbx.commands.run("cat", stdin="x" * (2 * MIB))  # JSON body over --max-body
    assert e.value.status == 413
    with pytest.raises(errors.BodyTooLarge):
        sbx.files.write("/tmp/over", b"\0" * (64 * MIB + 1))  # over --max-file
    over = tmp_path / "over.bin"
    with open(over, "wb") as f:
        f.truncate(64 * MIB + 1)
    with pytest.raises(errors.BodyTooLarge):
        sbx.files.upload("/tmp/over", over)  # streamed: refused from its Content-Length
    assert not sbx.files.exists("/tmp/over")
