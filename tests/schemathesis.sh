#!/usr/bin/env bash
# Runs schemathesis against docs/openapi.yaml and a live `agent-sandbox
# serve`, bounded, with every conformance check: any 5xx, status code,
# content type, header or body the spec does not describe, schema-valid
# input refused or invalid input accepted, auth not enforced, undeclared
# methods not answered 405 + Allow. Any finding fails (exit non-zero).
# Starts and stops the server itself. Ends with one line for `.ci/run`:
#   schemathesis: N operations, M examples, K failures
#
#   tests/schemathesis.sh [extra schemathesis args]
#
# Env: MAX_EXAMPLES (default 20), SCHEMATHESIS (path to the CLI; default:
# `schemathesis` on PATH, else a venv in target/st-venv is created),
# BACKEND (default qemu: sessions are VMs, guest images from `agent-sandbox
# image build`; local-process runs generated commands on this host, so the
# daemon then runs as `nobody` when started as root, in a throwaway state
# dir).
#
# Bounded for a 2-core TCG host: one worker; every `{session}` is the one
# session `st` made up front (one VM, reused by every operation), and the
# daemon allows at most 1 vCPU / 512 MiB / 2 sessions per key, so generated
# creates are small or refused (429 quota_exceeded, 400 invalid_shape).
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_EXAMPLES=${MAX_EXAMPLES:-20}
BACKEND=${BACKEND:-qemu}

ST=${SCHEMATHESIS:-$(command -v schemathesis || true)}
if [ -z "$ST" ]; then
    if [ ! -x target/st-venv/bin/schemathesis ]; then
        python3 -m venv target/st-venv
        target/st-venv/bin/pip install -q schemathesis
    fi
    ST=target/st-venv/bin/schemathesis
fi

cargo build -q --bin agent-sandbox
cargo build -q -p sandbox-agent --bin sandbox-agent
BIN=target/debug/agent-sandbox
AGENT=target/debug/sandbox-agent

STATE=$(mktemp -d /tmp/sbx-schemathesis.XXXXXX)
OUT="$STATE/stdout"
RUNAS=()
BACKEND_ARGS=(--backend "$BACKEND")
if [ "$BACKEND" = local-process ]; then
    BACKEND_ARGS+=(--agent-bin "$AGENT")
    if [ "$(id -u)" = 0 ]; then
        # Copy the binaries where nobody can run them.
        cp "$BIN" "$AGENT" "$STATE/"
        BIN="$STATE/agent-sandbox"
        BACKEND_ARGS=(--backend "$BACKEND" --agent-bin "$STATE/sandbox-agent")
        chown -R nobody:nogroup "$STATE"
        RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all)
    fi
else
    # VMs without network (nothing generated leaves the guest); our own
    # namespace/cgroup prefix, so other daemons' are left alone.
    BACKEND_ARGS+=(--network off --net-prefix "st$(printf '%04x' $((RANDOM % 65536)))" --standby-vmms 1)
fi
PID=
cleanup() {
    if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then
        kill -TERM "$PID" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
    fi
    rm -rf "$STATE"
}
trap cleanup EXIT

# auth_fail_burst: schemathesis' `ignored_auth` check sends a request
# without and one with a wrong key to every operation; the default (20 per
# address) would answer the rest of the run 429 auth_throttled.
"${RUNAS[@]}" env HOME="$STATE" "$BIN" serve --listen 127.0.0.1:0 "${BACKEND_ARGS[@]}" \
    --state-dir "$STATE/state" --preview-listen 127.0.0.1:0 \
    --rate-limit 100000 --rate-burst 100000 --auth-fail-burst 100000 \
    --max-sessions 4 --max-sessions-per-key 2 --max-vcpus 1 --max-mem-mib 512 --max-disk-mib 2048 \
    --exec-timeout 5s --max-file 1048576 >"$OUT" 2>"$STATE/daemon.log" &
PID=$!
for _ in $(seq 300); do
    grep -q "listening on" "$OUT" 2>/dev/null && break
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.1
done
BASE=$(sed -n 's/.*listening on //p' "$OUT")
KEY=$(sed -n 's/.*API key: //p' "$OUT")
[ -n "$BASE" ] && [ -n "$KEY" ] || { cat "$STATE/daemon.log"; echo "server did not start"; exit 1; }
echo "schemathesis against $BASE (backend $BACKEND, max examples $MAX_EXAMPLES)"

