# Offline evaluation of the flake and the module against stub-nixpkgs.nix
# (.ci/nix-check runs it with `nix-instantiate --eval --strict --json`):
# the flake's shape, the template resolution, and the module's generated
# config and unit for a few option sets. Throws on the first broken
# expectation; .ci/nix-check compares the rest with what it expects.
{ root ? ../.. }:
let
  stub = import ./stub-nixpkgs.nix;
  inherit (stub) lib pkgs;

  flake = import (root + "/flake.nix");
  outputs = flake.outputs { self = outputs; inherit (stub) nixpkgs; };
  names = v: if builtins.isAttrs v then builtins.attrNames v else builtins.typeOf v;
  perSystem = builtins.mapAttrs (_: names);

  check = cond: msg: if cond then true else throw "nix-check: ${msg}";
  all = builtins.all (x: x);

  # ---- A tiny module evaluator: option defaults, user values, mkIf,
  # mkDefault and mkForce as the module uses them. Enough to read back the
  # unit and the config file the module writes.
  isOption = o: builtins.isAttrs o && (o._type or null) == "option";
  defaultsOf = o: if isOption o then o.default else builtins.mapAttrs (_: defaultsOf) o;
  update = a: b: a // builtins.mapAttrs (n: v: if builtins.isAttrs v && builtins.isAttrs (a.${n} or null) && !(v ? outPath) then update a.${n} v else v) b;
  unIf = v: if (v._type or null) == "if" then (if v.condition then v.content else { }) else v;

  # How the module system merges definitions of `settings` (json type:
  # nullOr (oneOf [ ... (attrsOf json) (listOf json) ])): at every key the
  # definitions of the highest priority win (mkForce 50, plain 100,
  # mkDefault 1000); several attribute sets merge key by key, several lists
  # concatenate, equal values are one value; a set and a non-set (null
  # included) conflict.
  isOverride = v: builtins.isAttrs v && (v._type or null) == "override";
  prio = v: if isOverride v then v.priority else 100;
  strip = v: if isOverride v then strip v.content else if builtins.isAttrs v && !(v ? outPath) then builtins.mapAttrs (_: strip) v else v;
  mergeDefs = path: defs:
    let
      best = builtins.foldl' (m: d: if prio d < m then prio d else m) 1000000 defs;
      kept = map (d: if isOverride d then d.content else d) (builtins.filter (d: prio d == best) defs);
      first = builtins.head kept;
      names = builtins.attrNames (builtins.foldl' (a: d: a // d) { } kept);
    in
    if builtins.length kept == 1 then strip first
    else if builtins.all (d: builtins.isAttrs d && !(d ? outPath)) kept then
      lib.genAttrs names (n: mergeDefs (path ++ [ n ]) (builtins.concatMap (d: if d ? ${n} then [ d.${n} ] else [ ]) kept))
    else if builtins.all builtins.isList kept then builtins.concatMap strip kept
    else if builtins.all (d: strip d == strip first) kept then strip first
    else throw "conflicting definitions of ${concatStringsSep "." path}";
  inherit (builtins) concatStringsSep;

  evalModuleWith = { modPkgs ? pkgs, extraDefaults ? { } }: user:
    let
      m = import (root + "/nixos-module") { inherit lib; pkgs = modPkgs; config = final; };
      cfg = update (update (defaultsOf m.options.services.agent-sandbox) extraDefaults) (builtins.removeAttrs user [ "settings" ]);
      body = unIf m.config;
      settings = mergeDefs [ "settings" ] ([ body.services.agent-sandbox.settings ] ++ lib.optional (user ? settings) user.settings);
      final = { services.agent-sandbox = cfg // { inherit settings; }; };
      unit = body.systemd.services.agent-sandbox;
    in
    {
      inherit m cfg body settings unit;
    };
  evalModule = evalModuleWith { };

  # Shell words of a command line: bare words, '...' segments and \x
  # escapes (what escapeShellArgs writes), each word unquoted.
  shellWords = s:
    let
      words = builtins.filter builtins.isList (builtins.split "(([^ '\\]|'[^']*'|\\\\.)+)" s);
      unquote = w: concatStringsSep "" (map
        (p:
          if builtins.isList p then
            (
              let t = builtins.head p; in
              if builtins.substring 0 1 t == "'" then builtins.substring 1 (builtins.stringLength t - 2) t
              else builtins.substring 1 1 t
            )
          else p)
        (builtins.split "('[^']*'|\\\\.)" w));
    in
    map (w: unquote (builtins.head w)) words;
  allChecks = builtins.all (c: check c.ok c.msg);

  run' = eval: user:
    let
      e = eval user;
      argv = shellWords e.unit.serviceConfig.ExecStart;
      configFile = builtins.elemAt argv (builtins.length argv - 1);
    in
    e // { inherit argv configFile; etcConfig = e.body.environment.etc."agent-sandbox/config.json".source; };
  run = run' evalModule;

  # ---- Shell escaping: the stub's lib.escapeShellArg must be nixpkgs' (bare
  # when the string matches [[:alnum:],._+:@%/-]+, else single-quoted with
  # '\'' for a quote), and the parser above must read it back. The expected
  # strings are nixpkgs' own (lib/strings.nix documents the first).
  escaping = [
    { args = [ "one" "two three" "four'five" ]; nixpkgs = "one 'two three' 'four'\\''five'"; }
    { args = [ "/nix/store/0abc-agent-sandbox.json" "--config" "a,b.c_d+e:f@g%h/i-j" ]; nixpkgs = "/nix/store/0abc-agent-sandbox.json --config a,b.c_d+e:f@g%h/i-j"; }
    { args = [ "" "$x" "a=b" "~" "it's" ]; nixpkgs = "'' '$x' 'a=b' '~' 'it'\\''s'"; }
  ];
  escapingChecks = builtins.concatMap
    (c: [
      { ok = lib.escapeShellArgs c.args == c.nixpkgs; msg = "stub escapeShellArgs ${builtins.toJSON c.args} = ${lib.escapeShellArgs c.args}, nixpkgs: ${c.nixpkgs}"; }
      { ok = shellWords c.nixpkgs == c.args; msg = "shellWords ${c.nixpkgs} = ${builtins.toJSON (shellWords c.nixpkgs)}"; }
    ])
    escaping;

  # ---- Settings merging: a nested key overrides only itself.
  nestedOverride = run { enable = true; egress = { mode = "allowlist"; rules = [ "203.0.113.0/24:443/tcp" ]; }; settings.egress.domains = [ "*.pypi.org" ]; };
  networkNull = run { enable = true; settings.network = null; };
  networkForced = run { enable = true; network.uplink_if = "eth0"; settings.network = lib.mkForce null; };
  networkConflict = builtins.tryEval (builtins.deepSeq (run { enable = true; network.uplink_if = "eth0"; settings.network = null; }).settings true);

  # ---- The router (nixos-module/router.nix), evaluated on its own.
  evalRouter = user:
    let
      m = import (root + "/nixos-module/router.nix") { inherit lib pkgs; config = final; };
      rcfg = update (defaultsOf m.options.services.agent-sandbox.router) user;
      final = { services.agent-sandbox = { package = stub.leaf "agent-sandbox"; router = rcfg; }; };
      body = unIf m.config;
    in
    {
      inherit m body;
      unit = body.systemd.services.agent-sandbox-router;
      cfgFile = body.environment.etc."agent-sandbox/router.cfg".source;
    };
  routerHosts = [
    { id = "h1"; address = "10.0.0.11:3000"; preview = "10.0.0.11:3001"; }
    { id = "h2"; address = "10.0.0.12:3000"; preview = "10.0.0.12:3001"; }
  ];
  routed = evalRouter { enable = true; previewListen = "0.0.0.0:3001"; openFirewall = true; hosts = routerHosts; };
  routerArgv = (import (root + "/nixos-module/cli.nix")).router {
    package = "@agent-sandbox@";
    listen = "127.0.0.1:3000";
    hosts = routerHosts;
    previewListen = "127.0.0.1:3001";
    sharedKeys = true;
    statsListen = "127.0.0.1:8404";
  };
  hostTagged = run { enable = true; hostId = "h1"; };

  # ---- Architecture: the module refuses non-x86_64 hosts.
  aarch64Pkgs = pkgs // { stdenv = pkgs.stdenv // { hostPlatform = { system = "aarch64-linux"; isx86_64 = false; }; }; };
  onAarch64 = evalModuleWith { modPkgs = aarch64Pkgs; } { enable = true; };
  failedAssertions = e: map (a: a.message) (builtins.filter (a: !a.assertion) e.body.assertions);

  # ---- nixosModules.default: the package options default to the flake's
  # own packages (its lock's nixpkgs), not the system's pkgs. A flake
  # nixpkgs whose qemu_kvm differs from the system's shows which is used.
  lockQemu = stub.leaf "qemu-of-the-flake-lock";
  lockNixpkgs = stub.nixpkgs // { legacyPackages = builtins.mapAttrs (_: p: p // { qemu_kvm = lockQemu; }) stub.nixpkgs.legacyPackages; };
  lockOutputs = flake.outputs { self = lockOutputs; nixpkgs = lockNixpkgs; };
  wrapper = lockOutputs.nixosModules.default { inherit lib pkgs; };
  wrapperDefaults = wrapper.services.agent-sandbox;
  fromFlake = run' (evalModuleWith { extraDefaults = builtins.mapAttrs (_: v: v.content) wrapperDefaults; }) { enable = true; };
  directModule = import (root + "/nixos-module") { inherit lib pkgs; config = { }; };
  overlaid = lockOutputs.overlays.default pkgs pkgs;

  # ---- pkgsStatic.firecracker and nixpkgs PR #460374.
  builtHere = import (root + "/nixos-module/packages") { inherit pkgs; };
  fixedPostPatch = ''
    substituteInPlace src/seccompiler/build.rs --replace-warn "/usr/local/lib" "/nix/store/x-libseccomp/lib"
    substituteInPlace src/cpu-template-helper/build.rs --replace-warn '"gcc"' "\"$CC\""
  '';
  alreadyFixed = builtHere.firecrackerFix (stub.drv "firecracker-fixed" { postPatch = fixedPostPatch; });

  # The unit as NixOS writes it (a list is one line per element), for
  # `systemd-analyze verify` in .ci/nix-check.
  iniValue = v: if builtins.isBool v then (if v then "true" else "false") else toString v;
  unitText = e:
    let
      line = k: v: map (x: "${k}=${iniValue x}") (if builtins.isList v then v else [ v ]);
      section = name: attrs: [ "[${name}]" ] ++ builtins.concatLists (builtins.attrValues (builtins.mapAttrs line attrs));
    in
    lib.concatLines (section "Unit" { Description = e.unit.description; Wants = e.unit.wants; After = e.unit.after; }
      ++ section "Service" (e.unit.serviceConfig // { Environment = map (n: "${n}=${e.unit.environment.${n}}") (builtins.attrNames e.unit.environment); })
      ++ section "Install" { WantedBy = e.unit.wantedBy; });

  dflt = run { enable = true; };
  networked = run {
    enable = true;
    backend = "qemu";
    egress = { mode = "allowlist"; rules = [ "203.0.113.0/24:443/tcp" ]; domains = [ "*.pypi.org" ]; };
    network = { uplink_if = "eth1"; dns_upstreams = [ "9.9.9.9:53" ]; };
  };
  # The `nix run` host's config with its run-time shell words filled in.
  hostSettings = builtins.mapAttrs
    (_: v: if builtins.isString v then builtins.replaceStrings [ "$state" "$backend" "$port" ] [ "/var/lib/agent-sandbox" "firecracker" "3000" ] v else v)
    outputs.packages.x86_64-linux.host.passthru.settings;
  # An argument that needs quoting in ExecStart (a package path with a
  # space and a quote) still reads back as the same argv.
  oddPackage = stub.leaf "agent-sandbox" // { outPath = "/nix/store/0odd-it's a package"; };
  quoted = run { enable = true; package = oddPackage; };
  keyed = run { enable = true; keysFile = "/run/secrets/keys.json"; listenAddress = "::"; openFirewall = true; templates = [ "base" ]; settings.max_sessions = 99; settings.default_template = "base"; extraEnvironment.RUST_LOG = "debug"; };

  x86 = outputs.packages.x86_64-linux;
  nixosTest = outputs.checks.x86_64-linux.nixos;
  firecrackerTest = outputs.legacyPackages.x86_64-linux.nixosTests.firecracker;
  # Force every build script and command string: a wrong attribute path or
  # a bad interpolation anywhere in the package files fails here.
  scripts = [
    x86.sandbox-agent.installCheckPhase
    x86.sandbox-agent.env.RUSTFLAGS
    x86.kernel.postInstall
    x86.kernel.configfile.buildPhase
    x86.host.text
    outputs.apps.x86_64-linux.default.program
    nixosTest.testScript
    firecrackerTest.testScript
    (nixosTest.nodes.machine { config.services.agent-sandbox.package = stub.leaf "agent-sandbox"; }).systemd.services.agent-sandbox.preStart
  ] ++ map (n: x86.${n}.script) (builtins.filter (n: builtins.substring 0 7 n == "rootfs-") (builtins.attrNames x86));
in
assert check (builtins.functionArgs flake.outputs == { self = false; nixpkgs = false; }) "outputs must take exactly { self, nixpkgs }";
assert check (builtins.all (s: builtins.isString s && builtins.stringLength s > 0) scripts) "empty build script";
# cargoLock = { lockFile; } vendors registry crates by their checksums; a git
# dependency would need cargoLock.outputHashes.
assert check (builtins.all (p: builtins.substring 0 4 (p.source or "registry") != "git+") (builtins.fromTOML (builtins.readFile (root + "/Cargo.lock"))).package) "Cargo.lock has git dependencies: add cargoLock.outputHashes";
assert check (dflt.settings.listen == "127.0.0.1:3000") "default listen";
assert check (dflt.settings.keys_file == "/var/lib/agent-sandbox/keys.json") "default keys_file";
assert check (dflt.unit.serviceConfig.LoadCredential == [ ]) "no credential without keysFile";
assert allChecks escapingChecks;
# nixpkgs' escaping leaves store paths and plain words bare.
assert check (builtins.match "/nix/store/[^ ']+-agent-sandbox/bin/agent-sandbox serve --config /nix/store/[^ ']+-agent-sandbox.json" dflt.unit.serviceConfig.ExecStart != null) "ExecStart: ${dflt.unit.serviceConfig.ExecStart}";
assert check (dflt.argv == [ "${dflt.cfg.package}/bin/agent-sandbox" "serve" "--config" (toString dflt.etcConfig) ]) "ExecStart argv: ${builtins.toJSON dflt.argv}";
assert check (builtins.substring 0 1 quoted.unit.serviceConfig.ExecStart == "'") "a path with a space is quoted: ${quoted.unit.serviceConfig.ExecStart}";
assert check (quoted.argv == [ "/nix/store/0odd-it's a package/bin/agent-sandbox" "serve" "--config" (toString quoted.etcConfig) ]) "quoted ExecStart argv: ${builtins.toJSON quoted.argv}";
# The unit (issue #23): VMs below the unit's cgroup, network-online.
assert check (dflt.settings.cgroup_placement == "own") "cgroup_placement own";
assert check (dflt.unit.wants == [ "network-online.target" ] && dflt.unit.after == [ "network-online.target" ]) "wants/after network-online.target";
assert check (dflt.unit.serviceConfig.KillMode == "mixed" && dflt.unit.serviceConfig.Delegate) "KillMode=mixed, Delegate=yes";
assert check (builtins.elem "/dev/userfaultfd rwm" dflt.unit.serviceConfig.DeviceAllow) "DeviceAllow /dev/userfaultfd";
# Settings: nested keys override only themselves; null needs mkForce over a set.
assert check (nestedOverride.settings.egress == { mode = "allowlist"; rules = [ "203.0.113.0/24:443/tcp" ]; domains = [ "*.pypi.org" ]; }) "settings.egress.domains keeps mode and rules: ${builtins.toJSON nestedOverride.settings.egress}";
assert check (nestedOverride.settings.max_sessions == 16) "other keys stay";
assert check (networkNull.settings.network == null) "settings.network = null over the default { }";
assert check (networkForced.settings.network == null) "settings.network = mkForce null";
assert check (!networkConflict.success) "settings.network = null over a non-empty network must conflict, as in nixpkgs";
assert check (networked.settings.network == { uplink_if = "eth1"; dns_upstreams = [ "9.9.9.9:53" ]; }) "network option";
# Architecture.
assert check (failedAssertions dflt == [ ]) "x86_64: no assertion fails";
assert check (builtins.any (m: lib.hasInfix "x86_64 hosts only" m) (failedAssertions onAarch64)) "aarch64 is refused: ${builtins.toJSON (failedAssertions onAarch64)}";
# Pinned packages.
assert check (builtins.map toString wrapper.imports == [ (toString (root + "/nixos-module")) ]) "nixosModules.default imports ./nixos-module";
assert check (builtins.attrNames wrapperDefaults == [ "firecrackerPackage" "images" "kernel" "package" "qemuPackage" ]) "nixosModules.default sets the package options: ${builtins.toJSON (builtins.attrNames wrapperDefaults)}";
assert check (builtins.all (v: isOverride v && v.priority == 1000) (builtins.attrValues wrapperDefaults)) "nixosModules.default sets them with mkDefault";
assert check (wrapperDefaults.qemuPackage.content.outPath == lockQemu.outPath) "nixosModules.default: qemu from the flake's lock";
assert check (fromFlake.settings.qemu == "${lockQemu}/bin/qemu-system-x86_64") "flake module config names the lock's qemu: ${fromFlake.settings.qemu}";
assert check (directModule.options.services.agent-sandbox.qemuPackage.default.outPath == pkgs.qemu_kvm.outPath) "./nixos-module alone: the system's qemu";
assert check (builtins.attrNames overlaid == [ "agent-sandbox" "agent-sandbox-packages" "sandbox-agent" ]) "overlay attributes";
assert check (overlaid.agent-sandbox-packages.qemu.outPath == pkgs.qemu_kvm.outPath) "overlay builds with the pkgs it is applied to";
# Firecracker: the PR #460374 substitutions are added where missing, once.
assert check (lib.hasInfix "src/seccompiler/build.rs" x86.firecracker.postPatch && lib.hasInfix "${pkgs.pkgsStatic.libseccomp}/lib" x86.firecracker.postPatch && lib.hasInfix "src/cpu-template-helper/build.rs" x86.firecracker.postPatch && lib.hasInfix "a_bitstr.c" x86.firecracker.postPatch) "firecracker: PR #460374 substitutions added: ${x86.firecracker.postPatch}";
assert check (alreadyFixed.postPatch == fixedPostPatch) "firecracker: nixpkgs with PR #460374 is left alone";
assert check (dflt.configFile == toString dflt.etcConfig) "/etc/agent-sandbox/config.json is the unit's config";
assert check (builtins.match ".*/vmlinux" dflt.settings.kernel != null) "kernel path";
assert check (keyed.settings.listen == "[::]:3000") "IPv6 listen";
assert check (keyed.settings.keys_file == "/run/credentials/agent-sandbox.service/keys") "keys_file from credential";
assert check (keyed.unit.serviceConfig.LoadCredential == [ "keys:/run/secrets/keys.json" ]) "LoadCredential";
assert check (builtins.attrNames keyed.settings.images == [ "base" ]) "templates select images";
assert check (keyed.settings.max_sessions == 99) "settings override options";
assert check (dflt.settings.vm_ids == { first = 2000000000; count = 65536; }) "VM id range";
assert check ((unIf keyed.body.networking.firewall.allowedTCPPorts) == [ 3000 ]) "openFirewall";
assert check (all (map (t: t.assertion) keyed.body.assertions)) "assertions hold for known templates";
assert check (!(all (map (t: t.assertion) (run { enable = true; templates = [ "nope" ]; }).body.assertions))) "unknown template is refused";
assert check (!(all (map (t: t.assertion) (run { enable = true; templates = [ "base" ]; }).body.assertions))) "templates without the default (dev) are refused";
assert check (hostTagged.settings.host_id == "h1") "hostId -> host_id";
assert check (!(dflt.settings ? host_id)) "no host_id by default";
assert check (routed.unit.serviceConfig.ExecStart == "${pkgs.haproxy}/bin/haproxy -Ws -f ${routed.cfgFile}") "router ExecStart: ${routed.unit.serviceConfig.ExecStart}";
assert check (routed.unit.serviceConfig.Type == "notify" && routed.unit.serviceConfig.DynamicUser) "router unit: notify, DynamicUser";
assert check (lib.hasInfix "/bin/agent-sandbox router config --listen 0.0.0.0:3000 --host 'h1=10.0.0.11:3000,preview=10.0.0.11:3001' --host 'h2=10.0.0.12:3000,preview=10.0.0.12:3001' --preview-listen 0.0.0.0:3001 > $out" routed.cfgFile.script) "router config script: ${routed.cfgFile.script}";
assert check (lib.hasInfix "haproxy -c -q -f $out" routed.cfgFile.script) "the router config is checked at build time";
assert check ((unIf routed.body.networking.firewall.allowedTCPPorts) == [ 3000 3001 ]) "router openFirewall";
assert check (all (map (a: a.assertion) routed.body.assertions)) "router assertions hold";
assert check (!(all (map (a: a.assertion) (evalRouter { enable = true; }).body.assertions))) "a router without hosts is refused";
assert check ((evalRouter { }).body == { }) "router off by default";
{
  inputs = builtins.attrNames flake.inputs;
  nixpkgsUrl = flake.inputs.nixpkgs.url;
  outputs = {
    packages = perSystem outputs.packages;
    apps = perSystem outputs.apps;
    checks = perSystem outputs.checks;
    devShells = perSystem outputs.devShells;
    legacyPackages = perSystem outputs.legacyPackages;
    formatter = builtins.attrNames outputs.formatter;
    nixosModules = names outputs.nixosModules;
    overlays = names outputs.overlays;
  };
  templates = outputs.packages.x86_64-linux.rootfs-base.passthru.template.chain;
  # Python; .ci/nix-check byte-compiles them.
  testScripts = { qemu = nixosTest.testScript; firecracker = firecrackerTest.testScript; };
  resolved = builtins.mapAttrs (_: v: v.passthru.template) (lib.getAttrs (builtins.filter (n: builtins.substring 0 7 n == "rootfs-") (builtins.attrNames x86)) x86);
  # Every config the Nix code writes, for tests/config.rs to hand to
  # `agent-sandbox config check` (drift between module and daemon fails).
  configs = {
    module-default = dflt.settings;
    module-keyed = keyed.settings;
    module-networked = networked.settings;
    module-nested = nestedOverride.settings;
    module-host-id = hostTagged.settings;
    host = hostSettings;
  };
  # argv of `agent-sandbox router config` as the module writes it (the
  # binary's path is @agent-sandbox@/bin/agent-sandbox); tests/config.rs
  # runs it and `haproxy -c` on what it prints.
  inherit routerArgv;
  module = {
    defaultSettings = builtins.attrNames dflt.settings;
    inherit (dflt.unit.serviceConfig) CapabilityBoundingSet NoNewPrivileges DeviceAllow ProtectSystem SystemCallFilter;
    mcpOnPath = map (p: p.name or "?") dflt.body.environment.systemPackages;
    # .ci/nix-check compares it with what docs/nix.md states.
    networkDefault = dflt.m.options.services.agent-sandbox.network.default;
    unit = unitText keyed;
  };
}
