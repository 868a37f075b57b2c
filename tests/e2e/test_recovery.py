"""Crash recovery on the production stack: a worker killed mid-turn ends its turn with
`error` for whoever listens, what it produced and the incoming message stay in history, and
the session takes the next turn; turns wake their worker through PostgreSQL, and a turn
whose wake-up nobody heard runs anyway."""

from __future__ import annotations

import json
from contextlib import contextmanager

import psycopg

from sessions_app.engine.store import WAKE_CHANNEL

from ..support import fold_events
from ..turn_checks import LiveTurn, assert_sse_shape, checked_turn, text_reply, user, wait_until

RECOVERY_SECONDS = 30  # the contract: a lost turn ends within 30 seconds


@contextmanager
def worker_restored(stack):
    """Whatever happens inside, leave the stack with a live worker (and never two)."""
    try:
        yield
    finally:
        if stack.worker.poll() is not None:
            stack.start_worker()


def test_worker_killed_mid_turn_ends_the_turn_with_error(pg_stack, demo):
    session = demo.create_session("echo")
    live = LiveTurn.turn(pg_stack, session, "/slow 60 300", stream="delta")
    with worker_restored(pg_stack):
        live.wait_events(3)  # turn_start, tick 1, tick 2: the worker is in the middle of the turn
        pg_stack.kill_worker()
        turn_id = live.turn_id
        rejoined = LiveTurn(
            pg_stack, "GET", f"/v1/sessions/{session}/turns/{turn_id}/events", headers={"Last-Event-ID": "1"}
        ).wait_end(timeout=RECOVERY_SECONDS)
        original = live.wait_end(timeout=RECOVERY_SECONDS).result()
    events = rejoined.result().events
    assert_sse_shape(events, first_id=2)
    assert events[-1].data["stopReason"] == "error"
    assert events[-1].data["_meta"]["error"]
    assert_sse_shape(original.events, turn_id)
    assert [(e.id, e.event, e.data) for e in original.events[1:]] == [(e.id, e.event, e.data) for e in events]
    # what listeners saw is what history holds: the incoming message, then the ticks streamed so far
    produced = fold_events([e.as_dict() for e in original.events])
    assert produced and produced[0]["content"][0]["text"].startswith("tick 1 tick 2 ")
    assert demo.history(session) == user("/slow 60 300") + produced
    # the session takes the next turn, on the fresh worker
    assert checked_turn(demo, session, user("back again"), stream="delta").messages == text_reply("echo: back again")


def test_worker_killed_mid_turn_answers_a_waiting_none_request_with_error(pg_stack, demo):
    session = demo.create_session("echo")
    waiting = LiveTurn.turn(pg_stack, session, "/slow 60 300", stream="none")
    with worker_restored(pg_stack):
        waiting.wait_for(lambda t: t.headers is not None, what="response headers")
        watch = LiveTurn(pg_stack, "GET", f"/v1/sessions/{session}/turns/{waiting.turn_id}/events")
        watch.wait_events(1)  # turn_start: the worker is running the turn
        pg_stack.kill_worker()
        waiting.wait_end(timeout=RECOVERY_SECONDS)
        watched = watch.wait_end(timeout=RECOVERY_SECONDS).result()
    body = json.loads(waiting.raw)
    assert body["stopReason"] == "error"
    assert body["_meta"]["turnId"] == waiting.turn_id
    assert watched.events[-1].data["stopReason"] == "error"
    assert demo.history(session) == user("/slow 60 300") + body["messages"]
    assert checked_turn(demo, session, user("next")).messages == text_reply("echo: next")


@contextmanager
def worker_that_never_looks_on_its_own(stack):
    """The stack's worker replaced by one whose timed look is an hour apart: a turn it runs
    was heard of through PostgreSQL (or at its start). The usual worker is back afterwards."""
    stack.kill_worker()
    usual = stack.env
    stack.env = {**usual, "AAP_WORKER_POLL_SECONDS": "3600"}
    try:
        stack.worker = stack.spawn_worker("celery-deaf-timer", 4)
        yield
    finally:
        stack.env = usual
        stack.kill_worker()
        stack.start_worker()


def _listeners(stack) -> list[int]:
    """The backends of the stack's database listening for waiting turns."""
    with psycopg.connect(stack.env["DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query = %s",
            [f'LISTEN "{WAKE_CHANNEL}"'],
        ).fetchall()
    return [pid for (pid,) in rows]


def test_a_turn_wakes_its_worker_through_postgresql(pg_stack, demo):
    """No broker message, no timer: the insert's notification, heard at the commit."""
    session = demo.create_session("echo")
    with worker_that_never_looks_on_its_own(pg_stack):
        wait_until(lambda: _listeners(pg_stack), message="the worker listening")
        for text in ("heard", "heard again"):
            live = LiveTurn.turn(pg_stack, session, text, stream="delta").wait_end(timeout=60)
            events = live.result().events
            assert_sse_shape(events, live.turn_id)
            assert events[-1].data["stopReason"] == "end_turn"
            assert fold_events([e.as_dict() for e in events]) == text_reply(f"echo: {text}")
        said = [*user("heard"), *text_reply("echo: heard"), *user("heard again"), *text_reply("echo: heard again")]
        assert demo.history(session) == said


def test_a_wake_up_nobody_heard_costs_the_turn_nothing(pg_stack, demo):
    """The listener's connection is cut (a PostgreSQL restart, a proxy): the turn stored
    meanwhile is found when the worker listens again, and later turns are heard as before."""
    session = demo.create_session("echo")
    with worker_that_never_looks_on_its_own(pg_stack):
        listening = wait_until(lambda: _listeners(pg_stack), message="the worker listening")
        with psycopg.connect(pg_stack.env["DATABASE_URL"], autocommit=True) as conn:
            for pid in listening:
                conn.execute("SELECT pg_terminate_backend(%s)", [pid])
        waiting = LiveTurn.turn(pg_stack, session, "unheard", stream="none")
        waiting.wait_end(timeout=60)
        body = json.loads(waiting.raw)
        assert waiting.status == 200 and body["stopReason"] == "end_turn", body
        assert body["messages"] == text_reply("echo: unheard")
        assert demo.history(session) == user("unheard") + body["messages"]
        wait_until(lambda: set(_listeners(pg_stack)) - set(listening), message="the worker listening again")
        after = LiveTurn.turn(pg_stack, session, "and now?", stream="none").wait_end(timeout=60)
        assert json.loads(after.raw)["messages"] == text_reply("echo: and now?")


def test_lost_turn_nobody_watches_is_ended_by_the_next_turn(pg_stack, demo):
    session = demo.create_session("echo")
    live = LiveTurn.turn(pg_stack, session, "/slow 60 300", stream="delta")
    with worker_restored(pg_stack):
        live.wait_events(3)
        live.close()  # nobody listens any more
        pg_stack.kill_worker()

    def next_turn():
        result = demo.turn(session, text="after the crash")
        # 409 while the dead worker's lease lasts: the turn still counts as running
        assert result.status in (200, 409), result.raw
        return result if result.status == 200 else None

    result = wait_until(next_turn, timeout=RECOVERY_SECONDS, interval=1.0, message="the session to take a turn again")
    assert result.messages == text_reply("echo: after the crash")
    full = demo.history(session)
    assert full[0] == user("/slow 60 300")[0]
    assert full[1]["role"] == "assistant" and full[1]["content"][0]["text"].startswith("tick 1 tick 2 ")
    assert full[2:] == user("after the crash") + result.messages
    stop = demo.reattach(session, live.turn_id, 1).events[-1].data
    assert stop["stopReason"] == "error"
