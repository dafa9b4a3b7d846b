# NixOS module: services.agent-sandbox, the agent-sandbox host daemon.
# Usable from the flake (nixosModules.default, which also defaults the
# package options to the flake's own packages, built with the nixpkgs of
# its flake.lock) or by importing this directory from a checkout (then
# every package is built with the system's own `pkgs`).
{ config, lib, pkgs, ... }:
let
  cfg = config.services.agent-sandbox;
  cli = import ./cli.nix;
  built = import ./packages { inherit pkgs; };
  json = pkgs.formats.json { };

  stateDir = "/var/lib/agent-sandbox";
  # systemd puts LoadCredential= files here (read-only, owned by the unit).
  keysCredential = "/run/credentials/agent-sandbox.service/keys";

  hostPort = addr: if lib.hasInfix ":" addr then "[${addr}]:${toString cfg.port}" else "${addr}:${toString cfg.port}";
  listen = hostPort cfg.listenAddress;
  # Where local clients reach the daemon (a wildcard address is not one).
  url = "http://" + hostPort ({ "0.0.0.0" = "127.0.0.1"; "::" = "::1"; }.${cfg.listenAddress} or cfg.listenAddress);

  # Checked when the system is built: a key or value the daemon refuses
  # fails the build, not the unit's start.
  uncheckedConfig = json.generate "agent-sandbox-unchecked.json" cfg.settings;
  configFile = pkgs.runCommand "agent-sandbox.json" { } ''
    ${lib.escapeShellArgs (cli.check { package = cfg.package; configFile = uncheckedConfig; })} >/dev/null
    cp ${uncheckedConfig} $out
  '';

  # mkDefault on every leaf of a JSON value (an empty set is a leaf).
  mkDefaultLeaves = v: if builtins.isAttrs v && v != { } then builtins.mapAttrs (_: mkDefaultLeaves) v else lib.mkDefault v;

  # `agent-sandbox-mcp` for agent configs: stdio MCP forwarding to this
  # host's daemon. The key comes from the calling user's environment
  # (AGENT_SANDBOX_API_KEY or AGENT_SANDBOX_KEY_FILE), never from the system.
  mcpCommand = pkgs.writeShellScriptBin "agent-sandbox-mcp" ''
    exec ${lib.escapeShellArgs (cli.mcp { package = cfg.package; inherit url; })} "$@"
  '';
