from agent_sandbox import Sandbox  # reads AGENT_SANDBOX_URL and AGENT_SANDBOX_API_KEY

with Sandbox.create() as sbx:  # a fresh microVM, destroyed when the block ends
    result = sbx.commands.run("echo hello from $(uname -s)")
    print(result.stdout, end="")  # hello from Linux
    sbx.files.write("notes/todo.txt", "ship it\n")
    print(sbx.files.read("notes/todo.txt"), end="")  # ship it
    for event in sbx.commands.stream("for i in 1 2 3; do echo $i; sleep 0.1; done"):
        print(event)  # Started, Output(...) x3, Exited(result)
    print("exit code", sbx.commands.run("exit 3").exit_code)  # exit code 3
