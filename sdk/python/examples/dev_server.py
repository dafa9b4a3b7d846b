"""A dev server in the background, its output followed.

Starts `python3 -m http.server` as a background process, sends it a few
requests from inside the sandbox, and follows the server's log (its
stderr) as it comes, until it has logged them all.
"""

from agent_sandbox import Output, Sandbox


def main() -> None:
    with Sandbox.create("dev") as sbx:
        sbx.files.write("site/index.html", "<h1>hello</h1>\n")
        server = sbx.commands.start("python3 -u -m http.server 8000 --directory site", tag="dev-server")
        print("started", server)
        # Wait until it answers (curl retries the connection), then use it.
        page = sbx.commands.run("curl -s --retry 30 --retry-connrefused --retry-delay 1 localhost:8000/", timeout=60)
        print("page:", page.stdout.strip())
        sbx.commands.run("curl -s localhost:8000/missing >/dev/null; curl -s localhost:8000/ >/dev/null")
        requests = 0
        for ev in server.attach():  # what it logged so far, then live
            if isinstance(ev, Output):
                for line in ev.data.splitlines():
                    print(f"[server {ev.stream}] {line}")
                    requests += '"GET ' in line
            if requests >= 3:
                break
        server.kill()
        print("server ended:", server.wait().signal)


if __name__ == "__main__":
    main()
