#!/usr/bin/env bash
# The container's entrypoint: one image, one role per service of docker-compose.yml.
#
#   web        Daphne on 0.0.0.0:8000 (AAP API, admin, /healthz), access lines through logging
#   worker     a Celery worker running turns (WORKER_CONCURRENCY threads)
#   beat       the Celery beat scheduler (the stale-turn sweep)
#   init       wait for PostgreSQL, migrate, grant the workers' database role (when
#              AAP_WORKER_DATABASE_URL names one), apply the agents file (every `up`): the
#              operator's deploy/agents.yaml, or the shipped example while there is none
#   first-run  create the operator's agents file from the example when absent (if its
#              directory is writable), init, then create the first tenant and print its
#              API token (once)
#   anything else is run as given (e.g. `python manage.py create_token main`)
#
# Database connections: each process keeps a pool of at most DATABASE_POOL_MAX connections;
# when unset it is derived from the threads that use it (web: AAP_WEB_THREADS + 4, worker:
# WORKER_CONCURRENCY + 4, beat: 2), so `--scale worker=N` needs N * (WORKER_CONCURRENCY + 4)
# connections beside the web's (see the README's "Sizing").
set -euo pipefail

APP_DIR=${APP_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$APP_DIR"
PYTHON=${PYTHON:-python}
AGENTS_FILE=${AAP_AGENTS_FILE:-/config/agents.yaml}
# The example the repository ships (deploy/agents.example.yaml); the operator's own file is
# not tracked by git, so `git pull` never conflicts with it.
AGENTS_EXAMPLE=${AAP_AGENTS_EXAMPLE:-$(dirname "$AGENTS_FILE")/agents.example.yaml}
[[ -f "$AGENTS_EXAMPLE" ]] || AGENTS_EXAMPLE=$APP_DIR/deploy/agents.example.yaml

say() { printf '%s\n' "$*" >&2; }
manage() { "$PYTHON" manage.py "$@"; }
truthy() { [[ ${1,,} =~ ^(1|true|yes|on)$ ]]; }

init() {
    # One sentence (and a non-zero exit) when the database is wrong; waits while it starts.
    manage check_database --wait "${AAP_DATABASE_WAIT_SECONDS:-60}"
    manage migrate --noinput -v0
    # After migrate, so the tables a release adds are granted too (or kept from the workers).
    manage grant_worker_role
    if [[ -f "$AGENTS_FILE" ]]; then
        manage apply_agents "$AGENTS_FILE"
        say "init: applied the agents of $AGENTS_FILE"
    elif [[ -f "$AGENTS_EXAMPLE" ]]; then
        manage apply_agents "$AGENTS_EXAMPLE"
        say "init: no agents file at $AGENTS_FILE: applied the example $AGENTS_EXAMPLE (to choose the agents: cp deploy/agents.example.yaml deploy/agents.yaml, edit it, docker compose up -d)"
    else
        say "init: no agents file at $AGENTS_FILE (mount one there, or set AAP_AGENTS_FILE); agents unchanged"
    fi
    if truthy "${AAP_SEED_DEMO:-false}"; then
        # No token here (it would land in the container's log): create one with create_token demo.
        manage seed_demo --no-token
    fi
}

agents_file_from_example() {
    # Never overwrites: the operator's file is theirs once it exists.
    [[ -e "$AGENTS_FILE" || ! -f "$AGENTS_EXAMPLE" ]] && return
    if cp "$AGENTS_EXAMPLE" "$AGENTS_FILE" 2>/dev/null; then
        say "first-run: created $AGENTS_FILE from the example (deploy/agents.yaml on the host: edit it to choose the agents)"
    else
        say "first-run: cannot write $AGENTS_FILE (its directory belongs to another user): cp deploy/agents.example.yaml deploy/agents.yaml on the host"
    fi
}

first_tenant() {
    local name=${AAP_FIRST_TENANT:-main}
    if AAP_TENANT_NAME=$name manage shell -v 0 -c "import os, sys; from tenancy.models import Tenant; sys.exit(0 if Tenant.objects.filter(name=os.environ['AAP_TENANT_NAME']).exists() else 1)"; then
        say "first-run: tenant '$name' exists; its token was printed when it was created."
        say "first-run: another token: docker compose run --rm init python manage.py create_token $name"
        return
    fi
    manage create_tenant "$name" --title "${AAP_FIRST_TENANT_TITLE:-}"
}

quiet() { # JSON logs: no multi-line startup banner (Celery prints it outside logging)
    [[ ${LOG_FORMAT:-json} == plain ]] || printf '%s' --quiet
}

pool_max() { # default pool size of this role
    export DATABASE_POOL_MAX=${DATABASE_POOL_MAX:-$1}
}

role=${1:-web}
case "$role" in
    web)
        shift
        pool_max $(( ${AAP_WEB_THREADS:-16} + 4 ))
        # Daphne, its access lines through logging (JSON, no query string: infra/webserver.py).
        exec "$PYTHON" -m infra.webserver -b "${BIND_ADDRESS:-0.0.0.0}" -p "${PORT:-8000}" "$@" hosting.asgi:application
        ;;
    worker)
        shift
        concurrency=${WORKER_CONCURRENCY:-8}
        pool_max $(( concurrency + 4 ))
        exec celery -A hosting $(quiet) worker --loglevel "${LOG_LEVEL:-INFO}" --pool threads \
            --concurrency "$concurrency" -Q aap-turns "$@"
        ;;
    beat)
        shift
        pool_max 2
        mkdir -p "${HOSTING_VAR_DIR:-/data/var}"
        exec celery -A hosting $(quiet) beat --loglevel "${LOG_LEVEL:-INFO}" \
            --schedule "${HOSTING_VAR_DIR:-/data/var}/celerybeat-schedule" "$@"
        ;;
    init)
        pool_max 2
        init
        ;;
    first-run)
        pool_max 2
        agents_file_from_example
        init
        first_tenant
        ;;
    *)
        exec "$@"
        ;;
esac
