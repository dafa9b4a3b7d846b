#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages agent-sandbox builds and tests with
# (run by `agent-sandbox up` / `image build` as root, and by .ci/run).
# Safe to run again: only missing packages are installed. It never removes
# a package: on a conflict with what is installed it stops, naming the
# package and what apt would remove (images/lib.sh apt_install). The one
# change to an installed package: qemu-utils follows qemu-system-x86's
# release (below).
set -euo pipefail
# shellcheck source=images/lib.sh
. "$(dirname "$0")/lib.sh"
LOG_TAG=deps
# PACKAGE or PACKAGE:COMMAND. With a command, the package counts as present
# when the command is on PATH: e.g. NodeSource's nodejs bundles npm and
# conflicts with Debian's npm package.
pkgs=(
  # VMs and images
  qemu-system-x86 mmdebstrap erofs-utils e2fsprogs busybox-static
  linux-source-6.1 flex bison libelf-dev bc
  # templates from users' images (agent-sandbox template build): registry
  # and archive transport, OCI layer unpacking, daemonless Dockerfile
  # builds with runc (crun refuses hybrid cgroup hosts)
  skopeo umoci buildah runc
  # a registry on loopback for the docker:// test (tests/template_build.rs)
  docker-registry
  # networking
  iproute2 nftables iptables
  # tests and checks: host python3 (wheel, MCP Python SDK venv,
  # schemathesis), node + npm (MCP TypeScript SDK), dig (DNS tests),
  # setpriv/dmesg (util-linux), kill (procps), nix + jq + git (.ci/nix-check)
  curl python3 python3-venv nodejs:node npm:npm dnsutils:dig
  util-linux procps nix-bin jq git strace
  # a real browser for the preview URL test (tests/rest_ports.rs)
  chromium
  # several hosts behind a router (tests/router.rs, `doctor --router`);
  # Debian's httpx lets that test run the Python SDK from its source
  haproxy python3-httpx
)
missing=()
for entry in "${pkgs[@]}"; do
  p=${entry%%:*} cmd=${entry#*:}
  if [ "$cmd" != "$entry" ] && command -v "$cmd" >/dev/null; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  [ "$(id -u)" -eq 0 ] || die "missing packages ${missing[*]} and not root to install them"
  apt-get update -q
  # A package this distribution lacks (Ubuntu has no linux-source-6.1) is
  # reported, not fatal: the step that needs it says what to do instead.
  avail=()
  for p in "${missing[@]}"; do
    if apt-cache show "$p" >/dev/null 2>&1; then avail+=("$p"); else echo "not available here: $p"; fi
  done
  # qemu-utils is part of QEMU: a qemu-utils of another release (Debian
  # images ship backports' qemu-img without qemu-system) blocks
  # qemu-system-x86, and apt would remove it. It is moved to the release
  # qemu-system-x86 installs, so qemu-img stays; nothing else is touched.
  extra=()
  if [[ " ${avail[*]} " == *" qemu-system-x86 "* ]] &&
    dpkg-query -W -f='${Status}' qemu-utils 2>/dev/null | grep -q "install ok installed"; then
    want=$(apt-cache policy qemu-system-x86 | awk '/Candidate:/ { print $2 }')
    have=$(dpkg-query -W -f='${Version}' qemu-utils)
    if [ -n "$want" ] && [ "$want" != "(none)" ] && [ "$have" != "$want" ]; then
      echo "qemu-utils $have is another QEMU release than qemu-system-x86 $want: installing qemu-utils $want beside it"
      extra=("qemu-utils=$want")
      export APT_ALLOW_DOWNGRADES=1
    fi
  fi
  echo "installing: ${avail[*]} ${extra[*]}"
  if ((${#avail[@]})); then apt_install "${avail[@]}" "${extra[@]}" || die "not installed: ${avail[*]} (see above)"; fi
else
  echo "all packages present"
fi
