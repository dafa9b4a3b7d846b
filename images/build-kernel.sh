#!/bin/bash
# Build the agent-sandbox guest kernel (uncompressed ELF vmlinux) from
# Debian's linux-source-6.1 plus images/kernel/agent-sandbox.config.
#
# Output: $CACHE/kernel/vmlinux-<hash> (+ config-<hash>, vmlinux-<hash>.json)
# where <hash> covers the fragment, this script, the config verifier, the
# linux-source package version and the compiler. The build tree lives at a
# fixed path ($CACHE/kernel/tree) because objtool embeds absolute paths: a
# moved tree rebuilds from scratch. The path of the result is printed on
# stdout; a second run with nothing changed only prints it.
set -euo pipefail
LOG_TAG=kernel
. "$(dirname "$0")/lib.sh"

FRAGMENT=$IMAGES_DIR/kernel/agent-sandbox.config
VERIFY=$IMAGES_DIR/kernel/verify-config.sh
KDIR=$CACHE_DIR/kernel
SRC_PKG=linux-source-6.1
# Debian's package by default. Elsewhere (Ubuntu has no linux-source-6.1)
# point AGENT_SANDBOX_KERNEL_SOURCE at a copy of the same tarball, whose top
# directory is linux-source-6.1/.
SRC_TAR=${AGENT_SANDBOX_KERNEL_SOURCE:-/usr/src/linux-source-6.1.tar.xz}

ensure_packages build-essential flex bison libelf-dev libssl-dev bc xz-utils jq
if [ -n "${AGENT_SANDBOX_KERNEL_SOURCE:-}" ]; then
	[ -f "$SRC_TAR" ] || die "AGENT_SANDBOX_KERNEL_SOURCE=$SRC_TAR: no such file"
	src_version=sha256:$(sha256sum <"$SRC_TAR" | cut -c1-16)
else
	ensure_packages "$SRC_PKG"
	src_version=$(dpkg-query -W -f='${Version}' "$SRC_PKG")
fi
mkdir -p "$KDIR"

cc_version=$(gcc --version | head -n1)
hash=$(hash_inputs "$FRAGMENT" "$0" "$VERIFY" -- "$SRC_PKG=$src_version" "$cc_version")
out=$KDIR/vmlinux-$hash

if [ -f "$out" ] && [ -f "$out.json" ]; then
	log "up to date: $out"
	echo "$out"
	exit 0
fi

# One build at a time per cache (the tree is shared).
exec 9>"$KDIR/.lock"
flock 9
if [ -f "$out" ] && [ -f "$out.json" ]; then echo "$out"; exit 0; fi

t0=$SECONDS
tree=$KDIR/tree/linux-source-6.1
stamp=$KDIR/tree/.source-version
if [ ! -d "$tree" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$src_version" ]; then
	log "unpacking $SRC_TAR ($src_version)"
	rm -rf "$KDIR/tree"
	mkdir -p "$KDIR/tree"
	tar -C "$KDIR/tree" -xJf "$SRC_TAR"
	echo "$src_version" >"$stamp"
fi

# Fixed build identity so the same inputs give the same vmlinux.
export KBUILD_BUILD_USER=agent-sandbox KBUILD_BUILD_HOST=agent-sandbox
export KBUILD_BUILD_TIMESTAMP="$(date -u -d @"$(stat -c %Y "$SRC_TAR")")"
export KBUILD_BUILD_VERSION=1
mk=(make -C "$tree" ARCH=x86_64 -s)

log "configuring: tinyconfig + $(basename "$FRAGMENT")"
"${mk[@]}" tinyconfig >"$KDIR/config.log" 2>&1 || { cat "$KDIR/config.log" >&2; die "tinyconfig failed"; }
(cd "$tree" && ARCH=x86_64 scripts/kconfig/merge_config.sh -m .config "$FRAGMENT") >>"$KDIR/config.log" 2>&1 ||
	{ cat "$KDIR/config.log" >&2; die "merge_config failed"; }
"${mk[@]}" olddefconfig >>"$KDIR/config.log" 2>&1 || { cat "$KDIR/config.log" >&2; die "olddefconfig failed"; }
"$VERIFY" "$FRAGMENT" "$tree/.config" >&2

jobs=$(nproc)
log "building vmlinux with $jobs jobs (about 7 min on 2 cores from scratch; log: $KDIR/build.log)"
run_logged "$KDIR/build.log" make -C "$tree" ARCH=x86_64 -j"$jobs" vmlinux

cp "$tree/.config" "$KDIR/config-$hash"
cp "$tree/vmlinux" "$out.tmp"
mv "$out.tmp" "$out"
release=$(cat "$tree/include/config/kernel.release")
cat >"$out.json" <<JSON
{
  "kind": "kernel",
  "path": $(json_str "$out"),
  "hash": "$hash",
  "release": $(json_str "$release"),
  "source_package": $(json_str "$SRC_PKG=$src_version"),
  "compiler": $(json_str "$cc_version"),
  "fragment_sha256": "$(sha256sum <"$FRAGMENT" | cut -d' ' -f1)",
  "vmlinux_sha256": "$(sha256sum <"$out" | cut -d' ' -f1)",
  "size_bytes": $(stat -c %s "$out"),
  "build_seconds": $((SECONDS - t0)),
  "built_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
JSON
log "built $out ($release, $(($(stat -c %s "$out") / 1024 / 1024)) MiB) in $((SECONDS - t0)) s"
echo "$out"
