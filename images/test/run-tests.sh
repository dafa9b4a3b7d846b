#!/bin/bash
# Fast checks of the image tooling that need no build (seconds, no root):
# template validation (jq checks and the JSON schema agree on good and bad
# files), extends resolution, and the kernel config verifier.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
pass() { echo "ok   $*"; }
bad() { echo "FAIL $*"; fail=1; }

# 1. The shipped templates are valid.
if "$here/template.sh" validate >/dev/null 2>&1; then pass "shipped templates validate"; else bad "shipped templates"; fi

# 2. Broken templates are rejected, each for its own reason.
mkdir "$tmp/t"
cp "$here/templates/base.json" "$tmp/t/base.json"
mk() { jq "$2" "$here/templates/python.json" >"$tmp/t/$1.json"; }
mk badname '.name = "other"'
mk badpkg '.packages += ["Not A Package"]'
mk badenv '.env["1X"] = "y"'
mk envnum '.env.X = 1'
mk unknown '.colour = "blue"'
mk nowarm 'del(.warm)'
mk badmem '.memory_mib = 12.5'
mk badtools '.tools = ["ok", 1]'
mk badversion '.version = "1 0"'
mk nodisplay '.display_name = ""'
mk noparent '.extends = "missing"'
echo '{"name": ' >"$tmp/t/notjson.json"
for t in badname badpkg badenv envnum unknown nowarm badmem badtools badversion nodisplay noparent notjson; do
	if AGENT_SANDBOX_TEMPLATES=$tmp/t "$here/template.sh" validate "$t" >/dev/null 2>&1; then
		bad "template $t accepted"
	else
		pass "template $t rejected"
	fi
done

# 3. The JSON schema says the same (when python3-jsonschema is installed).
if python3 -c 'import jsonschema' 2>/dev/null; then
	if python3 - "$here/templates" "$tmp/t" <<'PY'; then pass "schema agrees"; else bad "schema disagrees"; fi
import glob, json, os, sys
import jsonschema
tdir, bad_dir = sys.argv[1], sys.argv[2]
schema = json.load(open(os.path.join(tdir, "schema.json")))
jsonschema.Draft202012Validator.check_schema(schema)
v = jsonschema.Draft202012Validator(schema)
ok = True
for f in glob.glob(os.path.join(tdir, "*.json")):
    if f.endswith("schema.json"):
        continue
    errs = list(v.iter_errors(json.load(open(f))))
    if errs:
        print(f, errs[0].message); ok = False
# Schema-level faults (not name/file or extends, which need context).
for name in ["badpkg", "badenv", "envnum", "unknown", "nowarm", "badmem", "badtools", "badversion", "nodisplay"]:
    if not list(v.iter_errors(json.load(open(os.path.join(bad_dir, name + ".json"))))):
        print("schema accepted", name); ok = False
sys.exit(0 if ok else 1)
PY
else
	echo "skip schema check (no python3-jsonschema)"
fi

# 4. extends: packages/setup/warm appended, env merged, child wins.
r=$("$here/template.sh" resolve python)
if jq -e '.packages[0] == "bash" and (.packages | index("python3")) and .env.LANG == "C.UTF-8"
	and .env.PIP_ROOT_USER_ACTION == "ignore" and .chain == ["base","python"] and (.warm | length) == 4
	and (has("extends") | not)' <<<"$r" >/dev/null; then pass "extends resolution"; else bad "extends resolution"; fi

# 4b. The listing fields are not build inputs: editing them changes nothing
# the build sees (so no image or snapshot is rebuilt for them).
jq '.display_name = "Other" | .version = "9" | .tools = ["x"]' "$here/templates/python.json" >"$tmp/t/python.json"
r2=$(AGENT_SANDBOX_TEMPLATES=$tmp/t "$here/template.sh" resolve python)
if [ "$r" = "$r2" ] && jq -e 'has("display_name") or has("version") or has("tools") | not' <<<"$r" >/dev/null; then
	pass "listing fields are not build inputs"
else
	bad "listing fields reach the build"
fi

# 5. The config verifier catches a dropped option and a forced-off one.
frag=$here/kernel/agent-sandbox.config
grep -E '^CONFIG_' "$frag" >"$tmp/good.config"
if "$here/kernel/verify-config.sh" "$frag" "$tmp/good.config" >/dev/null 2>&1; then pass "verifier accepts a matching config"; else bad "verifier rejects a matching config"; fi
grep -v '^CONFIG_EROFS_FS=y' "$tmp/good.config" >"$tmp/dropped.config"
if "$here/kernel/verify-config.sh" "$frag" "$tmp/dropped.config" >/dev/null 2>&1; then bad "verifier missed a dropped EROFS_FS"; else pass "verifier catches a dropped option"; fi
{ cat "$tmp/good.config"; echo CONFIG_MODULES=y; } >"$tmp/mod.config"
if "$here/kernel/verify-config.sh" "$frag" "$tmp/mod.config" >/dev/null 2>&1; then bad "verifier missed MODULES=y"; else pass "verifier catches an option that must be off"; fi

exit $fail
