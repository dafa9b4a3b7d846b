# `nix flake check` derivations besides the package builds and the NixOS
# test: clippy, the test suite, rustfmt, and the Nix files' own lint.
{ pkgs, built }:
let
  inherit (pkgs) lib;
  root = ../..;
  nixFiles = lib.fileset.toSource {
    inherit root;
    fileset = lib.fileset.unions [ (root + "/flake.nix") (lib.fileset.fileFilter (f: f.hasExt "nix") (root + "/nixos-module")) ];
  };
in
{
  clippy = built.agent-sandbox.overrideAttrs (old: {
    pname = "agent-sandbox-clippy";
    nativeBuildInputs = old.nativeBuildInputs ++ [ pkgs.clippy ];
    buildPhase = ''
      runHook preBuild
      cargo clippy --workspace --all-targets --offline -- -D warnings
      runHook postBuild
    '';
    installPhase = "touch $out";
    dontFixup = true;
  });

  # The workspace test suite as the Nix build sandbox allows it: no root,
  # no /dev/kvm, no network. Tests that need those must skip themselves
  # when they are missing (the CI machines run them for real).
  tests = built.agent-sandbox.overrideAttrs (_: {
    pname = "agent-sandbox-tests";
    doCheck = true;
    cargoTestFlags = [ "--workspace" ];
    installPhase = "touch $out";
    dontFixup = true;
  });

  fmt = pkgs.runCommand "agent-sandbox-rustfmt" { nativeBuildInputs = [ pkgs.rustfmt pkgs.findutils ]; } ''
    cd ${built.src}
    find src guest/src tests benches -name '*.rs' -print0 | xargs -0 rustfmt --check --edition 2021
    touch $out
  '';

  nix-lint = pkgs.runCommand "agent-sandbox-nix-lint" { nativeBuildInputs = [ pkgs.nixpkgs-fmt pkgs.deadnix pkgs.findutils ]; } ''
    cd ${nixFiles}
    find . -name '*.nix' -print0 | xargs -0 nixpkgs-fmt --check
    find . -name '*.nix' -print0 | xargs -0 deadnix --fail
    touch $out
  '';
}
