#!/bin/bash
# Build whatever is missing of the guest kernel and the template images.
#   build.sh --agent PATH [--template T ...] [--smoke]
# Default templates: every file in images/templates/. Idempotent: artifacts
# are keyed by their inputs under ${AGENT_SANDBOX_CACHE:-/var/cache/agent-sandbox},
# so a second run only checks hashes. Runs non-interactively as root on
# Debian 12 / Ubuntu and installs its build dependencies with apt-get.
# The last lines on stdout are machine-readable:
#   kernel=/path/vmlinux-<hash>
#   rootfs.<template>=/path/<template>-<hash>.erofs
set -euo pipefail
LOG_TAG=build
. "$(dirname "$0")/lib.sh"

usage() { echo "usage: build.sh --agent PATH [--template T ...] [--smoke]" >&2; exit 2; }
agent=
templates=()
smoke=0
while [ $# -gt 0 ]; do
	case $1 in
	--agent) agent=${2:-}; shift 2 || usage ;;
	--template) templates+=("${2:-}"); shift 2 || usage ;;
	--smoke) smoke=1; shift ;;
	-h | --help) usage ;;
	*) echo "unknown argument $1" >&2; usage ;;
	esac
done
[ -n "$agent" ] || usage
[ -f "$agent" ] || die "agent binary $agent: no such file"
[ "$(id -u)" -eq 0 ] || die "build.sh runs as root (mmdebstrap --mode=root)"
agent=$(readlink -f "$agent")
if [ ${#templates[@]} -eq 0 ]; then
	mapfile -t templates < <("$IMAGES_DIR/template.sh" list)
fi

t0=$SECONDS
log "templates: ${templates[*]}; cache: $CACHE_DIR"
"$IMAGES_DIR/template.sh" validate "${templates[@]}" >/dev/null

# The kernel build is CPU-bound and mmdebstrap mostly waits on the network
# and dpkg, so run the kernel in the background while the images build.
klog=$(mktemp)
"$IMAGES_DIR/build-kernel.sh" >"$klog.out" 2> >(tee "$klog" >&2) &
kpid=$!

declare -A rootfs
for t in "${templates[@]}"; do
	rootfs[$t]=$("$IMAGES_DIR/build-rootfs.sh" "$t" "$agent")
done

kernel_rc=0
wait "$kpid" || kernel_rc=$?
kernel=$(tail -n1 "$klog.out")
rm -f "$klog" "$klog.out"
[ "$kernel_rc" -eq 0 ] && [ -f "$kernel" ] || die "kernel build failed"

if [ "$smoke" -eq 1 ]; then
	for t in "${templates[@]}"; do
		"$IMAGES_DIR/smoke-test.sh" "$kernel" "${rootfs[$t]}" >&2
	done
fi

log "done in $((SECONDS - t0)) s"
echo "kernel=$kernel"
for t in "${templates[@]}"; do
	echo "rootfs.$t=${rootfs[$t]}"
done