# The session every `{session}` parameter names, our key as every `owner`
# (an admin's way to address a session; another owner's is 404), and a
# background process that has finished as every `{proc}`: its output
# replays and ends (a running one would stream until the request timeout).
api() {
    curl -sf -X "$1" -H "Authorization: Bearer $KEY" "$BASE$2" -d "$3" ||
        { tail -50 "$STATE/daemon.log"; echo "$1 $2 failed"; exit 1; }
}
api POST /v1/sessions '{"id": "st"}' >/dev/null
OWNER=${KEY#asbx_}
OWNER=${OWNER%%_*}
PROC=$(api POST /v1/sessions/st/exec '{"argv": ["echo", "schemathesis"], "background": true}' |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["procId"])')
# Checks: all (and ours in tests/schemathesis_hooks.py) but
# positive_data_acceptance, which wants every schema-valid
# request answered 2xx/404/409: whether a path is a directory, a name fits
# the guest's 255 bytes or a command exists is state inside the guest that
# no schema can say (the guest's answer there is 400/422, documented). A
# request refused for its size before it is parsed (413 body, 414 target,
# 431 head) is a rejection too.
cat >"$STATE/schemathesis.toml" <<EOF
workers = 1
# Checks live here, not in --checks: an explicit --checks would override
# the per-operation setting below.
[checks]
enabled = true
[checks.positive_data_acceptance]
enabled = false
[parameters]
"path.session" = "st"
"query.owner" = "${OWNER}"
"path.proc" = ${PROC}
"path.port" = 8000
# A followed audit stream lasts as long as its session (by design, up to an
# hour), longer than any request timeout: the snapshot form is fuzzed.
"query.follow" = "false"
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "414", "415", "422", "428", "429", "431", "5xx"]

# DELETE .../processes kills every process; their records (exit status,
# output) stay listed by design (docs/api.md), so use_after_free's guess
# that it deleted .../processes and .../processes/{proc} does not hold
# there. (A deleted session's reads stay checked: getSession, getNetwork,
# statFile.)
[[operations]]
include-path-regex = "/processes"
include-method = "GET"
checks.use_after_free.enabled = false

EOF
if [ "$BACKEND" = local-process ]; then
    # The local-process backend has no checkpoints: checkpoint, fork and
    # pause (and a create from a snapshot) answer 501 not_supported, as
    # documented for them; every other 5xx still fails.
    cat >>"$STATE/schemathesis.toml" <<'EOF'
[[operations]]
include-operation-id-regex = "^(checkpointSession|forkSession|pauseSession|resumeSession|createSession)$"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "501"]

EOF
fi

SPEC="$PWD/docs/openapi.yaml"
# Validates NDJSON bodies line by line (schemathesis has no NDJSON reader).
HOOKS="$PWD/tests/schemathesis_hooks.py"
case "$ST" in /*) ;; *) ST="$PWD/$ST" ;; esac
N=0
st() {
    N=$((N + 1))
    # From the state dir, so schemathesis' cache does not land in the tree.
    # Our key is the only credential: no generated Authorization/X-API-Key
    # values (those would only test the 401 path, which ignored_auth does).
    (cd "$STATE" && SCHEMATHESIS_HOOKS="$HOOKS" "$ST" --config-file "$STATE/schemathesis.toml" run "$SPEC" --url "$BASE" \
        -H "Authorization: Bearer $KEY" \
        --generation-with-security-parameters false \
        --max-examples "$MAX_EXAMPLES" \
        --request-timeout 60 \
        --no-color \
        --report json --report-json-path "$STATE/report-$N.json" \
        "$@")
}
set +e
# Three passes. Deleting sessions after everything that uses `st`; key
# rotation/revocation/deletion last, because the stateful phase finds our
# own key in GET /admin/keys and would rotate it away, leaving the
# remaining operations only 401s.
# A drain would make every later create a 503 draining: its routes run
# in a pass of their own, after everything that creates.
st --exclude-path-regex '^/admin/keys/' --exclude-operation-id deleteSession \
    --exclude-operation-id deleteSessionSeed --exclude-path-regex '^/v1/admin/drain' "$@"
RC1=$?
# With reads of the session: after a delete they must be 404 (use_after_free).
st --include-operation-id deleteSession --include-operation-id deleteSessionSeed \
    --include-operation-id getSession --include-operation-id getNetwork \
    --include-operation-id listProcesses --include-operation-id statFile "$@"
RC2=$?
st --include-path-regex '^/v1/admin/drain' "$@"
RC4=$?
st --include-path-regex '^/admin/keys' "$@"
RC3=$?
RC=$((RC1 | RC2 | RC3 | RC4))
set -e
python3 - "$STATE"/report-*.json <<'EOF'
import json, sys
ops = ex = fails = 0
for path in sys.argv[1:]:
    r = json.load(open(path))
    ops += r["operations"]["tested"]
    ex += r["test_cases"]["generated"]
    fails += r["test_cases"]["unique_failures"] + len(r["errors"])
print(f"schemathesis: {ops} operations, {ex} examples, {fails} failures")
EOF
if ! kill -0 "$PID" 2>/dev/null; then
    echo "the server died during the run"; tail -50 "$STATE/daemon.log"; exit 1
fi
kill -TERM "$PID"
DRC=0; wait "$PID" || DRC=$?
PID=
[ "$DRC" = 0 ] || { echo "server exited $DRC on SIGTERM"; exit 1; }
exit $RC
