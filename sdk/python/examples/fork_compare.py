"""Fork a session and compare the copies.

A session builds some state (a file, a Python interpreter in the background
holding a value in memory); `fork(2)` makes two copies of all of it; each
copy then goes its own way, and the source is untouched.
"""

from agent_sandbox import Sandbox


def main() -> None:
    with Sandbox.create("base") as src:
        src.commands.run("seq 1 5 > /workspace/numbers")
        src.commands.start("sleep 600", tag="kept-by-every-copy")
        copies, failed = src.fork(2)
        assert not failed, failed
        try:
            a, b = copies
            a.commands.run("seq 6 10 >> /workspace/numbers")
            b.commands.run("sort -rn /workspace/numbers -o /workspace/numbers")
            for name, sbx in (("source", src), ("copy a", a), ("copy b", b)):
                nums = sbx.files.read("numbers").split()
                tags = [p.tag for p in sbx.commands.list() if p.running and p.tag]
                print(f"{name:>7} {sbx.id}: numbers {' '.join(nums)}; running {tags}")
        finally:
            for c in copies:
                c.kill()
                c.close()


if __name__ == "__main__":
    main()
