"""Settings from the environment, on a second Daphne over the same database: `AAP_PUBLIC_META=false`
and a `REDIS_URL` where nothing answers (health reports it; sessions still work without a turn);
and health on the stack whose PostgreSQL and Redis answer."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from ..support import BIN, Stack, free_port


@pytest.fixture(scope="module")
def restricted(pg_stack, log_dir):
    closed_port = free_port()  # nothing listens there
    stack = Stack(
        "restricted",
        {
            "DATABASE_URL": pg_stack.env["DATABASE_URL"],
            "REDIS_URL": f"redis://127.0.0.1:{closed_port}/0",
            "AAP_PUBLIC_META": "false",
        },
        log_dir,
    )
    stack.tokens = dict(pg_stack.tokens)
    # Not Stack.start_web: its readiness check waits for a healthy /healthz, which this stack never gives.
    stack.web = stack._spawn(
        "daphne", [str(BIN / "daphne"), "-b", "127.0.0.1", "-p", str(stack.port), "hosting.asgi:application"]
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert stack.web.poll() is None, (log_dir / "restricted-daphne.log").read_text()[-3000:]
            try:
                httpx.get(stack.base_url + "/healthz", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "daphne did not answer"
                time.sleep(0.2)
        yield stack
    finally:
        os.killpg(stack.web.pid, signal.SIGKILL)  # nothing to finish gracefully on this stack
        stack.web.wait(10)


def test_meta_needs_a_token_when_public_discovery_is_off(restricted):
    anonymous = restricted.anonymous()
    response = anonymous.get("/v1/meta")
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert response.json()["error"]
    anonymous.close()
    other = restricted.client("other")
    names = {agent["name"] for agent in other.meta()["agents"]}
    assert "echo-private" in names
    other.close()


def test_health_is_503_naming_redis_when_redis_is_unreachable(restricted):
    response = httpx.get(restricted.base_url + "/healthz", timeout=30)
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["redis"] != "ok"
    assert "redis" in body["error"].lower()
    assert "database" not in body["error"].lower()


def test_sessions_and_history_do_not_need_redis(restricted):
    demo = restricted.client("demo")
    seed = [{"role": "user", "content": "stored in PostgreSQL"}]
    session = demo.create_session("echo", messages=seed)
    assert demo.get(f"/v1/sessions/{session}").status_code == 200
    assert demo.history(session) == seed
    assert demo.delete(f"/v1/sessions/{session}").status_code == 204
    demo.close()


def test_health_is_ok_when_database_and_redis_answer(pg_stack):
    response = httpx.get(pg_stack.base_url + "/healthz", timeout=30)
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}
