# Every package of the project for one nixpkgs package set. flake.nix and the
# NixOS module both come here, so the module also works without the flake.
{ pkgs }:
let
  inherit (pkgs) lib;
  root = ../..;
  images = root + "/images";
  cli = import ../cli.nix;

  # The cargo workspace; docs/ because tests may read files from it (the
  # OpenAPI document). images/ stays out: a template edit should not
  # rebuild the daemon.
  src = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.difference
      (lib.fileset.unions (map (p: lib.fileset.maybeMissing (root + p)) [ "/Cargo.toml" "/Cargo.lock" "/src" "/guest" "/tests" "/benches" "/docs" ]))
      (lib.fileset.maybeMissing (root + "/guest/fuzz"));
  };
  version = (lib.importTOML (root + "/Cargo.toml")).package.version;

  templates = import ./templates.nix { templatesDir = images + "/templates"; };
  templatesDir = lib.fileset.toSource {
    root = images + "/templates";
    fileset = images + "/templates";
  };

  # The workspace Cargo.lock, read at evaluation time (a path, not from src).
  lockFile = root + "/Cargo.lock";
  agent-sandbox = pkgs.callPackage ./agent-sandbox.nix { inherit src lockFile version; };
  sandbox-agent = pkgs.callPackage ./sandbox-agent.nix { inherit src lockFile version; };
  kernel = pkgs.callPackage ./kernel.nix { kernelDir = images + "/kernel"; };
  # Static (musl), for two reasons: the jailer copies firecracker into an
  # empty chroot, and only the musl target has Firecracker's built-in
  # seccomp policy (a glibc build falls back to resources/seccomp/
  # unimplemented.json, i.e. no filters; nixpkgs PR #460374 made the static
  # build work).
  firecracker = pkgs.pkgsStatic.firecracker;
  qemu = pkgs.qemu_kvm;

  rootfs = lib.genAttrs templates.names (name: pkgs.callPackage ./rootfs.nix {
    inherit sandbox-agent;
    template = templates.resolved.${name};
    packages = templates.nixPackagesOf pkgs name;
  });

  artifacts = cli.artifacts { inherit firecracker kernel rootfs qemu templatesDir; };

  host = pkgs.callPackage ./host.nix {
    inherit agent-sandbox cli artifacts;
    defaults = { mcp_http = true; };
  };
in
{
  inherit src version templates templatesDir cli artifacts;
  inherit agent-sandbox sandbox-agent kernel firecracker qemu rootfs host;
}
