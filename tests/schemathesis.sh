#!/usr/bin/env bash
# Runs schemathesis against docs/openapi.yaml and a live `agent-sandbox
# serve`, bounded, and fails on any 5xx. Starts and stops the server itself.
#
#   tests/schemathesis.sh [extra schemathesis args]
#
# Env: MAX_EXAMPLES (default 20), SCHEMATHESIS (path to the CLI; default:
# `schemathesis` on PATH, else a venv in target/st-venv is created),
# BACKEND (default local-process). With local-process, generated commands
# run on this host: the daemon therefore runs as `nobody` when started as
# root, in a throwaway state dir.
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_EXAMPLES=${MAX_EXAMPLES:-20}
BACKEND=${BACKEND:-local-process}

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
if [ "$(id -u)" = 0 ]; then
    # Copy the binaries where nobody can run them.
    cp "$BIN" "$AGENT" "$STATE/"
    BIN="$STATE/agent-sandbox"
    AGENT="$STATE/sandbox-agent"
    chown -R nobody:nogroup "$STATE"
    RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all)
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

"${RUNAS[@]}" env HOME="$STATE" "$BIN" serve --listen 127.0.0.1:0 --backend "$BACKEND" \
    --agent-bin "$AGENT" --state-dir "$STATE/state" \
    --rate-limit 100000 --rate-burst 100000 --max-sessions 10000 --max-sessions-per-key 10000 \
    --max-vcpus-per-key 1000000 --max-mem-mib-per-key 1000000000 \
    --exec-timeout 5s --max-file 1048576 >"$OUT" 2>"$STATE/daemon.log" &
PID=$!
for _ in $(seq 100); do
    grep -q "listening on" "$OUT" 2>/dev/null && break
    sleep 0.1
done
BASE=$(sed -n 's/.*listening on //p' "$OUT")
KEY=$(sed -n 's/.*API key: //p' "$OUT")
[ -n "$BASE" ] && [ -n "$KEY" ] || { cat "$STATE/daemon.log"; echo "server did not start"; exit 1; }
echo "schemathesis against $BASE (backend $BACKEND, max examples $MAX_EXAMPLES)"

SPEC="$PWD/docs/openapi.yaml"
case "$ST" in /*) ;; *) ST="$PWD/$ST" ;; esac
st() {
    # From the state dir, so schemathesis' cache does not land in the tree.
    (cd "$STATE" && "$ST" run "$SPEC" --url "$BASE" \
        -H "Authorization: Bearer $KEY" \
        --checks not_a_server_error \
        --max-examples "$MAX_EXAMPLES" \
        --request-timeout 30 \
        "$@")
}
set +e
# Two passes: key rotation/revocation/deletion last, because the stateful
# phase finds our own key in GET /admin/keys and would rotate it away,
# leaving the remaining operations only 401s.
st --exclude-path-regex '^/admin/keys/' "$@"
RC1=$?
st --include-path-regex '^/admin/keys' "$@"
RC2=$?
RC=$((RC1 | RC2))
set -e
if ! kill -0 "$PID" 2>/dev/null; then
    echo "the server died during the run"; tail -50 "$STATE/daemon.log"; exit 1
fi
kill -TERM "$PID"
wait "$PID"; DRC=$?
PID=
[ "$DRC" = 0 ] || { echo "server exited $DRC on SIGTERM"; exit 1; }
exit $RC
