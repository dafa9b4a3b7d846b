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

  # ---- A tiny module evaluator: option defaults, user values, mkIf and
  # mkDefault as the module uses them. Enough to read back the unit and the
  # config file the module writes.
  isOption = o: builtins.isAttrs o && (o._type or null) == "option";
  defaultsOf = o: if isOption o then o.default else builtins.mapAttrs (_: defaultsOf) o;
  update = a: b: a // builtins.mapAttrs (n: v: if builtins.isAttrs v && builtins.isAttrs (a.${n} or null) && !(v ? outPath) then update a.${n} v else v) b;
  unIf = v: if (v._type or null) == "if" then (if v.condition then v.content else { }) else v;
  evalModule = user:
    let
      m = import (root + "/nixos-module") { inherit lib pkgs; config = final; };
      cfg = update (defaultsOf m.options.services.agent-sandbox) (builtins.removeAttrs user [ "settings" ]);
      body = unIf m.config;
      settings = builtins.mapAttrs (_: v: v.content) body.services.agent-sandbox.settings // (user.settings or { });
      final = { services.agent-sandbox = cfg // { inherit settings; }; };
      unit = body.systemd.services.agent-sandbox;
    in
    {
      inherit cfg body settings unit;
    };
  run = user:
    let
      e = evalModule user;
      configFile = builtins.elemAt (builtins.match ".*'--config' '([^']+)'" e.unit.serviceConfig.ExecStart) 0;
    in
    e // { inherit configFile; etcConfig = e.body.environment.etc."agent-sandbox/config.json".source; };

  # The unit as NixOS writes it (a list is one line per element), for
  # `systemd-analyze verify` in .ci/nix-check.
  iniValue = v: if builtins.isBool v then (if v then "true" else "false") else toString v;
  unitText = e:
    let
      line = k: v: map (x: "${k}=${iniValue x}") (if builtins.isList v then v else [ v ]);
      section = name: attrs: [ "[${name}]" ] ++ builtins.concatLists (builtins.attrValues (builtins.mapAttrs line attrs));
    in
    lib.concatLines (section "Unit" { Description = e.unit.description; }
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
  keyed = run { enable = true; keysFile = "/run/secrets/keys.json"; listenAddress = "::"; openFirewall = true; templates = [ "base" ]; settings.max_sessions = 99; settings.default_template = "base"; extraEnvironment.RUST_LOG = "debug"; };

  x86 = outputs.packages.x86_64-linux;
  nixosTest = outputs.checks.x86_64-linux.nixos;
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
assert check (builtins.match "'/nix/store/[^']+-agent-sandbox/bin/agent-sandbox' 'serve' '--config' '/nix/store/[^']+-agent-sandbox.json'" dflt.unit.serviceConfig.ExecStart != null) "ExecStart: ${dflt.unit.serviceConfig.ExecStart}";
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
  };
  templates = outputs.packages.x86_64-linux.rootfs-base.passthru.template.chain;
  # Python; .ci/nix-check byte-compiles it.
  inherit (nixosTest) testScript;
  resolved = builtins.mapAttrs (_: v: v.passthru.template) (lib.getAttrs (builtins.filter (n: builtins.substring 0 7 n == "rootfs-") (builtins.attrNames x86)) x86);
  # Every config the Nix code writes, for tests/config.rs to hand to
  # `agent-sandbox config check` (drift between module and daemon fails).
  configs = {
    module-default = dflt.settings;
    module-keyed = keyed.settings;
    module-networked = networked.settings;
    host = hostSettings;
  };
  module = {
    defaultSettings = builtins.attrNames dflt.settings;
    inherit (dflt.unit.serviceConfig) CapabilityBoundingSet NoNewPrivileges DeviceAllow ProtectSystem SystemCallFilter;
    mcpOnPath = map (p: p.name or "?") dflt.body.environment.systemPackages;
    unit = unitText keyed;
  };
}
