"""The turns tier: the whole service in this process. `hosting.asgi.application` (the ASGI app
Daphne serves) runs on an event loop of its own thread and is called through an httpx
transport; without REDIS_URL the service runs in its embedded mode, so each turn runs on a
thread of the web process's own pool and its events stream from memory. The database is
PostgreSQL's test database. No server process, no worker, no broker: what needs those
(restarts, the broker, process wiring, the sandbox) is tested in tests/e2e.

Server threads use connections of their own, outside a test's transaction: a test that changes
rows the service must see commits them (`committed`, tests/turns/test_auth.py).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import logging.config
import os
import threading
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from ..conftest import _require
from ..support import AAP, ROOT

# As tests/conftest.py's TEST_ENV, for the service in this process.
SETTINGS = {
    "REDIS_URL": "",
    "AAP_SSE_PING_SECONDS": 1.0,
    "AAP_TURN_LEASE_SECONDS": 3.0,
    "AAP_TENANT_MAX_RUNNING_TURNS": 0,
    "AAP_TENANT_TURNS_PER_MINUTE": 0,
    "AAP_AUTH_FAILURES_PER_MINUTE": 0,
    "AAP_AUTH_CACHE_SECONDS": 0.0,
}


def _clear_backends() -> None:
    """Forget the process's Redis-or-memory choices, made once from settings.REDIS_URL."""
    from infra import limits, redis_connections
    from sessions_app.engine import events

    for chosen in (events.backend, redis_connections.connections, limits.windows):
        chosen.cache_clear()


class InProcessTransport(httpx.BaseTransport):
    """A synchronous httpx transport that hands each request to an ASGI app running on an
    event loop in another thread, and returns the response once the app has sent all of it
    (a turn's stream ends with its `turn_stop`)."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop, timeout: float = 120.0):
        self._asgi = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        self._loop = loop
        self._timeout = timeout

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def call():
            inner = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            response = await self._asgi.handle_async_request(inner)
            raw = b"".join([chunk async for chunk in response.stream])
            return response.status_code, response.headers, raw

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        status, headers, raw = future.result(self._timeout)
        return httpx.Response(status, headers=headers, content=raw, request=request)


class Engine:
    """The service in this process, with the tenants `demo` and `other` and the agents of
    tests/agents.yaml; `client(tenant)` and `anonymous()` call it as Stack's do."""

    name = "turns"
    base_url = "http://127.0.0.1"

    def __init__(self, app, loop: asyncio.AbstractEventLoop, env: dict[str, str]):
        self.transport = InProcessTransport(app, loop)
        self.tokens: dict[str, str] = {}
        self.env = env  # for a process of the operator's (manage.py) on the same database

    def client(self, tenant: str = "demo", **kw) -> AAP:
        return AAP(self.base_url, self.tokens[tenant], transport=self.transport, **kw)

    def client_with(self, token: str) -> AAP:
        return AAP(self.base_url, token, transport=self.transport)

    def anonymous(self) -> AAP:
        return AAP(self.base_url, None, transport=self.transport)

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        """One request without the client's defaults (e.g. an Authorization header of one's own)."""
        with httpx.Client(base_url=self.base_url, transport=self.transport, timeout=120) as http:
            return http.request(method, path, **kw)


def _token(name: str) -> str:
    from tenancy.models import Tenant
    from tenancy.services import tenant_create, token_create

    tenant = Tenant.objects.filter(name=name).first()
    if tenant is None:
        return tenant_create(name=name)[1]
    return token_create(tenant=tenant, name="turns tier")[1]


def _process_env() -> dict[str, str]:
    """The environment of a manage.py process on the test database (the embedded mode)."""
    from django.db import connection

    parts = urlsplit(_require("DATABASE_URL"))
    test_db_url = urlunsplit(parts._replace(path="/" + connection.settings_dict["NAME"]))
    return {**os.environ, "DATABASE_URL": test_db_url, "REDIS_URL": ""}


@pytest.fixture(scope="package")
def engine(django_db_setup, django_db_blocker):
    from django.core.management import call_command
    from django.db import connections
    from django.test import override_settings

    from agents.demo import demo_seed

    env = _process_env()  # first: it says what is missing when DATABASE_URL is not set
    overridden = override_settings(**SETTINGS)
    overridden.enable()
    _clear_backends()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="asgi-app", daemon=True)
    thread.start()
    try:
        with django_db_blocker.unblock():
            # Committed: the service's threads read them on connections of their own.
            demo_seed(token=False)
            tokens = {"demo": _token("demo"), "other": _token("other")}
            call_command(
                "apply_agents", str(ROOT / "tests" / "agents.yaml"), stdout=io.StringIO(), stderr=io.StringIO()
            )
            from hosting.asgi import application

            engine = Engine(application, loop, env)
            engine.tokens = tokens
            connections.close_all()
            yield engine
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        overridden.disable()
        _clear_backends()


@pytest.fixture
def demo(engine):
    client = engine.client("demo")
    yield client
    client.close()


@pytest.fixture
def other(engine):
    client = engine.client("other")
    yield client
    client.close()


@pytest.fixture
def captured(settings):
    """The LOGGING of hosting/settings.py, writing to a buffer: what the service logs, from any
    of its threads, as JSON lines (a function returns those written so far)."""
    config = json.loads(json.dumps(settings.LOGGING))
    buffer = io.StringIO()
    config["handlers"]["console"]["stream"] = "ext://sys.stdout"
    logging.config.dictConfig(config)
    handler = logging.getLogger().handlers[0]
    handler.setStream(buffer)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    logging.config.dictConfig(settings.LOGGING)
