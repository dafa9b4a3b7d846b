# The daemon's command line and config file, in ONE place: the NixOS
# module, the `nix run` app and the NixOS test all go through here. If the
# daemon's CLI or config keys change, change them here only. Pure Nix (no
# nixpkgs, no lib): tests/config.rs evaluates it with nix-instantiate and
# feeds what it renders to `agent-sandbox config check`.
#
# Config keys: docs/operations.md, "Config file" (src/config.rs FileConfig).
let
  bin = package: "${package}/bin/agent-sandbox";
in
{
  # argv of the long-running host.
  serve = { package, configFile }: [ (bin package) "serve" "--config" configFile ];

  # argv that validates a config file and prints the effective config
  # (exit 0 valid, 2 not).
  check = { package, configFile }: [ (bin package) "config" "check" configFile ];

  # argv that makes an API key with the given scopes in the key file the
  # config names, printing the key (and nothing else) on stdout.
  keysCreate = { package, configFile, name, scopes }:
    [ (bin package) "keys" "--config" configFile "create" "--name" name "--scopes" (builtins.concatStringsSep "," scopes) ];

  # argv of the stdio MCP server forwarding to a running daemon; the key is
  # read from AGENT_SANDBOX_API_KEY or from the file AGENT_SANDBOX_KEY_FILE
  # names.
  mcp = { package, url }: [ (bin package) "mcp" "--url" url ];

  # argv that prints the HAProxy config of a router in front of `hosts`
  # (each { id, address, preview ? null }: the host's host_id, its API
  # address, its preview listener); docs/operations.md, "Several hosts".
  router = { package, listen, hosts, previewListen ? null, sharedKeys ? false, statsListen ? null }:
    [ (bin package) "router" "config" "--listen" listen ]
    ++ builtins.concatMap
      (h: [ "--host" ("${h.id}=${h.address}" + (if (h.preview or null) == null then "" else ",preview=${h.preview}")) ])
      hosts
    ++ (if previewListen == null then [ ] else [ "--preview-listen" previewListen ])
    ++ (if sharedKeys then [ "--shared-keys" ] else [ ])
    ++ (if statsListen == null then [ ] else [ "--stats-listen" statsListen ]);

  # The config keys that point at built artifacts. `images` maps a template
  # name to its root filesystem image.
  artifacts = { firecracker, kernel, rootfs, qemu, templatesDir }: {
    firecracker = "${firecracker}/bin/firecracker";
    jailer = "${firecracker}/bin/jailer";
    qemu = "${qemu}/bin/qemu-system-x86_64";
    kernel = "${kernel}/vmlinux";
    images = builtins.mapAttrs (_: r: "${r}/rootfs.erofs") rootfs;
    templates_dir = "${templatesDir}";
  };

  # The daemon's settings from the module's options. `egress` is the
  # default policy of a session that asks for none; `network` (null: VMs
  # get no network device) is the daemon's network section as is.
  # `cgroup_placement` "own": the unit delegates its cgroup (Delegate=yes),
  # the daemon moves into <unit>/daemon and puts every VM (both backends)
  # in <unit>/vms/<id>, so stopping the unit reaches every VMM. ("auto"
  # would pick the same under systemd 251+; "own" also fails loudly where
  # the cgroup is not delegated instead of silently leaving the unit.)
  settings =
    { listen
    , backend
    , stateDir
    , keysFile
    , maxSessions
    , idleTimeout
    , defaultVcpus
    , defaultMemMib
    , egress
    , mcpHttp
    , network
    , vmIds ? null
    , cgroupPlacement ? "own"
    , hostId ? null
    }: {
      inherit listen backend network;
      cgroup_placement = cgroupPlacement;
      state_dir = stateDir;
      keys_file = keysFile;
      # Snapshots (and the QEMU accelerator probe) beside the keys: the
      # image cache default, /var/cache/agent-sandbox, is read-only to a
      # hardened unit.
      snapshot_dir = stateDir;
      max_sessions = maxSessions;
      idle_timeout_secs = idleTimeout;
      default_vcpus = defaultVcpus;
      default_mem_mib = defaultMemMib;
      egress = { inherit (egress) mode rules domains; };
      mcp_http = mcpHttp;
    } // (if vmIds == null then { } else { vm_ids = { inherit (vmIds) first count; }; })
    // (if hostId == null then { } else { host_id = hostId; });
}
