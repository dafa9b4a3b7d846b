# The guest kernel from the same recipe as images/build-kernel.sh:
# `make tinyconfig`, merge images/kernel/agent-sandbox.config, `make
# olddefconfig`, then images/kernel/verify-config.sh proves every option of
# the fragment survived. The resulting .config feeds linuxManualConfig; the
# output holds the uncompressed ELF `vmlinux` Firecracker and QEMU microvm
# boot, and the `config` it was built with.
{ stdenv, linuxManualConfig, linux_6_1, flex, bison, bc, perl, kernelDir }:
let
  base = linux_6_1;
  fragment = kernelDir + "/agent-sandbox.config";

  configfile = stdenv.mkDerivation {
    pname = "agent-sandbox-kernel-config";
    inherit (base) version src;
    nativeBuildInputs = [ flex bison bc perl ];
    postPatch = "patchShebangs scripts";
    dontConfigure = true;
    buildPhase = ''
      runHook preBuild
      make ARCH=x86_64 tinyconfig
      bash scripts/kconfig/merge_config.sh -m .config ${fragment}
      make ARCH=x86_64 olddefconfig
      bash ${kernelDir + "/verify-config.sh"} ${fragment} .config
      runHook postBuild
    '';
    installPhase = "cp .config $out";
  };
in
(linuxManualConfig {
  inherit (base) src version;
  # kernel.release carries CONFIG_LOCALVERSION from the fragment.
  modDirVersion = "${base.version}-agent-sandbox";
  inherit configfile;
  # What linuxManualConfig would otherwise read from the .config by
  # import-from-derivation: the kernel has no modules and no Rust.
  config = { CONFIG_MODULES = "n"; CONFIG_RUST = "n"; };
}).overrideAttrs (old: {
  pname = "agent-sandbox-kernel";
  # The install step runs in the build tree: keep the uncompressed image.
  postInstall = (old.postInstall or "") + ''
    install -Dm444 vmlinux $out/vmlinux
    install -Dm444 .config $out/config
  '';
  passthru = (old.passthru or { }) // { inherit configfile; };
})
