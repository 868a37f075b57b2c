"""Tenant limits at the door: over a limit the API answers 429 with a sentence naming it,
`Retry-After` and the `RateLimit-Policy` / `RateLimit` headers, and stores nothing.
Limits are set per tenant in the `tenants:` section of an apply_agents file."""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..support import AAP, Stack
from ..turn_checks import LiveTurn, text_reply, user

POLICY = re.compile(r'^"turns";q=(\d+);w=60$')
STATE = re.compile(r'^"turns";r=(\d+);t=(\d+)$')


def limited_tenant(stack: Stack, tmp_path, **limits) -> tuple[str, AAP]:
    """A new tenant of `stack` with these limits (the file's names), and its client."""
    name = f"lim-{uuid.uuid4().hex[:8]}"
    stack.tokens[name] = stack.manage("create_tenant", name).strip().splitlines()[-1]
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({"tenants": [{"name": name, "limits": limits}]}))
    report = json.loads(stack.manage("apply_agents", str(path)))
    assert report == {"tenants": {"created": [], "updated": [name]}}
    return name, stack.client(name)


def assert_429(response: httpx.Response | object, limit: str, words: str) -> None:
    status = getattr(response, "status_code", None) or response.status
    body = response.json() if hasattr(response, "json") else response.body
    assert status == 429, body
    assert words in body["error"], body
    assert body["details"] == {"limit": limit}
    assert int(response.headers["Retry-After"]) >= 1


def test_turns_per_minute_refuse_with_429_and_count_down_in_ratelimit_headers(stack, tmp_path):
    name, client = limited_tenant(stack, tmp_path, turnsPerMinute=3)
    try:
        session = client.create_session("echo")
        remaining = []
        for i in range(3):
            result = client.turn(session, text=f"hello {i}")
            assert result.status == 200 and result.stop_reason == "end_turn"
            assert POLICY.match(result.headers["RateLimit-Policy"]).group(1) == "3"
            remaining.append(int(STATE.match(result.headers["RateLimit"]).group(1)))
        assert remaining == [2, 1, 0]
        before = client.history(session)

        refused = client.turn(session, text="one too many", stream="delta")
        assert_429(refused, "turnsPerMinute", "limit of 3 turns per minute")
        assert refused.headers["content-type"].startswith("application/json")
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert STATE.match(refused.headers["RateLimit"]).group(1) == "0"
        assert client.history(session) == before  # nothing stored for the refused turn

        # Every API response tells a client where it stands, reads included.
        listing = client.get("/v1/sessions")
        assert listing.status_code == 200
        assert POLICY.match(listing.headers["RateLimit-Policy"])
        assert STATE.match(listing.headers["RateLimit"]).group(1) == "0"
    finally:
        client.close()


def test_running_turns_limit_refuses_the_next_turn_and_stores_nothing(pg_stack, tmp_path, db_access):
    from sessions_app.models import Turn

    name, client = limited_tenant(pg_stack, tmp_path, maxRunningTurns=2, maxQueuedTurns=0)
    sessions = [client.create_session("echo") for _ in range(3)]
    running = [LiveTurn.turn(pg_stack, s, "/slow 40 100", tenant=name) for s in sessions[:2]]
    try:
        for live in running:
            live.wait_events(2)
        refused = client.turn(sessions[2], text="me too")
        assert_429(refused, "runningTurns", "limit of 2 concurrent running turns")
        assert client.history(sessions[2]) == []
        assert not Turn.objects.filter(session__public_id=sessions[2]).exists()
        # Another tenant is not affected by this one's limit.
        other = pg_stack.client("other")
        assert other.turn(other.create_session("echo-private"), text="hi").stop_reason == "end_turn"
        other.close()
    finally:
        for session, live in zip(sessions, running):
            client.post(f"/v1/sessions/{session}/turns/{live.turn_id}/cancel")
        for live in running:
            live.wait_end()
    # A place is free again: the refused turn can be sent now.
    again = client.turn(sessions[2], text="now")
    assert again.status == 200 and again.messages == text_reply("echo: now")
    client.close()


def test_queued_turns_are_admitted_up_to_running_plus_queued(pg_stack, tmp_path):
    name, client = limited_tenant(pg_stack, tmp_path, maxRunningTurns=1, maxQueuedTurns=2)
    sessions = [client.create_session("echo") for _ in range(4)]
    live = [LiveTurn.turn(pg_stack, s, "/slow 30 100", tenant=name) for s in sessions[:3]]
    try:
        for turn in live:
            turn.wait_for(lambda t: t.status is not None, what="the response head")
            assert turn.status == 200
        refused = client.turn(sessions[3], text="fourth")
        assert_429(refused, "queuedTurns", "1 running + 2 queued turns")
    finally:
        for session, turn in zip(sessions, live):
            client.post(f"/v1/sessions/{session}/turns/{turn.turn_id}/cancel")
        for turn in live:
            turn.wait_end()
    client.close()


