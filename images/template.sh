#!/bin/bash
# Template files: validate and resolve.
#   template.sh validate [NAME|FILE ...]   check files (default: all templates)
#   template.sh resolve NAME|FILE          print the template with `extends`
#                                          applied (what the build uses),
#                                          without the listing fields
#                                          (display_name, version, tools)
#   template.sh list                       names of all templates
# The checks mirror templates/schema.json (jq only, so a bare Debian host
# can run them); test/run-tests.sh also checks the files against the
# schema itself when python3-jsonschema is present.
set -euo pipefail
LOG_TAG=template
. "$(dirname "$0")/lib.sh"
TEMPLATES_DIR=${AGENT_SANDBOX_TEMPLATES:-$IMAGES_DIR/templates}

template_file() {
	case $1 in
	*/* | *.json) echo "$1" ;;
	*) echo "$TEMPLATES_DIR/$1.json" ;;
	esac
}

# jq program: a list of problems with one template file (empty when valid).
read -r -d '' CHECK <<'JQ' || true
def name_ok: type == "string" and test("^[a-z0-9][a-z0-9_-]{0,31}$");
def strings: type == "array" and all(.[]; type == "string");
def int_in($lo; $hi): type == "number" and . == floor and . >= $lo and . <= $hi;
if type != "object" then ["not a JSON object"] else
  ( (["name","description","packages","env","setup","warm"] - keys) | map("missing field \(.)") )
  + ( (keys - ["name","display_name","version","description","tools","extends","packages","env","setup","warm","tests","memory_mib","vcpus","disk_mib"]) | map("unknown field \(.)") )
  + ( if has("name") and (.name | name_ok | not) then ["name must match ^[a-z0-9][a-z0-9_-]{0,31}$"]
      elif has("name") and .name != $stem then ["name \(.name) differs from file name \($stem)"] else [] end )
  + ( if has("description") and ((.description | type) != "string" or .description == "") then ["description must be a non-empty string"] else [] end )
  + ( if has("display_name") and ((.display_name | type) != "string" or .display_name == "") then ["display_name must be a non-empty string"] else [] end )
  + ( if has("version") and ((.version | type) != "string" or (.version | test("^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$") | not)) then ["version must match ^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$"] else [] end )
  + ( if has("tools") and (.tools | strings | not) then ["tools must be an array of strings"]
      elif has("tools") then (.tools | map(select(test("^[A-Za-z0-9][A-Za-z0-9+._-]{0,63}$") | not)) | map("bad tool name \(.)")) else [] end )
  + ( if has("extends") and (.extends | name_ok | not) then ["extends must be a template name"] else [] end )
  + ( if has("packages") and (.packages | strings | not) then ["packages must be an array of strings"]
      elif has("packages") then (.packages | map(select(test("^[a-z0-9][a-z0-9+.-]+$") | not)) | map("bad package name \(.)")) else [] end )
  + ( if has("env") and ((.env | type) != "object") then ["env must be an object"]
      elif has("env") then (.env | to_entries | map(
          (if (.key | test("^[A-Za-z_][A-Za-z0-9_]*$")) then [] else ["bad env name \(.key)"] end)
          + (if (.value | type) == "string" then [] else ["env \(.key) must be a string"] end)) | add // [])
      else [] end )
  + ( if has("setup") and (.setup | strings | not) then ["setup must be an array of strings"] else [] end )
  + ( if has("warm") and (.warm | strings | not) then ["warm must be an array of strings"] else [] end )
  + ( if has("tests") and (.tests | strings | not) then ["tests must be an array of strings"] else [] end )
  + ( if has("memory_mib") and (.memory_mib | int_in(128; 65536) | not) then ["memory_mib must be an integer in 128..65536"] else [] end )
  + ( if has("vcpus") and (.vcpus | int_in(1; 32) | not) then ["vcpus must be an integer in 1..32"] else [] end )
  + ( if has("disk_mib") and (.disk_mib | int_in(64; 1048576) | not) then ["disk_mib must be an integer in 64..1048576"] else [] end )
end
JQ

validate_one() {
	local f stem problems
	f=$(template_file "$1")
	[ -f "$f" ] || { log "$f: no such template"; return 1; }
	stem=$(basename "$f" .json)
	if ! problems=$(jq -r --arg stem "$stem" "$CHECK | .[]" "$f" 2>&1); then
		log "$f: not valid JSON: $problems"
		return 1
	fi
	if [ -n "$problems" ]; then
		while IFS= read -r p; do log "$f: $p"; done <<<"$problems"
		return 1
	fi
}

# The fields only listings read (the daemon, from the template files): left
# out of what the build sees, so editing them neither changes the image's
# hash (its cache key) nor makes every snapshot of it stale.
LISTING='del(.display_name, .version, .tools)'

# Print the resolved template: parent first, then this file's additions.
resolve() {
	local f depth=${2:-0} parent
	f=$(template_file "$1")
	validate_one "$f" || die "invalid template $f"
	[ "$depth" -lt 8 ] || die "extends chain too deep at $f (a cycle?)"
	parent=$(jq -r '.extends // empty' "$f")
	if [ -z "$parent" ]; then
		jq -S "$LISTING"' | . + {chain: [.name], tests: (.tests // [])}' "$f"
		return
	fi
	resolve "$(dirname "$f")/$parent.json" $((depth + 1)) | jq -S --slurpfile c "$f" '
		. as $p | $c[0] as $c |
		($p + ($c | del(.extends) | '"$LISTING"')) + {
			packages: (($p.packages + $c.packages) | reduce .[] as $x ([]; if index([$x]) then . else . + [$x] end)),
			env: ($p.env + $c.env),
			setup: ($p.setup + $c.setup),
			warm: ($p.warm + $c.warm),
			tests: (($p.tests // []) + ($c.tests // [])),
			chain: ($p.chain + [$c.name])
		}'
}

cmd=${1:-validate}
shift || true
case $cmd in
validate)
	[ $# -gt 0 ] || set -- "$TEMPLATES_DIR"/*.json
	rc=0
	for t in "$@"; do
		[ "$(basename "$t")" = schema.json ] && continue
		if validate_one "$t"; then
			# Also resolve, which checks the extends chain.
			resolve "$t" >/dev/null || rc=1
			echo "ok $(template_file "$t")"
		else
			rc=1
		fi
	done
	exit $rc
	;;
resolve) resolve "${1:?template}" ;;
list)
	for f in "$TEMPLATES_DIR"/*.json; do
		[ "$(basename "$f")" = schema.json ] || basename "$f" .json
	done
	;;
*) die "usage: template.sh validate [T...] | resolve T | list" ;;
esac
