# The host daemon `agent-sandbox` (package agent-sandbox at the workspace
# root). Tests run in the separate `tests` check (flake.nix), not here, so
# that installing the daemon does not depend on the test suite's sandbox
# needs.
{ lib, rustPlatform, src, lockFile, version }:
rustPlatform.buildRustPackage {
  pname = "agent-sandbox";
  inherit version src;
  cargoLock = { inherit lockFile; };
  cargoBuildFlags = [ "--package" "agent-sandbox" ];
  doCheck = false;
  meta = {
    description = "Disposable microVM sandboxes for AI-agent sessions";
    license = lib.licenses.asl20;
    mainProgram = "agent-sandbox";
    platforms = lib.platforms.linux;
  };
}
