"""Crash recovery on the production stack: a worker killed mid-turn ends its turn with
`error` for whoever listens, what it produced and the incoming message stay in history, and
the session takes the next turn; a turn whose wake-up Redis lost runs anyway."""

from __future__ import annotations

import json
from contextlib import contextmanager

import redis

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


def test_turn_whose_wake_up_was_lost_with_redis_data_runs_anyway(pg_stack, demo):
    """A turn waits in PostgreSQL only: the broker carries a wake-up, and a worker with a free
    thread looks for waiting turns on its own (AAP_WORKER_POLL_SECONDS)."""
    session = demo.create_session("echo")
    broker = redis.Redis.from_url(pg_stack.env["REDIS_URL"])
    with worker_restored(pg_stack):
        pg_stack.kill_worker()
        waiting = LiveTurn.turn(pg_stack, session, "never lost", stream="none")
        wait_until(lambda: broker.llen("aap-turns") > 0, message="the wake-up in the broker queue")
        broker.delete("aap-turns")  # Redis loses its data (a restart without persistence)
    waiting.wait_end(timeout=60)
    assert waiting.status == 200
    body = json.loads(waiting.raw)
    assert body["stopReason"] == "end_turn", body
    assert body["messages"] == text_reply("echo: never lost")
    assert demo.history(session) == user("never lost") + body["messages"]
    assert checked_turn(demo, session, user("and now?"), stream="message").messages == text_reply("echo: and now?")


def test_turn_whose_wake_up_a_dying_worker_took_runs_anyway(pg_stack, demo):
    """A message leaves the queue when a worker takes it (no ack emulation): a worker that dies
    right after taking a wake-up leaves nothing to reconcile; the turn waits in PostgreSQL
    and the next worker takes it."""
    session = demo.create_session("echo")
    broker = redis.Redis.from_url(pg_stack.env["REDIS_URL"])
    with worker_restored(pg_stack):
        pg_stack.kill_worker()
        waiting = LiveTurn.turn(pg_stack, session, "taken, then dropped", stream="none")
        wait_until(lambda: broker.llen("aap-turns") > 0, message="the wake-up in the broker queue")
        taken = json.loads(broker.rpop("aap-turns"))  # what Kombu's BRPOP does for a worker, which then dies
        waiting.wait_for(lambda t: t.headers is not None, what="response headers")
        assert taken["headers"]["task"] == "sessions_app.tasks.wake"
        assert broker.llen("aap-turns") == 0
    waiting.wait_end(timeout=60)
    assert waiting.status == 200
    body = json.loads(waiting.raw)
    assert body["stopReason"] == "end_turn", body
    assert body["messages"] == text_reply("echo: taken, then dropped")
    assert demo.history(session) == user("taken, then dropped") + body["messages"]


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