def test_sessions_limit_refuses_a_new_session(stack, tmp_path):
    _, client = limited_tenant(stack, tmp_path, maxSessions=2)
    try:
        kept = {client.create_session("echo"), client.create_session("echo")}
        refused = client.post("/v1/sessions", {"agent": {"name": "echo"}})
        assert_429(refused, "sessions", "limit of 2")
        assert {s["sessionId"] for s in client.get("/v1/sessions").json()["sessions"]} == kept
        client.delete(f"/v1/sessions/{kept.pop()}")
        assert client.post("/v1/sessions", {"agent": {"name": "echo"}}).status_code == 201
    finally:
        client.close()


def test_tokens_per_day_refuse_once_the_recorded_usage_reaches_the_allowance(pg_stack, tmp_path, db_access):
    from sessions_app.models import Turn

    from ..support import committed

    _, client = limited_tenant(pg_stack, tmp_path, tokensPerDay=1000)
    session = client.create_session("echo")
    first = client.turn(session, text="spend")
    assert first.stop_reason == "end_turn"
    # The usage an LLM turn records (echo uses no model): 1200 tokens today.
    committed(lambda: Turn.objects.filter(id=first.turn_id).update(prompt_tokens=1000, completion_tokens=200))
    refused = client.turn(session, text="more")
    assert_429(refused, "tokensPerDay", "used 1200 of its 1000 LLM tokens for today")
    assert 1 <= int(refused.headers["Retry-After"]) <= 86400
    assert len(client.history(session)) == 2
    client.close()


def test_file_with_bad_limits_is_refused_with_a_sentence_and_changes_nothing(pg_stack, tmp_path):
    name, client = limited_tenant(pg_stack, tmp_path, turnsPerMinute=5)
    client.close()
    for limits, words in (
        ({"turnsPerMinute": -1}, "must be a whole number"),
        ({"turnsPerMinute": "many"}, "must be a whole number"),
        ({"turnsPerHour": 5}, "unknown limits turnsPerHour"),
    ):
        path = tmp_path / "bad.yaml"
        path.write_text(json.dumps({"tenants": [{"name": name, "limits": {"maxSessions": 1, **limits}}]}))
        with pytest.raises(RuntimeError, match=words):
            pg_stack.manage("apply_agents", str(path))
    client = pg_stack.client(name)
    session = client.create_session("echo")
    assert client.create_session("echo") != session  # maxSessions=1 was not applied
    assert POLICY.match(client.get("/v1/sessions").headers["RateLimit-Policy"]).group(1) == "5"
    client.close()


# --- failed bearer tokens ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_web(pg_stack, log_dir):
    """A second web process on the same database and Redis, refusing an address after 5 bad tokens."""
    web = Stack("guarded", {**pg_stack.env, "AAP_AUTH_FAILURES_PER_MINUTE": "5"}, log_dir)
    web.tokens = pg_stack.tokens
    web.start_web()
    yield web
    web.stop()


def test_bad_tokens_from_one_address_get_429_before_any_lookup(guarded_web):
    statuses = []
    for i in range(12):
        response = httpx.get(
            guarded_web.base_url + "/v1/sessions", headers={"Authorization": f"Bearer aap_bad_{i}"}, timeout=30
        )
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert "Too many unknown API tokens" in response.json()["error"]
            assert int(response.headers["Retry-After"]) >= 1
    assert statuses[:4] == [401] * 4
    assert statuses[-6:] == [429] * 6
    # Refused before the token is looked up: even a valid token from this address waits.
    blocked = httpx.get(
        guarded_web.base_url + "/v1/sessions",
        headers={"Authorization": f"Bearer {guarded_web.tokens['demo']}"},
        timeout=30,
    )
    assert blocked.status_code == 429


def test_concurrent_turns_at_the_limit_admit_exactly_the_limit(pg_stack, tmp_path):
    """Requests arriving together cannot both take the last place (the count is locked)."""
    name, client = limited_tenant(pg_stack, tmp_path, maxRunningTurns=3, maxQueuedTurns=0)
    sessions = [client.create_session("echo") for _ in range(10)]

    def start(session):
        http = httpx.Client(base_url=pg_stack.base_url, headers={"Authorization": f"Bearer {pg_stack.tokens[name]}"})
        try:
            with http.stream(
                "POST", f"/v1/sessions/{session}/turns", json={"messages": user("/slow 20 100"), "stream": "delta"}
            ) as response:
                status, turn_id = response.status_code, response.headers.get("AAP-Turn-Id")
                if status == 200:
                    response.read()
                return status, turn_id
        finally:
            http.close()

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(start, sessions))
    assert sorted(status for status, _ in results) == [200] * 3 + [429] * 7
    client.close()
