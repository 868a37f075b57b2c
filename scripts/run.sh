#!/usr/bin/env bash
# `make run`: migrate, seed the demo tenant and agent when absent (edits made in admin are
# kept), then serve on http://$HOST:$PORT with Daphne. The demo token printed is the same on
# every start (its plaintext is kept in var/demo_token; delete that file for a new one).
#
#   HOST (127.0.0.1), PORT (8000)   where Daphne listens
#   DATABASE_URL                    unset: embedded SQLite under var/
#   REDIS_URL                       set: a Celery worker (with beat) runs the turns alongside;
#                                   unset: embedded mode, turns run inside the web process
#   CELERY_CONCURRENCY (16)         worker threads
#   OPENAI_API_KEY / OPENAI_BASE_URL  either set: also seed the 'assistant' agent
#   (+ OPENAI_MODEL)                  (model and base URL have defaults in seed_demo)
#
# Ctrl-C (or SIGTERM) stops Daphne and the worker cleanly; a second Ctrl-C kills them.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BIN="$ROOT/.venv/bin"
PY="$BIN/python"
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
STOP_TIMEOUT=${STOP_TIMEOUT:-20}

if [[ ! -x "$PY" ]]; then
    echo "run.sh: $PY is missing; use 'make run' (it creates .venv and installs the package)" >&2
    exit 1
fi

say() { printf '==> %s\n' "$*" >&2; }
# Logs for a terminal: text lines with tenant/session/turn ids (containers default to JSON lines).
export LOG_FORMAT=${LOG_FORMAT:-plain}

# --- Database and demo data ------------------------------------------------------------
if [[ -n "${DATABASE_URL:-}" ]]; then
    say "database: ${DATABASE_URL%%://*}://… (DATABASE_URL)"
    # One sentence (no traceback, no 30 s of pool retries) when the database cannot be used.
    if ! db_error=$("$PY" manage.py check_database 2>&1 >/dev/null); then
        echo "run.sh: ${db_error#CommandError: }" >&2
        exit 1
    fi
else
    say "database: embedded SQLite under ${HOSTING_VAR_DIR:-var}/ (set DATABASE_URL for PostgreSQL)"
fi
"$PY" manage.py migrate --noinput -v0

seed_args=()
if [[ -n "${OPENAI_API_KEY:-}" || -n "${OPENAI_BASE_URL:-}" ]]; then
    seed_args+=(--assistant)
    say "OpenAI-compatible endpoint configured: also seeding the 'assistant' agent (model ${OPENAI_MODEL:-default})"
fi
seed_out=$("$PY" manage.py seed_demo "${seed_args[@]}")
TOKEN=$(printf '%s\n' "$seed_out" | tail -n 1)
printf '%s\n' "$seed_out" | sed '$d'
if [[ -z "$TOKEN" || "$TOKEN" =~ [[:space:]] ]]; then
    echo "run.sh: seed_demo did not print a token as its last line (got: '$TOKEN')" >&2
    exit 1
fi
# Static files are served by the ASGI app itself (ASGIStaticFilesHandler), so no
# collectstatic is needed here.

# --- Serve -----------------------------------------------------------------------------
case "$HOST" in
    0.0.0.0 | "") url_host=127.0.0.1 ;;
    :: | "[::]") url_host="[::1]" ;;
    *:*) url_host="[$HOST]" ;;
    *) url_host=$HOST ;;
esac
BASE_URL="http://$url_host:$PORT"

cat <<EOF

  Demo tenant token (tenant 'demo'; the same on every start, kept in ${HOSTING_VAR_DIR:-var}/demo_token):

    export TOKEN=$TOKEN

  Try:

    curl -s -H "Authorization: Bearer \$TOKEN" $BASE_URL/v1/meta

EOF

pids=()
force=0

start() { # name, argv...
    local name=$1
    shift
    "$@" </dev/null &
    pids+=($!)
    say "started $name (pid $!)"
}

stop_all() {
    local pid i
    trap 'force=1' INT TERM
    for pid in "${pids[@]}"; do
        # Each child leads its own process group (set -m): stop it and its children.
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
        local alive=0
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && alive=1
        done
        [[ $alive == 0 || $force == 1 ]] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            say "pid $pid still running: killing it"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}

# shellcheck disable=SC2329  # called from the traps below
on_signal() {
    say "stopping…"
    stop_all
    exit "$1"
}
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP

# Job control: every child gets its own process group, so a Ctrl-C reaches this script
# only, which then stops the children in order (a single, clean TERM each).
set -m

if [[ -n "${REDIS_URL:-}" ]]; then
    mkdir -p "${HOSTING_VAR_DIR:-var}"
    say "REDIS_URL is set: turns run in a Celery worker"
    start celery "$BIN/celery" -A hosting worker -B --loglevel INFO --pool threads \
        --concurrency "${CELERY_CONCURRENCY:-16}" -Q aap-turns \
        --schedule "${HOSTING_VAR_DIR:-var}/celerybeat-schedule"
else
    say "no REDIS_URL: embedded mode, turns run inside the web process"
fi
start daphne "$BIN/python" -m infra.webserver -b "$HOST" -p "$PORT" hosting.asgi:application
say "serving on $BASE_URL (Ctrl-C to stop)"

# Whichever exits first (a crash, a port in use) takes the others down with it.
rc=0
wait -n || rc=$?
say "a process exited (status $rc); stopping the others"
stop_all
exit "$(( rc == 0 ? 1 : rc ))"
