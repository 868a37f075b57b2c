"""Turns in flight: the per-session lock, re-attach with Last-Event-ID, cancel and client
disconnects; against the production stack and the embedded mode."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from ..support import fold_events
from ..turn_checks import LiveTurn, assert_sse_shape, checked_turn, text_reply, user, wait_until


def ticks(n: int) -> str:
    return "".join(f"tick {i} " for i in range(1, n + 1))


def test_second_turn_while_one_runs_is_refused_with_409(stack, client):
    session = client.create_session("echo")
    live = LiveTurn.turn(stack, session, "/slow 5 400", stream="delta")
    try:
        live.wait_events(1)
        before = client.history(session)
        for stream in ("none", "delta"):
            conflict = client.turn(session, text="me too", stream=stream)
            assert conflict.status == 409
            assert conflict.headers["content-type"].startswith("application/json")
            assert "turn is already running" in conflict.body["error"]
        assert client.history(session) == before
    finally:
        live.wait_end()
    assert live.result().messages == text_reply(ticks(5))
    assert checked_turn(client, session, user("my turn now")).messages == text_reply("echo: my turn now")


def test_simultaneous_turns_on_one_session_run_one_at_a_time(stack, client):
    session = client.create_session("echo")
    racers = [LiveTurn.turn(stack, session, "/slow 10 500", stream="delta") for _ in range(4)]
    for racer in racers:
        racer.wait_end()
    statuses = sorted(racer.status for racer in racers)
    assert statuses == [200, 409, 409, 409], [(r.status, r.raw[:300]) for r in racers]
    [winner] = [racer for racer in racers if racer.status == 200]
    assert winner.result().messages == text_reply(ticks(10))
    assert client.history(session) == user("/slow 10 500") + text_reply(ticks(10))


@pytest.mark.parametrize("mode", ["delta", "message"])
def test_reattach_mid_turn_gets_exactly_the_missing_events(stack, client, mode):
    session = client.create_session("echo")
    live = LiveTurn.turn(stack, session, "/slow 8 300", stream=mode)
    live.wait_events(3 if mode == "delta" else 1)  # delta: turn_start, tick 1, tick 2
    turn_id = live.turn_id
    k = len(live.events)
    path = f"/v1/sessions/{session}/turns/{turn_id}/events"
    again = LiveTurn(stack, "GET", path, headers={"Last-Event-ID": str(k)})
    original = live.wait_end().result()
    rejoined = again.wait_end().result()
    assert rejoined.status == 200 and rejoined.headers["AAP-Turn-Id"] == turn_id
    assert_sse_shape(original.events, turn_id)
    assert_sse_shape(rejoined.events, first_id=k + 1)
    assert [(e.id, e.event, e.data) for e in rejoined.events] == [(e.id, e.event, e.data) for e in original.events[k:]]


def test_reattach_after_the_end_replays(client):
    session = client.create_session("echo")
    turn = client.turn(session, text="/think replay me", stream="delta")
    everything = client.reattach(session, turn.turn_id)
    assert [(e.id, e.event, e.data) for e in everything.events] == [(e.id, e.event, e.data) for e in turn.events]
    from_zero = client.reattach(session, turn.turn_id, 0)
    assert from_zero.events == turn.events
    tail = client.reattach(session, turn.turn_id, 2)
    assert tail.events == turn.events[2:]
    assert_sse_shape(tail.events, first_id=3)


def test_reattach_after_the_turn_stop_answers_204_so_eventsource_stops(stack, client):
    session = client.create_session("echo")
    turn = client.turn(session, text="done already", stream="delta")
    last = int(turn.events[-1].id)
    for after in (last, last + 5):
        response = client.get(
            f"/v1/sessions/{session}/turns/{turn.turn_id}/events", headers={"Last-Event-ID": str(after)}
        )
        assert response.status_code == 204
        assert response.content == b""


def test_reattach_to_a_none_mode_turn_replays_its_message_events(client):
    session = client.create_session("echo")
    turn = client.turn(session, text="/think quietly")
    replay = client.reattach(session, turn.turn_id)
    assert_sse_shape(replay.events, turn.turn_id)
    assert replay.names == ["turn_start", "thinking", "text", "turn_stop"]
    assert replay.messages == turn.messages


def test_reattach_refuses_a_bad_last_event_id(client):
    session = client.create_session("echo")
    turn = client.turn(session, text="hi", stream="delta")
    for bad in ("abc", "-1", "1.5"):
        response = client.get(f"/v1/sessions/{session}/turns/{turn.turn_id}/events", headers={"Last-Event-ID": bad})
        assert response.status_code == 400, (bad, response.text)
        assert "Last-Event-ID" in response.json()["error"]


def test_another_tenants_turn_is_not_found(stack, client):
    session = client.create_session("echo")
    turn = client.turn(session, text="private", stream="delta")
    other = stack.client("other")
    try:
        for path in (f"/v1/sessions/{session}/turns/{turn.turn_id}/events",):
            response = other.get(path)
            assert response.status_code == 404 and "error" in response.json()
        cancel = other.post(f"/v1/sessions/{session}/turns/{turn.turn_id}/cancel")
        assert cancel.status_code == 404 and "error" in cancel.json()
        unknown = client.get(f"/v1/sessions/{session}/turns/turn_doesnotexist/events")
        assert unknown.status_code == 404
    finally:
        other.close()


@pytest.mark.parametrize("mode", ["delta", "message"])
def test_cancel_stops_the_turn_and_keeps_what_was_produced(stack, client, mode):
    session = client.create_session("echo")
    live = LiveTurn.turn(stack, session, "/slow 20 300", stream=mode)
    live.wait_events(1)
    if mode == "delta":
        live.wait_events(3)
    else:
        time.sleep(1.0)  # message mode shows nothing before the end; let a few ticks happen
    response = client.post(f"/v1/sessions/{session}/turns/{live.turn_id}/cancel")
    assert response.status_code == 202, response.text
    assert response.json()["turnId"] == live.turn_id
    result = live.wait_end().result()
    assert_sse_shape(result.events, live.turn_id)
    stop = result.events[-1].data
    assert stop["stopReason"] == "end_turn"
    assert stop["_meta"]["cancelled"] is True
    full = client.history(session)
    assert full[0] == user("/slow 20 300")[0]
    assert full[1:] == result.messages
    produced = full[1]["content"][0]["text"]
    assert produced.startswith(ticks(1)) and produced != ticks(20) and ticks(20).startswith(produced)
    # cancelling a finished turn is harmless, and the session takes the next turn
    assert client.post(f"/v1/sessions/{session}/turns/{live.turn_id}/cancel").status_code == 202
    assert checked_turn(client, session, user("next")).messages == text_reply("echo: next")


def test_cancel_of_a_none_mode_turn_answers_with_what_was_produced(stack, client):
    session = client.create_session("echo")
    live = LiveTurn.turn(stack, session, "/slow 20 300", stream="none")
    live.wait_for(lambda t: t.headers is not None, what="response headers")
    watch = LiveTurn(stack, "GET", f"/v1/sessions/{session}/turns/{live.turn_id}/events")
    watch.wait_events(1)
    assert client.post(f"/v1/sessions/{session}/turns/{live.turn_id}/cancel").status_code == 202
    live.wait_end()
    body = json.loads(live.raw)
    assert body["stopReason"] == "end_turn"
    assert body["_meta"]["cancelled"] is True
    assert client.history(session)[1:] == body["messages"]
    assert watch.wait_end().result().messages == body["messages"]


def test_client_disconnect_does_not_stop_the_turn(stack, client):
    session = client.create_session("echo")
    live = LiveTurn.turn(stack, session, "/slow 6 400", stream="delta")
    live.wait_events(3)
    turn_id = live.turn_id
    live.close()
    seen = live.events
    assert seen[-1].event != "turn_stop"

    def landed():
        full = client.history(session)
        return full if len(full) == 2 else None

    full = wait_until(landed, timeout=90, message="the whole reply in history")
    assert full == user("/slow 6 400") + text_reply(ticks(6))
    # the events stay available to a listener that comes back
    replay = client.reattach(session, turn_id, len(seen))
    assert fold_events([e.as_dict() for e in seen + replay.events]) == text_reply(ticks(6))
    assert replay.events[-1].data == {"stopReason": "end_turn"}


def test_cancel_before_the_turn_starts_ends_it_cancelled(pg_stack, demo):
    session = demo.create_session("echo")
    os.killpg(pg_stack.worker.pid, signal.SIGSTOP)  # the worker cannot pick the turn up yet
    try:
        live = LiveTurn.turn(pg_stack, session, "/slow 5 100", stream="delta")
        live.wait_for(lambda t: t.headers is not None, what="response headers")
        cancel = demo.post(f"/v1/sessions/{session}/turns/{live.turn_id}/cancel")
        assert cancel.status_code == 202, cancel.text
    finally:
        os.killpg(pg_stack.worker.pid, signal.SIGCONT)
    result = live.wait_end().result()
    assert_sse_shape(result.events, live.turn_id)
    assert result.events[-1].data == {"stopReason": "end_turn", "_meta": {"cancelled": True}}
    assert result.messages == []
    assert demo.history(session) == user("/slow 5 100")
    assert checked_turn(demo, session, user("next")).messages == text_reply("echo: next")