in
{
  # services.agent-sandbox.router: HAProxy in front of several hosts.
  imports = [ ./router.nix ];

  options.services.agent-sandbox = with lib; {
    enable = mkEnableOption "the agent-sandbox host daemon (a disposable microVM per AI-agent session)";

    package = mkOption {
      type = types.package;
      default = built.agent-sandbox;
      defaultText = literalMD "the `agent-sandbox` package built from this repository (with the flake's nixpkgs through `nixosModules.default`, else with the system's `pkgs`)";
      description = "The daemon package.";
    };

    hostId = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "h1";
      description = ''
        This host's id behind a router ({option}`services.agent-sandbox.router`
        on the router's machine; docs/operations.md, "Several hosts"): the
        ids this daemon makes carry it, so their requests come back here.
        1-16 lower-case letters and digits, a letter first; the router's
        `hosts` entry for this machine has the same `id`.
      '';
    };

    listenAddress = mkOption {
      type = types.str;
      default = "127.0.0.1";
      example = "0.0.0.0";
      description = "Address the REST API (and MCP over HTTP, if enabled) listens on.";
    };

    port = mkOption {
      type = types.port;
      default = 3000;
      description = "TCP port of the REST API.";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open {option}`port` in the firewall.";
    };

    keysFile = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/run/secrets/agent-sandbox-keys.json";
      description = ''
        API key file, handed to the daemon as the systemd credential `keys`
        (LoadCredential=), so it may stay readable by root only. Give a path
        as a string: a Nix path literal would copy the keys into the
        world-readable store. With `null` the daemon keeps its keys in
        ${stateDir}/keys.json and makes one admin key on first start.
        Keys from this option are read-only to the daemon.
      '';
    };

    backend = mkOption {
      type = types.enum [ "firecracker" "qemu" ];
      default = "firecracker";
      description = "VM backend: Firecracker with its jailer (needs KVM), or QEMU (KVM when present, TCG otherwise).";
    };

    kernel = mkOption {
      type = types.package;
      default = built.kernel;
      defaultText = literalMD "the guest kernel built from `images/kernel/` (flake's nixpkgs through `nixosModules.default`, else the system's `pkgs`)";
      description = "Guest kernel package; its `vmlinux` is booted.";
    };

    firecrackerPackage = mkOption {
      type = types.package;
      default = built.firecracker;
      defaultText = literalMD "`pkgsStatic.firecracker` (with the nixpkgs PR #460374 fix where missing) of the flake's nixpkgs through `nixosModules.default`, else of the system's `pkgs`";
      description = "Package with the `firecracker` and `jailer` binaries (static: the jailer copies firecracker into an empty chroot).";
    };

    qemuPackage = mkOption {
      type = types.package;
      default = built.qemu;
      defaultText = literalMD "`qemu_kvm` of the flake's nixpkgs through `nixosModules.default`, else of the system's `pkgs`";
      description = "QEMU for the qemu backend.";
    };

    images = mkOption {
      type = types.attrsOf types.package;
      default = built.rootfs;
      defaultText = literalMD "one root filesystem per file in `images/templates/` (flake's nixpkgs through `nixosModules.default`, else the system's `pkgs`)";
      description = "Root filesystem image per template name (each with `rootfs.erofs`).";
    };

    templates = mkOption {
      type = types.listOf types.str;
      default = attrNames cfg.images;
      defaultText = literalMD "every template in {option}`images`";
      example = [ "dev" "base" ];
      description = "Templates this host offers; the daemon snapshots each on first start.";
    };

    defaultVcpus = mkOption {
      type = types.ints.between 1 32;
      default = 1;
      description = "vCPUs of a session that asks for none; at most `settings.max_vcpus` (default 8).";
    };

    defaultMemMib = mkOption {
      type = types.ints.between 128 65536;
      default = 512;
      description = "Guest RAM (MiB) of a session that asks for none; at most `settings.max_mem_mib` (default 8192).";
    };

    vmIds = {
      first = mkOption {
        type = types.ints.between 1000 4294967293;
        default = 2000000000;
        description = ''
          First of the uids/gids VMs run as (the snapshot builder's); each
          session's VMM runs as one of the next `count - 1`, its own for the
          session's life. Must not overlap any user, group or subordinate id
          range on the host.
        '';
      };
      count = mkOption {
        type = types.ints.between 2 16777216;
        default = 65536;
        description = "How many ids the range holds (more than maxSessions: the snapshot builder and standby VMMs take ids too).";
      };
    };

    maxSessions = mkOption {
      type = types.ints.positive;
      default = 16;
      description = "Concurrent sessions; more are refused with 503.";
    };

    idleTimeout = mkOption {
      type = types.ints.positive;
      default = 1800;
      description = "Seconds without a request after which a session is destroyed.";
    };

    egress = {
      mode = mkOption {
        type = types.enum [ "internet" "none" "allowlist" "denylist" ];
        default = "internet";
        description = ''
          Default egress policy of a new session. The host, link-local, the
          metadata address and private ranges are blocked in every mode.
        '';
      };
      rules = mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "203.0.113.0/24:443/tcp" ];
        description = "CIDR[:port[/proto]] rules for the allowlist/denylist modes.";
      };
      domains = mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "*.pypi.org" "github.com" ];
        description = "Domain allowlist enforced by the per-session DNS forwarder.";
      };
    };

    network = mkOption {
      type = types.nullOr json.type;
      default = { };
      example = { uplink_if = "eth0"; dns_upstreams = [ "9.9.9.9:53" ]; };
      description = ''
        The daemon's `network` section: per-session network namespaces,
        TAP devices, NAT and the egress policy (keys: docs/operations.md,
        `uplink_if` (default: the default route's interface), `veth_range`,
        `guest_cidr`, `dns_upstreams` (default: the host's resolvers), ...).
        The default `{ }` takes every key's default; the daemon then waits
        for a default route at start (the unit is ordered after
        network-online.target). `null`: sessions get no network and
        {option}`egress` has nothing to act on.
      '';
    };

    mcpHttp.enable = mkOption {
      type = types.bool;
      default = true;
      description = "Serve MCP over Streamable HTTP at `/mcp` on the REST port (same keys). `agent-sandbox-mcp` forwards to it.";
    };

    extraEnvironment = mkOption {
      type = types.attrsOf types.str;
      default = { };
      example = { RUST_LOG = "agent_sandbox=debug"; };
      description = "Extra environment of the daemon.";
    };

    settings = mkOption {
      type = json.type;
      default = { };
      example = { max_vcpus = 4; network.dns_upstreams = [ "9.9.9.9:53" ]; };
      description = ''
        The daemon's JSON config. The options above fill it with mkDefault
        on every leaf (recursively), so a key set here overrides only
        itself: `settings.egress.domains = [ ... ]` keeps the `mode` and
        `rules` the egress options gave. Lists are replaced, not appended.
        Replacing a whole section the options fill with something that is
        not an attribute set (`settings.network = null`) conflicts with
        those leaves: use `lib.mkForce` (or the option, here
        {option}`network`).
      '';
    };
  };

  config = lib.mkIf cfg.enable {
    assertions = [
      {
        # The guest kernel config (PVH, x86 devices) and the qemu-system-x86_64
        # the config names are x86 only.
        assertion = pkgs.stdenv.hostPlatform.isx86_64;
        message = "services.agent-sandbox: x86_64 hosts only (this system is ${pkgs.stdenv.hostPlatform.system}): the guest kernel config (PVH, x86 devices), the images built on it and qemu-system-x86_64 are x86-specific";
      }
    ]
    ++ map
      (t: {
        assertion = cfg.images ? ${t};
        message = "services.agent-sandbox.templates: no image for template \"${t}\" (have: ${lib.concatStringsSep ", " (lib.attrNames cfg.images)})";
      })
      cfg.templates
    ++ [
      (
        # A session naming no template gets the default: it must be offered.
        let
          d = cfg.settings.default_template or "default";
          name = if d == "default" then "dev" else d;
        in
        {
          assertion = builtins.elem name cfg.templates;
          message = "services.agent-sandbox.templates: the default template \"${name}\" (settings.default_template; \"default\" is dev) is not among them: add it, or set settings.default_template";
        }
      )
    ];

    # mkDefault on every leaf, not on the top-level keys: an attrsOf type
    # (json) merges definitions key by key and applies priorities per key, so
    # a top-level mkDefault { mode, rules, domains } would lose to a user's
    # { mode } and drop rules and domains. An empty set is a leaf too, so
    # `settings.network = null` can override the default `{ }`.
    services.agent-sandbox.settings = mkDefaultLeaves ((cli.artifacts {
      firecracker = cfg.firecrackerPackage;
      inherit (cfg) kernel;
      rootfs = lib.getAttrs cfg.templates cfg.images;
      qemu = cfg.qemuPackage;
      inherit (built) templatesDir;
    }) // cli.settings {
      inherit listen stateDir;
      inherit (cfg) backend maxSessions idleTimeout defaultVcpus defaultMemMib egress network vmIds hostId;
      keysFile = if cfg.keysFile != null then keysCredential else "${stateDir}/keys.json";
      mcpHttp = cfg.mcpHttp.enable;
    });

    environment.systemPackages = [ cfg.package mcpCommand ];
    # The same file the unit runs with, at a stable path for admin commands
    # (`agent-sandbox keys --config /etc/agent-sandbox/config.json create`).
    environment.etc."agent-sandbox/config.json".source = configFile;

    networking.firewall.allowedTCPPorts = lib.mkIf cfg.openFirewall [ cfg.port ];

    # Loaded at boot: the unit itself may not load modules
    # (ProtectKernelModules). TAP devices, nftables, and vsock for QEMU.
    boot.kernelModules = [ "tun" "nf_tables" "vhost_vsock" ];

    # Named network namespaces live here; the unit gets it read-write.
    systemd.tmpfiles.rules = [ "d /run/netns 0755 root root -" ];

    systemd.services.agent-sandbox = {
      description = "agent-sandbox: disposable microVMs for AI-agent sessions";
      wantedBy = [ "multi-user.target" ];
      # The uplink is the default route's interface unless network.uplink_if
      # names one: start once the network is up (network.target does not
      # wait for DHCP). The daemon waits for a default route itself too,
      # logging every 30 s.
      wants = [ "network-online.target" ];
      after = [ "network-online.target" ];
      environment = cfg.extraEnvironment;
      # For network setup steps the daemon may run as commands rather than
      # over netlink.
      path = [ pkgs.iproute2 pkgs.nftables ];
      serviceConfig = {
        ExecStart = lib.escapeShellArgs (cli.serve { package = cfg.package; inherit configFile; });
        Restart = "on-failure";
        RestartSec = 2;
        # SIGTERM to the daemon alone (it destroys every session, namespaces
        # and links included, then exits 0), then SIGKILL to whatever is left
        # in the unit's cgroup: every VMM is in it (cgroup_placement own), so
        # a hung daemon leaves no VMM behind; the next start sweeps the rest.
        KillMode = "mixed";
        KillSignal = "SIGTERM";
        TimeoutStopSec = 60;
        LoadCredential = lib.optional (cfg.keysFile != null) "keys:${cfg.keysFile}";

        StateDirectory = "agent-sandbox";
        StateDirectoryMode = "0700";
        RuntimeDirectory = "agent-sandbox";
        RuntimeDirectoryMode = "0700";
        LimitNOFILE = 1048576;
        TasksMax = "infinity";

        # ---- Hardening, as far as the jailer allows -----------------------
        # Root, because the jailer (run by the daemon, once per VM) has to:
        # mknod /dev/kvm and /dev/net/tun in the chroot (CAP_MKNOD), chown
        # the jail to the VM's uid (CAP_CHOWN, CAP_FOWNER, CAP_DAC_OVERRIDE),
        # unshare a mount and PID namespace, bind-mount and pivot_root
        # (CAP_SYS_ADMIN), chroot (CAP_SYS_CHROOT), write cgroup files, raise
        # rlimits (CAP_SYS_RESOURCE), then drop to that uid/gid (CAP_SETUID,
        # CAP_SETGID). The daemon itself makes network namespaces, veth and
        # TAP links and nftables rules (CAP_NET_ADMIN) and signals VMMs that
        # run as other uids (CAP_KILL). Nothing else is kept.
        CapabilityBoundingSet = [
          "CAP_SYS_ADMIN"
          "CAP_SYS_CHROOT"
          "CAP_MKNOD"
          "CAP_CHOWN"
          "CAP_FOWNER"
          "CAP_DAC_OVERRIDE"
          "CAP_SETUID"
          "CAP_SETGID"
          "CAP_SYS_RESOURCE"
          "CAP_NET_ADMIN"
          "CAP_KILL"
        ];
        # Compatible with the jailer: no_new_privs only stops privilege
        # GAINS at execve (setuid bits, file capabilities). The jailer is
        # started by root and drops to the VM uid with setuid()/setgid()
        # itself, which no_new_privs allows, then execs firecracker, which
        # needs no privileges; firecracker's own seccomp filters even rely
        # on no_new_privs. (It would not be compatible if the jailer were a
        # setuid binary started by an unprivileged daemon; it is not.)
        NoNewPrivileges = true;

        # Only the devices VMs need. Not PrivateDevices: that hides /dev/kvm.
        # "m" lets the jailer mknod the same devices inside its chroot; it
        # mknods /dev/userfaultfd too when /proc/misc lists it (fatal if
        # refused). The policy applies to the VMMs as well: they live below
        # the unit's cgroup.
        DevicePolicy = "closed";
        DeviceAllow = [ "/dev/kvm rwm" "/dev/net/tun rwm" "/dev/vhost-vsock rw" "/dev/userfaultfd rwm" ];

        ProtectSystem = "strict";
        ReadWritePaths = [
          # cgroup_placement own, in the subtree systemd delegates to the unit
          # (Delegate=yes): at start the daemon moves itself into
          # <unit>/daemon; every VM of both backends goes to <unit>/vms/<id>
          # (QEMU placed there by the daemon, Firecracker by the jailer with
          # --parent-cgroup <unit>/vms). Stopping the unit (KillMode=mixed)
          # thus reaches every VMM.
          "/sys/fs/cgroup"
          "-/run/netns"
          # (The jailer's chroot base is <state_dir>/jail, inside
          # StateDirectory: the same file system as the snapshots.)
        ];
        Delegate = true;
        ProtectHome = true;
        PrivateTmp = true;
        # Off on purpose: the daemon writes per-namespace sysctls
        # (forwarding, rp_filter) under /proc/sys/net, and the daemon and
        # the jailer write cgroup files (below the unit's own cgroup).
        ProtectKernelTunables = false;
        ProtectControlGroups = false;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectClock = true;
        ProtectHostname = true;
        ProtectProc = "default";
        LockPersonality = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        RemoveIPC = true;
        # QEMU's TCG translates guest code into executable memory.
        MemoryDenyWriteExecute = false;
        # mnt + pid: the jailer's namespaces; net: one namespace per session.
        RestrictNamespaces = "mnt pid net";
        RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" "AF_NETLINK" "AF_VSOCK" ];
        SystemCallArchitectures = "native";
        # @system-service plus what the jailer and network setup use:
        # mount/pivot_root/umount (@mount), chroot/setuid/mknod/setrlimit
        # (@privileged, @resources), and seccomp(2), which is in no group:
        # the daemon, firecracker and QEMU's -sandbox install their own
        # filters with it. The removed groups are never needed.
        SystemCallFilter = [
          "@system-service"
          "@mount"
          "@privileged"
          "@resources"
          "seccomp"
          "~@clock"
          "~@cpu-emulation"
          "~@debug"
          "~@module"
          "~@obsolete"
          "~@raw-io"
          "~@reboot"
          "~@swap"
        ];
        SystemCallErrorNumber = "EPERM";
        UMask = "0077";
      };
    };
  };
}
