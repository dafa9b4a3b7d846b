# Shared helpers for the image build scripts (sourced, not executed).

IMAGES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE_DIR=${AGENT_SANDBOX_CACHE:-/var/cache/agent-sandbox}

log() { printf '%s [%s] %s\n' "$(date -u +%H:%M:%S)" "${LOG_TAG:-images}" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# sha256 of the named files' contents plus extra strings, shortened to 16 hex
# digits: the cache key of an artifact.
hash_inputs() {
	local files=() extra=()
	while [ $# -gt 0 ]; do
		if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
		files+=("$1"); shift
	done
	{
		for f in "${files[@]}"; do
			printf "file\n"
			sha256sum <"$f"
		done
		for e in "${extra[@]}"; do printf 'extra %s\n' "$e"; done
	} | sha256sum | cut -c1-16
}

# Install the Debian packages given as arguments that are missing. Runs
# apt-get only when something is missing, so a second run is silent.
ensure_packages() {
	local missing=() p
	for p in "$@"; do
		if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
			missing+=("$p")
		fi
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	[ "$(id -u)" -eq 0 ] || die "missing packages ${missing[*]} and not root to install them"
	log "installing build dependencies: ${missing[*]}"
	if ! apt_install "${missing[@]}" >&2; then
		apt-get update -q >&2
		apt_install "${missing[@]}" >&2 || die "cannot install ${missing[*]} (see above)"
	fi
}

# apt-get install that never removes a package (a user's newer QEMU, a
# node from another source): with --no-remove apt stops instead. On a
# failure it says which of the requested packages cannot be installed as
# things are, what apt would remove for it, and what to do; returns 1.
apt_install() {
	local p bad=0
	export DEBIAN_FRONTEND=noninteractive
	local down=()
	# Only for a caller that pins a version on purpose (install-deps.sh).
	[ "${APT_ALLOW_DOWNGRADES:-}" = 1 ] && down=(--allow-downgrades)
	apt-get install -y -q --no-install-recommends --no-remove "${down[@]}" "$@" && return 0
	echo "apt-get could not install: $*" >&2
	for p in "$@"; do
		# -s: a simulation, changes nothing.
		apt-get install -s -q --no-install-recommends --no-remove "${down[@]}" "$p" >/dev/null 2>&1 && continue
		bad=1
		local removes
		removes=$(apt-get install -s -q --no-install-recommends "$p" 2>/dev/null | awk '/^Remv / { printf " %s", $2 }')
		if [ -n "$removes" ]; then
			echo "  $p: installing it would remove:$removes" >&2
		else
			echo "  $p: conflicts with what is installed:" >&2
			apt-get install -s -q --no-install-recommends "$p" 2>&1 | grep -E '^ |^E:' | sed 's/^ */    /' >&2 || true
		fi
	done
	if [ "$bad" = 1 ]; then
		cat >&2 <<-EOF
			Nothing was removed. Either install the packages above yourself, accepting
			what apt removes (apt-get install PACKAGE), or provide what they provide
			another way, then run this again.
		EOF
	fi
	return 1
}

# The last progress message of a log: tools redraw lines with \r or ESC[K.
last_line() {
	tail -n1 "$1" | tr '\r' '\n' | tail -n1 | sed -E 's/(\x1b\[K)+$//; s/.*\x1b\[K//' | tr -cd '[:print:]' | cut -c1-100
}

# Run "$@" with its output in LOGFILE; print a heartbeat every 30 s so a long
# step shows it is alive; on failure show the log's tail.
run_logged() {
	local logfile=$1; shift
	local start=$SECONDS pid rc
	"$@" >"$logfile" 2>&1 &
	pid=$!
	while kill -0 "$pid" 2>/dev/null; do
		for _ in $(seq 30); do
			sleep 1
			kill -0 "$pid" 2>/dev/null || break
		done
		if kill -0 "$pid" 2>/dev/null; then
			log "... still running ($((SECONDS - start)) s): $(last_line "$logfile")"
		fi
	done
	rc=0
	wait "$pid" || rc=$?
	if [ "$rc" -ne 0 ]; then
		tail -n 40 "$logfile" >&2
		die "step failed (exit $rc), full log: $logfile"
	fi
}

# JSON string escaping for the few values the manifests carry.
json_str() {
	local s=$1
	s=${s//\\/\\\\}; s=${s//\"/\\\"}
	printf '"%s"' "$s"
}
