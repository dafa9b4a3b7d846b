# The read-only root filesystem of one template, as an erofs image
# (mkfs.erofs -zlz4hc -T0 --all-root, like images/build-rootfs.sh).
#
# The Debian build installs the template's Debian packages with mmdebstrap;
# here the same list is translated to nixpkgs packages (debian-packages.nix)
# and the image holds their Nix store closure, with /bin (and /usr/bin,
# /usr/sbin) pointing at one merged profile. What the guest agent relies on
# is laid out as in the Debian image: /sbin/sandbox-agent (init), /workspace,
# /etc/hostname, /etc/hosts, an empty /etc/resolv.conf (the agent fills it
# on its writable overlay), /etc/agent-sandbox/template.json.
{ lib
, runCommand
, buildEnv
, closureInfo
, writeText
, erofs-utils
, proot
, bashInteractive
, coreutils
, findutils
, gnugrep
, gnused
, gawk
, gzip
, gnutar
, diffutils
, which
, cacert
, sandbox-agent
, # a resolved template (templates.nix)
  template
, # the template's packages, already mapped to nixpkgs
  packages
}:
let
  inherit (template) name;

  # What Debian's minbase variant brings without being asked (its Essential
  # packages), so that template commands find the usual tools.
  essential = [ bashInteractive coreutils findutils gnugrep gnused gawk gzip gnutar diffutils which cacert ];

  profile = buildEnv {
    name = "agent-sandbox-${name}-profile";
    paths = essential ++ packages;
    pathsToLink = [ "/bin" "/etc" "/lib" "/share" ];
    ignoreCollisions = true;
  };

  closure = closureInfo { rootPaths = [ profile ]; };

  templateJson = writeText "template-${name}.json" (builtins.toJSON template);

  setupScript = writeText "setup-${name}.sh" (lib.concatLines ([ "set -e" ] ++ template.setup));

  # A stable filesystem UUID per template content, as the Debian build
  # derives one from its input hash.
  h = builtins.hashString "sha256" "${name}:${builtins.toJSON template}";
  uuid = lib.concatStringsSep "-" (map (r: builtins.substring r.o r.n h) [
    { o = 0; n = 8; }
    { o = 8; n = 4; }
    { o = 12; n = 4; }
    { o = 16; n = 4; }
    { o = 20; n = 12; }
  ]);
in
runCommand "agent-sandbox-rootfs-${name}"
{
  nativeBuildInputs = [ erofs-utils proot ];
  passthru = { inherit template profile uuid; };
  meta.description = "agent-sandbox root filesystem for the ${name} template";
} ''
  root=$PWD/root
  mkdir -p $root/nix/store $root/etc/agent-sandbox $root/sbin $root/usr/local/bin \
    $root/workspace $root/root $root/tmp $root/var/tmp $root/proc $root/sys $root/dev $root/run $root/mnt
  chmod 1777 $root/tmp $root/var/tmp
  xargs -a ${closure}/store-paths cp -a --target-directory=$root/nix/store

  ln -s ${profile}/bin $root/bin
  ln -s /bin $root/usr/bin
  ln -s /bin $root/usr/sbin
  install -m 0755 ${sandbox-agent}/bin/sandbox-agent $root/sbin/sandbox-agent

  echo sandbox > $root/etc/hostname
  printf '127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n' > $root/etc/hosts
  : > $root/etc/resolv.conf
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > $root/etc/passwd
  printf 'root:x:0:\nnogroup:x:65534:\n' > $root/etc/group
  mkdir -p $root/etc/ssl/certs
  ln -s ${cacert}/etc/ssl/certs/ca-bundle.crt $root/etc/ssl/certs/ca-certificates.crt
  ln -s /etc/ssl/certs/ca-certificates.crt $root/etc/ssl/cert.pem
  cp ${templateJson} $root/etc/agent-sandbox/template.json

  # The template's setup commands, inside the tree as its root, as the
  # Debian build runs them in a chroot. proot needs no privileges.
  if [ ${toString (builtins.length template.setup)} -gt 0 ]; then
    cp ${setupScript} $root/tmp/setup.sh
    PROOT_NO_SECCOMP=1 proot -0 -r $root -b /proc -b /dev -w / /bin/sh -e /tmp/setup.sh
    rm -f $root/tmp/setup.sh
  fi

  mkdir -p $out
  # -T0 pins every inode time; SOURCE_DATE_EPOCH would override it.
  env -u SOURCE_DATE_EPOCH mkfs.erofs -zlz4hc -T0 --all-root -U${uuid} $out/rootfs.erofs $root
  cp ${templateJson} $out/template.json
  cp ${closure}/store-paths $out/store-paths
''
