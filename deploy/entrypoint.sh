#!/usr/bin/env bash
# The container's entrypoint: one image, one role per service of docker-compose.yml.
#
#   web        Daphne on 0.0.0.0:8000 (AAP API, admin, /healthz)
#   worker     a Celery worker running turns (WORKER_CONCURRENCY threads)
#   beat       the Celery beat scheduler (the stale-turn sweep)
#   init       wait for PostgreSQL, migrate, grant the workers' database role (when
#              AAP_WORKER_DATABASE_URL names one), apply the mounted agents file (every `up`)
#   first-run  init, then create the first tenant and print its API token (once)
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
    else
        say "init: no agents file at $AGENTS_FILE (mount one there, or set AAP_AGENTS_FILE); agents unchanged"
    fi
    if truthy "${AAP_SEED_DEMO:-false}"; then
        # No token here (it would land in the container's log): create one with create_token demo.
        manage seed_demo --no-token
    fi
}

first_tenant() {
    local name=${AAP_FIRST_TENANT:-main}
    if AAP_TENANT_NAME=$name manage shell -v 0 -c "import os, sys; from hosting.models import Tenant; sys.exit(0 if Tenant.objects.filter(name=os.environ['AAP_TENANT_NAME']).exists() else 1)"; then
        say "first-run: tenant '$name' exists; its token was printed when it was created."
        say "first-run: another token: docker compose run --rm init python manage.py create_token $name"
        return
    fi
    manage create_tenant "$name" --title "${AAP_FIRST_TENANT_TITLE:-}"
}

pool_max() { # default pool size of this role
    export DATABASE_POOL_MAX=${DATABASE_POOL_MAX:-$1}
}

role=${1:-web}
case "$role" in
    web)
        shift
        pool_max $(( ${AAP_WEB_THREADS:-16} + 4 ))
        exec daphne -b "${BIND_ADDRESS:-0.0.0.0}" -p "${PORT:-8000}" "$@" hosting.asgi:application
        ;;
    worker)
        shift
        concurrency=${WORKER_CONCURRENCY:-8}
        pool_max $(( concurrency + 4 ))
        exec celery -A hosting worker --loglevel "${LOG_LEVEL:-INFO}" --pool threads \
            --concurrency "$concurrency" -Q aap-turns "$@"
        ;;
    beat)
        shift
        pool_max 2
        mkdir -p "${HOSTING_VAR_DIR:-/data/var}"
        exec celery -A hosting beat --loglevel "${LOG_LEVEL:-INFO}" \
            --schedule "${HOSTING_VAR_DIR:-/data/var}/celerybeat-schedule" "$@"
        ;;
    init)
        pool_max 2
        init
        ;;
    first-run)
        pool_max 2
        init
        first_tenant
        ;;
    *)
        exec "$@"
        ;;
esac
