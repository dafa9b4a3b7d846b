# The guest agent, PID 1 of every sandbox VM. It must be static: the root
# filesystem has no loader at the agent's path and the agent runs before
# anything is mounted. glibc with crt-static (static-pie) is the build this
# project already tests on Debian; the agent avoids NSS calls, which a static
# glibc cannot serve. (pkgsStatic, i.e. musl, would also do if the agent's
# libc calls all exist there.)
{ lib, rustPlatform, glibc, file, src, lockFile, version }:
rustPlatform.buildRustPackage {
  pname = "sandbox-agent";
  inherit version src;
  cargoLock = { inherit lockFile; };
  cargoBuildFlags = [ "--package" "sandbox-agent" "--bin" "sandbox-agent" ];
  buildInputs = [ glibc.static ];
  nativeBuildInputs = [ file ];
  # cargo gets an explicit --target here, so the flag reaches the agent and
  # its dependencies but not build scripts or proc macros.
  env.RUSTFLAGS = "-C target-feature=+crt-static";
  doCheck = false;
  doInstallCheck = true;
  installCheckPhase = ''
    runHook preInstallCheck
    description=$(file -b $out/bin/sandbox-agent)
    echo "sandbox-agent: $description"
    case $description in
      *"static-pie linked"* | *"statically linked"*) ;;
      *) echo "sandbox-agent is not a static binary" >&2; exit 1 ;;
    esac
    runHook postInstallCheck
  '';
  meta = {
    description = "agent-sandbox guest agent (static, PID 1 in the VM)";
    license = lib.licenses.asl20;
    mainProgram = "sandbox-agent";
    platforms = lib.platforms.linux;
  };
}
