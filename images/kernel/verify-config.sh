#!/bin/bash
# Usage: verify-config.sh FRAGMENT DOTCONFIG
# Fails if any option in FRAGMENT does not hold in DOTCONFIG. `make
# olddefconfig` silently drops options whose dependencies are off (e.g.
# EROFS_FS without MISC_FILESYSTEMS), so a build must not trust the merge.
set -euo pipefail
frag=${1:?fragment}
cfg=${2:?.config}
bad=0
while IFS= read -r line; do
	if [[ $line =~ ^(CONFIG_[A-Za-z0-9_]+)=(.*)$ ]]; then
		name=${BASH_REMATCH[1]}
		if ! grep -qxF -- "$line" "$cfg"; then
			have=$(grep -E "^(# )?${name}[= ]" "$cfg" || echo "(absent)")
			echo "verify-config: wanted '$line', got '$have'" >&2
			bad=1
		fi
	elif [[ $line =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
		name=${BASH_REMATCH[1]}
		if grep -qE "^${name}=" "$cfg"; then
			echo "verify-config: wanted '$name' off, got '$(grep -E "^${name}=" "$cfg")'" >&2
			bad=1
		fi
	fi
done <"$frag"
if [ "$bad" -ne 0 ]; then
	echo "verify-config: $frag did not survive olddefconfig (see above)" >&2
	exit 1
fi
echo "verify-config: all $(grep -cE '^(CONFIG_|# CONFIG_.* is not set)' "$frag") options of $(basename "$frag") hold"
