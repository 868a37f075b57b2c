#!/usr/bin/env bash
# Run the test suite against PostgreSQL and Redis (`make test`; extra args go to pytest).
#
#   scripts/test.sh                 # whole suite
#   scripts/test.sh -k meta -x      # any pytest arguments
#   make test ARGS='-m "not e2e"'
#
# Safe beside anything else on the machine (another checkout's suite, `make run`):
# - PostgreSQL: unless DATABASE_URL is given, the suite starts a throwaway server of its own
#   (fsync off) on a free port and stops it at the end. A DATABASE_URL you give only hosts the
#   test databases, whose names are unique to this run (DATABASE_TEST_NAME, default
#   test_aap_<checkout>_<pid>, and `_gw<n>` after it for each pytest-xdist worker);
#   pytest-django creates and drops them.
# - Redis: unless REDIS_URL is given, the suite starts a throwaway redis-server of its own on a
#   free port and stops it at the end. A REDIS_URL you give must be a database reserved for
#   the suite: it is used as is and never flushed. Under pytest-xdist each worker takes the
#   databases after it (tests/conftest.py), so it must have them (a throwaway has 64).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "test.sh: $PY is missing; run 'make test' (it creates .venv and installs the package)" >&2
    exit 1
fi

# --- A safe, deterministic test environment -----------------------------------------
# Test-only secrets: never the developer's or production's. A fresh Fernet key per run.
export SECRET_KEY="test-only-secret-key-not-for-production-0123456789abcdefghijklmnop"
HOSTING_ENCRYPTION_KEYS=$("$PY" -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')
export HOSTING_ENCRYPTION_KEYS
# Keep local state of the suite (generated files, workspaces) away from `make run`'s var/.
export HOSTING_VAR_DIR="${HOSTING_VAR_DIR:-$ROOT/var/test}"
export AAP_WORKSPACE_ROOT="${AAP_WORKSPACE_ROOT:-$HOSTING_VAR_DIR/workspaces}"
export DJANGO_SETTINGS_MODULE=hosting.settings
export PYTHONUNBUFFERED=1
export DEBUG=0
# The suite must never reach a real model provider with the developer's credentials.
unset OPENAI_API_KEY OPENAI_BASE_URL OPENAI_MODEL OPENAI_ORG_ID OPENAI_PROJECT_ID

# --- PostgreSQL and Redis (exports DATABASE_URL, REDIS_URL; stops throwaways on exit) --
if [[ -z "${DATABASE_URL:-}" ]]; then
    export AAP_SERVICES_OWN_POSTGRES=1
fi
checkout_id=$(printf '%s' "$ROOT" | cksum | cut -d' ' -f1)
export DATABASE_TEST_NAME="${DATABASE_TEST_NAME:-test_aap_${checkout_id}_$$}"
# The suite only needs the server: no database is created for DATABASE_URL's own name.
export AAP_SERVICES_CREATEDB=0
if [[ -z "${REDIS_URL:-}" ]]; then
    export AAP_SERVICES_OWN_REDIS=1
fi
# shellcheck source=scripts/services.sh
source "$ROOT/scripts/services.sh" || {
    echo "test.sh: FAILED: PostgreSQL and Redis are required and could not be provided (see above)." >&2
    exit 1
}

# --- pytest --------------------------------------------------------------------------
rc=0
"$PY" -m pytest "$@" || rc=$?
if [[ $rc == 5 ]]; then
    echo "test.sh: FAILED: pytest collected no tests (exit code 5) with arguments: ${*:-(none)}" >&2
    echo "test.sh: an empty run is a failure here; check testpaths, -k/-m filters and test file names." >&2
fi
exit "$rc"
