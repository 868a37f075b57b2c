"""Fixtures: the real stacks the suite drives over HTTP.

`pg_stack`: Daphne + a Celery worker (threads pool) against the pytest-django test database
on PostgreSQL and Redis at REDIS_URL. `embedded_stack`: Daphne alone, no Redis, SQLite (the
`make run` default). `stack` runs a test against both.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from .support import ROOT, Stack

TEST_ENV = {
    "AAP_SSE_PING_SECONDS": "1",
    "AAP_TURN_LEASE_SECONDS": "3",
    "LOG_LEVEL": "INFO",
    # The suite's tenants run unlimited and every test calls from 127.0.0.1: the limits'
    # own tests (tests/e2e/test_limits.py) give their tenants and stacks explicit limits.
    "AAP_TENANT_MAX_RUNNING_TURNS": "0",
    "AAP_TENANT_TURNS_PER_MINUTE": "0",
    "AAP_AUTH_FAILURES_PER_MINUTE": "0",
    # Tests revoke, expire and re-limit tokens and expect the next request to see it at once;
    # the cache and its bound have their own test (tests/api/test_auth_cache.py).
    "AAP_AUTH_CACHE_SECONDS": "0",
}


def pytest_configure(config):
    """Under pytest-xdist each worker gets a Redis database of its own (the next after
    REDIS_URL's, on the server the suite was given); pytest-django gives each its own test
    database."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    redis_url = os.environ.get("REDIS_URL")
    if not worker or not redis_url:
        return
    from django.conf import settings

    parts = urlsplit(redis_url)
    base = int(parts.path.strip("/") or 0)
    own = urlunsplit(parts._replace(path=f"/{base + 1 + int(worker.removeprefix('gw'))}"))
    os.environ["REDIS_URL"] = own
    settings.REDIS_URL = own
    settings.CELERY_BROKER_URL = own


def _require(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise pytest.UsageError(
            f"{name} is not set: run the suite with 'make test', which provides PostgreSQL and Redis "
            "(or set DATABASE_URL and REDIS_URL yourself)."
        )
    return value


def _seed(stack: Stack) -> None:
    stack.tokens["demo"] = stack.manage("seed_demo").strip().splitlines()[-1]
    try:
        stack.tokens["other"] = stack.manage("create_tenant", "other").strip().splitlines()[-1]
    except RuntimeError:  # created by an earlier stack or tier on this database
        stack.tokens["other"] = stack.manage("create_token", "other").strip().splitlines()[-1]
    stack.manage("apply_agents", str(ROOT / "tests" / "agents.yaml"))


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("logs")
    yield path


@pytest.fixture(scope="session")
def pg_stack(django_db_setup, django_db_blocker, log_dir, tmp_path_factory):
    import redis
    from django.db import connection

    database_url = _require("DATABASE_URL")
    redis_url = _require("REDIS_URL")
    # Never flushed: scripts/test.sh gives the suite a throwaway Redis of its own, and a
    # REDIS_URL given by hand must name a database reserved for the suite.
    redis.Redis.from_url(redis_url).ping()
    parts = urlsplit(database_url)
    test_db_url = urlunsplit(parts._replace(path="/" + connection.settings_dict["NAME"]))
    # Not under pytest's temporary root, which any starting pytest run makes 0700 again:
    # sandboxed agents run as uids of their own and must traverse to their workspaces.
    workspaces = Path(tempfile.mkdtemp(prefix="aap-workspaces-"))
    stack = Stack(
        "pg",
        {**TEST_ENV, "DATABASE_URL": test_db_url, "REDIS_URL": redis_url, "AAP_WORKSPACE_ROOT": str(workspaces)},
        log_dir,
    )
    try:
        _seed(stack)
        stack.start_web()
        stack.start_worker()
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(workspaces, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_stack(tmp_path_factory, log_dir):
    var = Path(tempfile.mkdtemp(prefix="aap-embedded-var-"))  # see pg_stack's workspaces
    stack = Stack(
        "embedded",
        {
            **TEST_ENV,
            "DATABASE_URL": "",
            "REDIS_URL": "",
            "HOSTING_VAR_DIR": str(var),
            "SECRET_KEY": "",
            "HOSTING_ENCRYPTION_KEYS": "",
        },
        log_dir,
    )
    try:
        stack.manage("migrate", "--noinput", "-v0")
        _seed(stack)
        stack.start_web()
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(var, ignore_errors=True)


@pytest.fixture(params=["pg", "embedded"])
def stack(request) -> Stack:
    """Run the test against both the production stack and the embedded mode."""
    return request.getfixturevalue(f"{request.param}_stack")


@pytest.fixture
def db_access(django_db_blocker):
    """Direct (read) access to the PostgreSQL test database the pg stack serves from."""
    with django_db_blocker.unblock():
        yield


@pytest.fixture
def demo(pg_stack):
    client = pg_stack.client("demo")
    yield client
    client.close()


@pytest.fixture
def other(pg_stack):
    client = pg_stack.client("other")
    yield client
    client.close()


# Every test of the service lives in a tier directory, and the directory is its marker
# (`-m turns`, `-m "not e2e"`): unit (no I/O), api (the Django stack in process, on
# PostgreSQL), turns (the whole service in process: the ASGI app and the embedded engine), e2e
# (real Daphne, Celery, PostgreSQL, Redis), sandbox (the agent sandbox), real (third-party
# agents), chaos (faults). The client's own tests (sdk/tests) are the SDK's, outside them.
TIERS = ("unit", "api", "turns", "e2e", "sandbox", "real", "chaos")
SDK_TESTS = ROOT / "sdk" / "tests"

# The modules that take longest, longest first: under pytest-xdist (`--dist loadfile` hands
# out whole modules in collection order) they start first, so no worker begins one of them
# while the others are running out of work. A module missing here runs after them.
LONGEST_FIRST = (
    "real/test_llama_cpp.py",
    "e2e/test_acp_agent.py",
    "e2e/test_limits.py",
    "e2e/test_mcp_tools.py",
    "e2e/test_compose.py",
    "e2e/test_fairness.py",
    "e2e/test_acp_agentao.py",
    "e2e/test_metrics.py",
    "real/test_opencode.py",
    "e2e/test_schemathesis.py",
    "e2e/test_recovery.py",
    "e2e/test_reattach_cancel.py",
    "e2e/test_make_run.py",
)


def _longest_first(items) -> None:
    tests = ROOT / "tests"
    rank = {tests / name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: a module keeps its order


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _longest_first(items)
    tests = ROOT / "tests"
    for item in items:
        if SDK_TESTS in item.path.parents:
            continue  # no database, no tier of the service's
        relative = item.path.relative_to(tests) if tests in item.path.parents else None
        tier = relative.parts[0] if relative is not None and len(relative.parts) > 1 else None
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{item.nodeid}: every test lives in a tier directory ({', '.join(f'tests/{t}' for t in TIERS)})"
            )
        item.add_marker(getattr(pytest.mark, tier))
        # pytest-django creates the test database only for tests that ask for it; every tier
        # but unit uses it (reads only, inside a rollback, beside what the service commits).
        # Unit tests touch no database.
        # A test's own mark (transaction=True: other connections see what it commits) stands.
        if tier != "unit" and item.get_closest_marker("django_db") is None:
            item.add_marker(pytest.mark.django_db)


CHROMIUM = os.environ.get("AAP_CHROMIUM", "/usr/bin/chromium")
# Flags for a headless Chromium on a machine without a network beyond loopback.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
]


class BrowserThread:
    """Headless Chromium, driven by Playwright's sync API on a thread of its own.

    Playwright's sync API runs an event loop in the thread that uses it, and Django refuses
    database access from a thread with a running loop; so browser work runs here, through
    `call(fn, *args)`, which runs `fn(browser, *args)` on the browser's thread and returns
    its result (or raises its exception)."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chromium")
        self._playwright = None
        self.browser = None
        self._executor.submit(self._start).result(timeout=120)

    def _start(self):
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)

    def call(self, fn, *args, timeout: float = 120):
        return self._executor.submit(fn, self.browser, *args).result(timeout=timeout)

    def close(self):
        def stop():
            if self.browser is not None:
                self.browser.close()
            if self._playwright is not None:
                self._playwright.stop()

        self._executor.submit(stop).result(timeout=60)
        self._executor.shutdown()


@pytest.fixture(scope="session")
def chromium():
    """A headless Debian Chromium (a BrowserThread); skipped, with the reason, when absent.

    `.ci/run` installs Chromium and sets AAP_REQUIRE_BROWSER=1, so there a missing browser
    fails the run instead of skipping.
    """
    reason = None
    if not os.path.exists(CHROMIUM):
        reason = f"Chromium is not installed at {CHROMIUM} (apt-get install chromium, or set AAP_CHROMIUM)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "the playwright package is not installed (make test installs the test extras)"
    if reason:
        if os.environ.get("AAP_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser tests are required here (AAP_REQUIRE_BROWSER=1) but {reason}")
        pytest.skip(reason)
    browser = BrowserThread()
    try:
        yield browser
    finally:
        browser.close()
