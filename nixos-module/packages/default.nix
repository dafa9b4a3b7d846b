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
  # unimplemented.json, i.e. no filters).
  #
  # nixpkgs PR #460374 (merged to master 2025-11-10) made the static build
  # work, in pkgs/by-name/fi/firecracker/package.nix's postPatch: the
  # seccompiler build script links libseccomp from a hard-coded
  # /usr/local/lib (now libseccomp's store path), and cpu-template-helper's
  # build script calls "gcc" (now $CC, the musl cross compiler). The flake's
  # pin (flake.lock, nixos-25.11 of 2026-05-10) is newer than that merge and
  # is expected to have it (not confirmed: nixpkgs cannot be fetched here);
  # a consumer's older nixpkgs (the module imported without the flake builds
  # with the system's pkgs) may not. So the same substitutions are added
  # only where the package's postPatch lacks them: a no-op on nixpkgs that
  # has the fix (ci/eval.nix checks both cases).
  firecrackerFix = fc: fc.overrideAttrs (old:
    let
      postPatch = old.postPatch or "";
      has = lib.hasInfix;
    in
    {
      postPatch = postPatch
        + lib.optionalString (!has "src/seccompiler/build.rs" postPatch) ''

          if [ -f src/seccompiler/build.rs ]; then
            substituteInPlace src/seccompiler/build.rs \
              --replace-warn "/usr/local/lib" "${lib.getLib pkgs.pkgsStatic.libseccomp}/lib"
          fi
        ''
        + lib.optionalString (!has "src/cpu-template-helper/build.rs" postPatch) ''

          if [ -f src/cpu-template-helper/build.rs ]; then
            substituteInPlace src/cpu-template-helper/build.rs \
              --replace-warn '"gcc"' "\"$CC\""
          fi
        '';
    });
  firecracker = firecrackerFix pkgs.pkgsStatic.firecracker;
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
  inherit src version templates templatesDir cli artifacts firecrackerFix;
  inherit agent-sandbox sandbox-agent kernel firecracker qemu rootfs host;
}
