# NixOS VM test: the module starts the daemon; a session is created over
# REST with curl, a command runs in a real guest VM (our kernel, our rootfs),
# then the same through stdio MCP with the official Python SDK; stopping the
# unit leaves no VMM behind.
#
# backend "qemu" runs guests under TCG inside the test VM, so it works on any
# host that can run NixOS tests (KVM for the test VM itself). backend
# "firecracker" needs nested KVM: the test VM must see /dev/kvm.
{ pkgs, backend ? "qemu" }:
let
  cli = import ./cli.nix;
  # ---- API shapes this test relies on (adjust here if the daemon changes) --
  # Makes an exec-scoped key and prints it on stdout. Run in the unit's
  # preStart, so the key exists before the daemon reads its key file.
  createKey = package: pkgs.lib.escapeShellArgs (cli.keysCreate {
    inherit package;
    configFile = "/etc/agent-sandbox/config.json";
    name = "nixos-test";
    scopes = [ "exec" ];
  });
  # Seed-compatible REST: POST /exec/:session/execute creates the session.
  execPath = "/exec/nixos-test/execute";
  deletePath = "/exec/nixos-test";

  mcpCheck = pkgs.writeShellScriptBin "mcp-check" ''
    exec ${pkgs.python3.withPackages (ps: [ ps.mcp ])}/bin/python3 ${./test-mcp.py} "$@"
  '';
in
pkgs.testers.runNixOSTest {
  name = "agent-sandbox-${backend}";

  nodes.machine = { config, ... }: {
    imports = [ ./. ];
    virtualisation = {
      memorySize = 3072;
      cores = 2;
    };
    services.agent-sandbox = {
      enable = true;
      inherit backend;
      templates = [ "base" ];
      # The small image; the default (dev) is not built for this test.
      settings.default_template = "base";
      maxSessions = 4;
      defaultMemMib = 512;
      # agent-sandbox-mcp (stdio) forwards to /mcp.
      mcpHttp.enable = true;
    };
    environment.systemPackages = [ mcpCheck pkgs.curl pkgs.jq pkgs.procps ];
    systemd.services.agent-sandbox.preStart = ''
      [ -s /var/lib/agent-sandbox/test-key ] ||
        ${createKey config.services.agent-sandbox.package} > /var/lib/agent-sandbox/test-key
    '';
  };

  testScript = ''
    import json

    machine.wait_for_unit("agent-sandbox.service")
    machine.wait_for_open_port(3000)
    # Ready once every template's snapshot exists (made on first start).
    machine.wait_until_succeeds("curl -sf http://127.0.0.1:3000/ready", timeout=600)

    with subtest("the unit is hardened"):
        props = machine.succeed(
            "systemctl show agent-sandbox -p NoNewPrivileges -p ProtectSystem -p DevicePolicy"
        )
        assert "NoNewPrivileges=yes" in props, props
        assert "ProtectSystem=strict" in props, props
        assert "DevicePolicy=closed" in props, props

    key = machine.succeed("cat /var/lib/agent-sandbox/test-key").strip()
    assert key, "no key was made"
    auth = f"-H 'Authorization: Bearer {key}'"

    with subtest("REST: create a session and run a command"):
        machine.fail("curl -sf -X POST http://127.0.0.1:3000${execPath} -d '{}'")
        body = json.dumps({
            "template": "base",
            "command": "sh",
            "args": ["-c", "echo hello-from-rest; uname -r"],
        })
        out = machine.succeed(
            f"curl -sf {auth} -H 'Content-Type: application/json' "
            f"-X POST http://127.0.0.1:3000${execPath} -d '{body}'"
        )
        r = json.loads(out)
        assert r["exitCode"] == 0, r
        stdout = "".join(o["data"] for o in r["output"] if o["stream"] == "stdout")
        assert "hello-from-rest" in stdout, r
        assert "agent-sandbox" in stdout, f"guest kernel is not ours: {stdout}"
        machine.succeed(f"curl -sf {auth} -X DELETE http://127.0.0.1:3000${deletePath}")

    with subtest("stdio MCP: the command on PATH, driven by the official SDK"):
        machine.succeed("command -v agent-sandbox-mcp")
        machine.succeed(f"AGENT_SANDBOX_API_KEY={key} mcp-check agent-sandbox-mcp >&2")

    with subtest("stopping the unit leaves no VMM"):
        machine.succeed("systemctl stop agent-sandbox")
        machine.fail("pgrep -x firecracker")
        # (comm is cut to 15 characters)
        machine.fail("pgrep -x qemu-system-x86")
  '';
}
