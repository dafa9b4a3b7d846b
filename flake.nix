{
  description = "agent-sandbox: a disposable microVM for every AI-agent session";

  # The only input, locked in flake.lock.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);
      # The guest kernel config (PVH, x86 devices), the images built on it,
      # the one-shot host and the VM tests are x86_64 only for now.
      onX86 = system: attrs: if system == "x86_64-linux" then attrs else { };

      pkgsFor = system: nixpkgs.legacyPackages.${system};
      builtFor = system: import ./nixos-module/packages { pkgs = pkgsFor system; };
      checksFor = system: import ./nixos-module/packages/checks.nix { pkgs = pkgsFor system; built = builtFor system; };
      nixosTest = system: backend: import ./nixos-module/test.nix { pkgs = pkgsFor system; inherit backend; };
    in
    {
      packages = forAllSystems (system:
        let b = builtFor system; in
        {
          default = b.agent-sandbox;
          inherit (b) agent-sandbox sandbox-agent;
        }
        // onX86 system ({
          inherit (b) kernel firecracker host;
        }
        # rootfs-base, rootfs-python, ...: one per images/templates/*.json.
        // builtins.listToAttrs (map (name: { name = "rootfs-${name}"; value = b.rootfs.${name}; }) b.templates.names)));

      apps = forAllSystems (system: onX86 system {
        default = {
          type = "app";
          program = "${self.packages.${system}.host}/bin/agent-sandbox-host";
          meta.description = "a one-shot agent-sandbox host on 127.0.0.1:3000";
        };
      });

      # The module, with its package options defaulting (mkDefault) to this
      # flake's packages: built with the nixpkgs of flake.lock, whatever
      # nixpkgs the NixOS system itself uses. Importing ./nixos-module
      # directly (no flake) builds them with the system's own pkgs instead.
      nixosModules.default = { lib, pkgs, ... }:
        let b = builtFor pkgs.stdenv.hostPlatform.system; in
        {
          imports = [ ./nixos-module ];
          services.agent-sandbox = {
            package = lib.mkDefault b.agent-sandbox;
            kernel = lib.mkDefault b.kernel;
            firecrackerPackage = lib.mkDefault b.firecracker;
            qemuPackage = lib.mkDefault b.qemu;
            images = lib.mkDefault b.rootfs;
          };
        };

      # The same packages built with the nixpkgs the overlay is applied to
      # (not this flake's lock): agent-sandbox and sandbox-agent at the top
      # level, everything (kernel, firecracker, qemu, rootfs.<template>,
      # host) under agent-sandbox-packages.
      overlays.default = final: _prev:
        let b = import ./nixos-module/packages { pkgs = final; }; in
        {
          inherit (b) agent-sandbox sandbox-agent;
          agent-sandbox-packages = b;
        };

      checks = forAllSystems (system:
        let c = checksFor system; in
        {
          inherit (self.packages.${system}) agent-sandbox sandbox-agent;
          inherit (c) clippy tests fmt nix-lint;
        }
        // onX86 system {
          nixos = nixosTest system "qemu";
        });

      # Needs nested KVM (the test VM runs Firecracker): `nix build .#nixosTests.firecracker`.
      legacyPackages = forAllSystems (system: onX86 system {
        nixosTests = {
          qemu = nixosTest system "qemu";
          firecracker = nixosTest system "firecracker";
        };
      });

      devShells = forAllSystems (system:
        let pkgs = pkgsFor system; in
        {
          default = pkgs.mkShell {
            inputsFrom = [ self.packages.${system}.agent-sandbox ];
            packages = with pkgs; [
              cargo
              rustc
              clippy
              rustfmt
              rust-analyzer
              qemu_kvm
              erofs-utils
              curl
              jq
              nixpkgs-fmt
              deadnix
            ];
          };
        });

      formatter = forAllSystems (system: (pkgsFor system).nixpkgs-fmt);
    };
}
