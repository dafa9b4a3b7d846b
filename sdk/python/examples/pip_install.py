"""Install a package with pip inside a sandbox and use it.

Offline (the default, what the tests run): a small wheel built here is
uploaded and installed from the file. `--index NAME` installs NAME from
PyPI instead, which needs a daemon whose sessions have network.
"""

import argparse
import base64
import hashlib
import io
import zipfile

from agent_sandbox import Sandbox


def tiny_wheel() -> bytes:
    """A pure-Python wheel of a package `greeting` (version 1.0)."""
    files = {
        "greeting/__init__.py": "def hello(name):\n    return f'hello, {name}!'\n",
        "greeting-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: greeting\nVersion: 1.0\n",
        "greeting-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: example\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files["greeting-1.0.dist-info/RECORD"] = "\n".join(record + ["greeting-1.0.dist-info/RECORD,,"]) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", metavar="PACKAGE", help="install PACKAGE from PyPI (needs network)")
    args = ap.parse_args()
    with Sandbox.create("dev") as sbx:
        # The dev image's pip installs system-wide (`pip install` just works there).
        if args.index:
            r = sbx.commands.run(["pip", "install", args.index], timeout=600, on_stdout=print)
            use = f"import importlib.metadata as m; print('{args.index}', m.version('{args.index}'))"
        else:
            sbx.files.write("/tmp/greeting-1.0-py3-none-any.whl", tiny_wheel())
            r = sbx.commands.run("pip install --no-index /tmp/greeting-1.0-py3-none-any.whl", timeout=600)
            use = "import greeting; print(greeting.hello('sandbox'))"
        print("pip:", r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr.strip())
        if r.exit_code != 0:
            raise SystemExit(f"pip failed ({r.exit_code}): {r.stderr}")
        print(sbx.commands.run(["python3", "-c", use]).stdout, end="")


if __name__ == "__main__":
    main()
