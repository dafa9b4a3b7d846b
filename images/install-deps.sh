#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages agent-sandbox builds and tests with.
# Safe to run again: only missing packages are installed.
set -euo pipefail
pkgs=(
  # VMs and images
  qemu-system-x86 mmdebstrap erofs-utils e2fsprogs busybox-static
  linux-source-6.1 flex bison libelf-dev bc
  # networking
  iproute2 nftables iptables
  # tests and checks
  curl python3 python3-venv nix-bin strace
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # A package this distribution lacks (Ubuntu has no linux-source-6.1) is
  # reported, not fatal: the step that needs it says what to do instead.
  avail=()
  for p in "${missing[@]}"; do
    if apt-cache show "$p" >/dev/null 2>&1; then avail+=("$p"); else echo "not available here: $p"; fi
  done
  echo "installing: ${avail[*]}"
  if ((${#avail[@]})); then apt-get install -y -q --no-install-recommends "${avail[@]}"; fi
else
  echo "all packages present"
fi
