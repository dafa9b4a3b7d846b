# NixOS VM test: the module starts the daemon; a session is created over
# REST with curl, a command runs in a real guest VM (our kernel, our rootfs),
# then the same through stdio MCP with the official Python SDK; stopping the
# unit leaves no VMM behind.
#
# backend "qemu" runs guests under TCG inside the test VM, so it works on any
# host that can run NixOS tests (KVM for the test VM itself). backend
# "firecracker" needs nested KVM: the test VM loads kvm-intel or kvm-amd
# (by CPU flag) before the daemon starts and the test checks /dev/kvm.
{ pkgs, backend ? "qemu" }:
let
  inherit (pkgs) lib;
  cli = import ./cli.nix;
  firecracker = backend == "firecracker";
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
      # The test VM's vlan interface (static address from the test driver):
      # named, so the daemon does not wait for a default route (there may
      # be none: no DHCP in the test network).
      network.uplink_if = "eth1";
      templates = [ "base" ];
      # The small image; the default (dev) is not built for this test.
      settings.default_template = "base";
      maxSessions = 4;
      defaultMemMib = 512;
      # agent-sandbox-mcp (stdio) forwards to /mcp.
      mcpHttp.enable = true;
    };
    environment.systemPackages = [ mcpCheck pkgs.curl pkgs.jq pkgs.procps ];
    # Firecracker needs /dev/kvm (nested KVM). The unit may not load modules
    # (ProtectKernelModules): load the one this CPU has before it starts, and
    # fail it with a clear message if /dev/kvm is still missing.
    systemd.services.agent-sandbox-kvm = lib.mkIf firecracker {
      description = "load KVM for the Firecracker backend";
      before = [ "agent-sandbox.service" ];
      requiredBy = [ "agent-sandbox.service" ];
      serviceConfig = { Type = "oneshot"; RemainAfterExit = true; };
      path = [ pkgs.kmod pkgs.gnugrep ];
      script = ''
        if grep -qw vmx /proc/cpuinfo; then
          modprobe kvm-intel
        elif grep -qw svm /proc/cpuinfo; then
          modprobe kvm-amd
        fi
        [ -c /dev/kvm ] || { echo "no /dev/kvm in the test VM: Firecracker needs nested KVM (kvm_intel nested=1 / kvm_amd nested=1 on the host)" >&2; exit 1; }
      '';
    };
    systemd.services.agent-sandbox.preStart = ''
      [ -s /var/lib/agent-sandbox/test-key ] ||
        ${createKey config.services.agent-sandbox.package} > /var/lib/agent-sandbox/test-key
    '';
  };

  testScript = ''
    import json

  '' + lib.optionalString firecracker ''
    with subtest("KVM for Firecracker"):
        machine.wait_for_unit("agent-sandbox-kvm.service")
        machine.succeed("test -c /dev/kvm")
        machine.succeed("lsmod | grep -Eq '^kvm_(intel|amd) '")

  '' + ''
    machine.wait_for_unit("agent-sandbox.service")
    machine.wait_for_open_port(3000)
    # Ready once every template's snapshot exists (made on first start).
    machine.wait_until_succeeds("curl -sf http://127.0.0.1:3000/ready", timeout=600)

    with subtest("the unit is hardened"):
        props = machine.succeed(
            "systemctl show agent-sandbox -p NoNewPrivileges -p ProtectSystem -p DevicePolicy"
            " -p KillMode -p Delegate -p After -p Wants"
        )
        assert "NoNewPrivileges=yes" in props, props
        assert "ProtectSystem=strict" in props, props
        assert "DevicePolicy=closed" in props, props
        assert "KillMode=mixed" in props, props
        assert "Delegate=yes" in props, props
        assert "network-online.target" in props, props

    with subtest("the daemon is in its own cgroup: <unit>/daemon"):
        pid = machine.succeed("systemctl show -p MainPID --value agent-sandbox").strip()
        cg = machine.succeed(f"cat /proc/{pid}/cgroup").strip()
        assert cg.endswith("/agent-sandbox.service/daemon"), cg

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

    with subtest("a VMM runs below the unit: <unit>/vms/<id>"):
        body = json.dumps({"template": "base", "command": "sleep", "args": ["30"]})
        machine.execute(
            f"curl -s {auth} -H 'Content-Type: application/json' "
            f"-X POST http://127.0.0.1:3000${execPath} -d '{body}' >/dev/null 2>&1 &"
        )
        vmm = "firecracker" if "${backend}" == "firecracker" else "qemu-system-x86"
        machine.wait_until_succeeds(f"pgrep -x {vmm}", timeout=120)
        vpid = machine.succeed(f"pgrep -x {vmm} | head -n1").strip()
        vcg = machine.succeed(f"cat /proc/{vpid}/cgroup").strip()
        assert "/agent-sandbox.service/vms/" in vcg, vcg

    with subtest("stopping the unit leaves no VMM"):
        machine.succeed("systemctl stop agent-sandbox")
        machine.fail("pgrep -x firecracker")
        # (comm is cut to 15 characters)
        machine.fail("pgrep -x qemu-system-x86")
  '';
}
