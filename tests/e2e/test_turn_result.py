"""`GET /v1/sessions/:id/turns/:turnId`: a turn's state, and once it ended its stored result,
from PostgreSQL alone: what a client whose stream broke reads after the turn's events are
gone (a re-attach then answers 404 and says where the result is)."""

from __future__ import annotations

import redis

from ..turn_checks import user


def test_a_turns_stored_result_outlives_its_events_and_equals_history(pg_stack, demo):
    session = demo.create_session("echo")
    streamed = demo.turn(session, text="kept", stream="delta")
    assert streamed.stop_reason == "end_turn"
    path = f"/v1/sessions/{session}/turns/{streamed.turn_id}"

    done = demo.get(path)
    assert done.status_code == 200, done.text
    body = done.json()
    assert (body["turnId"], body["status"], body["stopReason"]) == (streamed.turn_id, "done", "end_turn")
    assert body["messages"] == streamed.messages
    assert demo.history(session) == user("kept") + body["messages"]

    # Its events expire (deleted here): a re-attach after event 1 is told where the result is.
    events = redis.Redis.from_url(pg_stack.env["REDIS_URL"])
    keys = events.keys(f"aap:*{streamed.turn_id}*")
    assert keys
    events.delete(*keys)
    gone = demo.reattach(session, streamed.turn_id, 3)
    assert gone.status == 404
    assert path in gone.raw.decode()
    assert demo.get(path).json() == body


def test_a_turn_of_another_tenant_or_none_is_not_found(demo, other):
    session = demo.create_session("echo")
    turn_id = demo.turn(session, text="mine").turn_id
    for client, turn in ((other, turn_id), (demo, "turn_nope")):
        response = client.get(f"/v1/sessions/{session}/turns/{turn}")
        assert response.status_code == 404
        assert response.json()["error"].startswith("No turn")
