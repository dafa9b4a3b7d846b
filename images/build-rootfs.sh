#!/bin/bash
# Build the read-only root filesystem of one template as an erofs image.
#   build-rootfs.sh TEMPLATE AGENT_BINARY
# TEMPLATE is a name in images/templates/ or a path to a template file.
# Output: $CACHE/rootfs/<name>-<hash>.erofs plus <name>-<hash>.erofs.json,
# where <hash> covers the resolved template, the agent binary and this
# script. Prints the image path on stdout; a second run with the same inputs
# only prints it. Debian packages come from the live bookworm mirror, so the
# same hash built on two different days may hold different package versions;
# the manifest records the package list of each build.
set -euo pipefail
LOG_TAG=rootfs
. "$(dirname "$0")/lib.sh"

template=${1:?usage: build-rootfs.sh TEMPLATE AGENT_BINARY}
agent=${2:?usage: build-rootfs.sh TEMPLATE AGENT_BINARY}
[ -f "$agent" ] || die "agent binary $agent: no such file"
agent=$(readlink -f "$agent")
[ "$(id -u)" -eq 0 ] || die "build-rootfs.sh runs as root (mmdebstrap --mode=root, mkfs.erofs --all-root)"

ensure_packages mmdebstrap erofs-utils jq debian-archive-keyring ca-certificates

# A fixed build time: mmdebstrap makes the tree reproducible from it and
# mkfs.erofs -T0 pins every inode time.
EPOCH=1735689600 # 2025-01-01T00:00:00Z
MIRROR=${AGENT_SANDBOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${AGENT_SANDBOX_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

resolved=$("$IMAGES_DIR/template.sh" resolve "$template")
name=$(jq -r .name <<<"$resolved")
agent_sha=$(sha256sum <"$agent" | cut -d' ' -f1)
hash=$(hash_inputs "$0" "$agent" -- "$(jq -cS . <<<"$resolved")" "mirror=$MIRROR $SECURITY_MIRROR")
RDIR=$CACHE_DIR/rootfs
out=$RDIR/$name-$hash.erofs
LOG_TAG=rootfs:$name

if [ -f "$out" ] && [ -f "$out.json" ]; then
	log "up to date: $out"
	echo "$out"
	exit 0
fi
mkdir -p "$RDIR"
exec 9>"$RDIR/.lock-$name"
flock 9
if [ -f "$out" ] && [ -f "$out.json" ]; then echo "$out"; exit 0; fi

t0=$SECONDS
work=$(mktemp -d "$RDIR/work-$name-XXXXXX")
cleanup() {
	# mmdebstrap unmounts what it mounted; be safe before deleting anyway.
	if [ -d "$work/root" ]; then
		for m in $(findmnt -rn -o TARGET | grep -F "$work/root" | sort -r); do umount -l "$m" 2>/dev/null || true; done
	fi
	rm -rf "$work"
	rm -f "$out.tmp"
}
trap cleanup EXIT
root=$work/root

# The template's setup commands, run inside the chroot in order.
{
	echo "set -e"
	jq -r '.setup[]' <<<"$resolved"
} >"$work/setup.sh"

packages=$(jq -r '.packages | join(",")' <<<"$resolved")
keyring=()
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] && keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)

log "mmdebstrap bookworm minbase + $packages"
run_logged "$work/mmdebstrap.log" env SOURCE_DATE_EPOCH=$EPOCH mmdebstrap \
	--mode=root --variant=minbase --format=directory "${keyring[@]}" \
	--include="$packages" \
	--dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/info/*' \
	--dpkgopt='path-exclude=/usr/share/doc/*' \
	--dpkgopt='path-include=/usr/share/doc/*/copyright' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	--dpkgopt='path-include=/usr/share/locale/locale.alias' \
	--dpkgopt='path-exclude=/usr/share/lintian/*' \
	--customize-hook="upload $work/setup.sh /tmp/agent-sandbox-setup.sh" \
	--customize-hook='chroot "$1" /bin/sh /tmp/agent-sandbox-setup.sh' \
	--customize-hook='rm -f "$1/tmp/agent-sandbox-setup.sh"' \
	--customize-hook='chroot "$1" dpkg-query -W -f "\${Package}=\${Version}\n" > "$1/.packages"' \
	bookworm "$root" \
	"deb $MIRROR bookworm main" \
	"deb $MIRROR bookworm-updates main" \
	"deb $SECURITY_MIRROR bookworm-security main"
log "debootstrapped in $((SECONDS - t0)) s"

# What the guest agent relies on (see docs/images.md, "Image layout").
mv "$root/.packages" "$work/packages.txt"
install -D -m 0755 "$agent" "$root/sbin/sandbox-agent"
install -d -m 0755 "$root/workspace" "$root/etc/agent-sandbox"
echo sandbox >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
# The root is read-only; the agent overlays a writable layer and fills this.
rm -f "$root/etc/resolv.conf"
: >"$root/etc/resolv.conf"
jq -S . <<<"$resolved" >"$root/etc/agent-sandbox/template.json"
# Leftovers that cost space and are not needed at run time.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
	"$root"/var/log/* "$root"/tmp/* "$root"/var/tmp/*
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true

tree_bytes=$(du -sb "$root" | cut -f1)
files=$(find "$root" -xdev | wc -l)
uuid=$(printf '%s' "$name-$hash" | sha256sum | sed -E 's/^(.{8})(.{4})(.{4})(.{4})(.{12}).*/\1-\2-\3-\4-\5/')
t1=$SECONDS
log "mkfs.erofs lz4hc of $((tree_bytes / 1024 / 1024)) MiB, $files files"
run_logged "$work/mkfs.log" env -u SOURCE_DATE_EPOCH mkfs.erofs -zlz4hc -T0 --all-root -U"$uuid" "$out.tmp" "$root"
mv "$out.tmp" "$out"

jq -n -S \
	--arg path "$out" --arg hash "$hash" --arg uuid "$uuid" \
	--arg agent "$agent" --arg agent_sha "$agent_sha" \
	--arg sha "$(sha256sum <"$out" | cut -d' ' -f1)" \
	--argjson size "$(stat -c %s "$out")" --argjson tree "$tree_bytes" --argjson files "$files" \
	--argjson secs $((SECONDS - t0)) --argjson mkfs_secs $((SECONDS - t1)) \
	--arg built "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
	--argjson template "$resolved" \
	--rawfile pkgs "$work/packages.txt" '{
		kind: "rootfs", format: "erofs", path: $path, hash: $hash, uuid: $uuid,
		template: $template, agent: {path: $agent, sha256: $agent_sha},
		image_sha256: $sha, size_bytes: $size, tree_bytes: $tree, files: $files,
		build_seconds: $secs, mkfs_seconds: $mkfs_secs, built_at: $built,
		packages: ($pkgs | split("\n") | map(select(. != "")))
	}' >"$out.json"
log "built $out ($(($(stat -c %s "$out") / 1024 / 1024)) MiB) in $((SECONDS - t0)) s"
echo "$out"
