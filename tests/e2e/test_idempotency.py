"""Idempotency-Key on POST /v1/sessions and POST /v1/sessions/:id/turns: a retry of the same
request gets the same session or turn back, never a duplicate; another request with the
same key is 422."""

from __future__ import annotations

import threading
import uuid

from ..support import parse_sse
from ..turn_checks import text_reply, user


def key() -> str:
    return str(uuid.uuid4())


def test_retried_session_create_returns_the_same_session(stack, client):
    k = key()
    body = {"agent": {"name": "echo", "options": {"style": "upper"}}}
    first = client.post("/v1/sessions", body, headers={"Idempotency-Key": k})
    again = client.post("/v1/sessions", body, headers={"Idempotency-Key": k})
    assert first.status_code == again.status_code == 201, (first.text, again.text)
    assert first.json()["sessionId"] == again.json()["sessionId"]
    listed = [s["sessionId"] for s in client.get("/v1/sessions", params={"limit": 100}).json()["sessions"]]
    assert listed.count(first.json()["sessionId"]) == 1


def test_same_key_with_another_request_is_422_and_changes_nothing(stack, client):
    k = key()
    created = client.post("/v1/sessions", {"agent": {"name": "echo"}}, headers={"Idempotency-Key": k})
    assert created.status_code == 201
    other = client.post(
        "/v1/sessions", {"agent": {"name": "echo"}, "messages": user("x")}, headers={"Idempotency-Key": k}
    )
    assert other.status_code == 422, other.text
    assert "Idempotency-Key" in other.json()["error"]
    # the same key on another endpoint is another request too
    session = created.json()["sessionId"]
    turn = client.post(f"/v1/sessions/{session}/turns", {"messages": user("hi")}, headers={"Idempotency-Key": k})
    assert turn.status_code == 422, turn.text
    assert client.history(session) == []


def test_retried_turn_returns_the_same_turn_and_stores_it_once(stack, client):
    session = client.create_session("echo")
    k = key()
    body = {"messages": user("only once")}
    first = client.post(f"/v1/sessions/{session}/turns", body, headers={"Idempotency-Key": k})
    again = client.post(f"/v1/sessions/{session}/turns", body, headers={"Idempotency-Key": k})
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.headers["AAP-Turn-Id"] == again.headers["AAP-Turn-Id"]
    assert first.json() == again.json()
    assert first.json()["messages"] == text_reply("echo: only once")
    assert client.history(session) == user("only once") + text_reply("echo: only once")
    # a new key is a new turn
    third = client.post(f"/v1/sessions/{session}/turns", body, headers={"Idempotency-Key": key()})
    assert third.status_code == 200 and third.headers["AAP-Turn-Id"] != first.headers["AAP-Turn-Id"]


def test_retried_streamed_turn_reattaches_from_its_first_event(stack, client):
    session = client.create_session("echo")
    k = key()
    body = {"messages": user("stream me"), "stream": "delta"}
    first = client.post(f"/v1/sessions/{session}/turns", body, headers={"Idempotency-Key": k})
    again = client.post(f"/v1/sessions/{session}/turns", body, headers={"Idempotency-Key": k})
    assert first.status_code == again.status_code == 200
    assert first.headers["AAP-Turn-Id"] == again.headers["AAP-Turn-Id"]
    events_first, events_again = parse_sse(first.content)[0], parse_sse(again.content)[0]
    assert [(e.id, e.event, e.data) for e in events_first] == [(e.id, e.event, e.data) for e in events_again]
    assert events_again[-1].event == "turn_stop"
    assert client.history(session) == user("stream me") + text_reply("echo: stream me")


def test_concurrent_retries_start_one_turn(pg_stack, demo):
    session = demo.create_session("echo")
    k = key()
    results = []

    def post():
        aap = pg_stack.client()
        try:
            results.append(
                aap.post(
                    f"/v1/sessions/{session}/turns", {"messages": user("together")}, headers={"Idempotency-Key": k}
                )
            )
        finally:
            aap.close()

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [r.status_code for r in results] == [200] * 6, [r.text for r in results]
    assert len({r.headers["AAP-Turn-Id"] for r in results}) == 1
    assert demo.history(session) == user("together") + text_reply("echo: together")


def test_a_refused_request_does_not_use_up_its_key(stack, client):
    session = client.create_session("echo")
    k = key()
    refused = client.post(
        f"/v1/sessions/{session}/turns",
        {"messages": [{"role": "assistant", "content": "x"}]},
        headers={"Idempotency-Key": k},
    )
    assert refused.status_code == 400
    # a refused request stores nothing, its key included: the corrected request may reuse it
    fixed = client.post(f"/v1/sessions/{session}/turns", {"messages": user("fixed")}, headers={"Idempotency-Key": k})
    assert fixed.status_code == 200, fixed.text
    assert client.history(session) == user("fixed") + text_reply("echo: fixed")


def test_malformed_key_is_400(stack, client):
    response = client.post("/v1/sessions", {"agent": {"name": "echo"}}, headers={"Idempotency-Key": "x" * 256})
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]
