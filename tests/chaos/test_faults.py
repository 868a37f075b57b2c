"""Faults an operator's service meets: deploys (SIGTERM), crashes (SIGKILL), Redis and
PostgreSQL restarts, a web process killed mid-request, a burst larger than the workers.

Each test does the fault and checks what clients see: every accepted turn ends `end_turn`
(or `error` where its worker really died, with what it produced kept), every response ends
or closes within a bound, history is what the agent produced, once, and nothing answers 500.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .faults import (
    Database,
    final_stop,
    folded,
    history,
    new_key,
    new_sessions,
    next_turn_works,
    no_server_errors,
    post_turn,
    request,
    ticks,
    user,
)

pytestmark = pytest.mark.timeout(300)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_warm_shutdown_finishes_running_turns_and_hands_queued_ones_back(chaos):
    """A deploy: SIGTERM to the only worker while it runs 4 long turns and 4 more wait, then
    turns posted during its drain; a new worker starts once it has drained. Every turn runs to
    its end, however long it waited."""
    chaos.ensure_up(workers=("a",))
    db = Database(chaos.pg.url)
    sessions = new_sessions(chaos, 12)
    with ThreadPoolExecutor(12) as pool:
        running = [pool.submit(post_turn, chaos, s, "/slow 30 500") for s in sessions[:4]]
        time.sleep(1.0)
        waiting = [pool.submit(post_turn, chaos, s, "/slow 4 100") for s in sessions[4:8]]
        time.sleep(1.0)  # 4 turns running on the worker's 4 threads, 4 waiting
        chaos.signal_worker("a", signal.SIGTERM)
        during = [pool.submit(post_turn, chaos, s, "/slow 4 100") for s in sessions[8:]]
        chaos.workers["a"].wait(60)  # the drain ends once the running turns are done (~15 s)
        chaos.start_named_worker("b")
        outcomes = [f.result(timeout=120) for f in running + waiting + during]
    no_server_errors(outcomes)
    for index, (session, outcome) in enumerate(zip(sessions, outcomes)):
        assert outcome.error is None and outcome.status == 200, (outcome.status, outcome.error)
        assert outcome.body["stopReason"] == "end_turn", outcome.body
        text, answer = ("/slow 30 500", ticks(30)) if index < 4 else ("/slow 4 100", ticks(4))
        assert outcome.body["messages"] == answer
        assert history(chaos, session) == user(text) + answer
    assert all(status == "done" for status, _ in db.turn_statuses([o.turn_id for o in outcomes]).values())


def test_killed_worker_ends_its_running_turns_truthfully_and_its_queue_runs_elsewhere(chaos):
    """SIGKILL to the only worker while 4 turns run (2 in `none`, 2 in `message` mode) and
    4 wait. The running ones end `error` with what the agent had produced kept in history and
    shown to their clients; the waiting ones run to their end on the next worker."""
    chaos.ensure_up(workers=("a",))
    db = Database(chaos.pg.url)
    sessions = new_sessions(chaos, 8)
    modes = ["none", "message", "none", "message"]
    with ThreadPoolExecutor(8) as pool:
        victims = [pool.submit(post_turn, chaos, s, "/slow 40 300", stream=m) for s, m in zip(sessions[:4], modes)]
        time.sleep(0.5)
        waiting = [pool.submit(post_turn, chaos, s, "/slow 4 100") for s in sessions[4:]]

        def victims_produced():
            rows = db.turn_statuses(_running_turn_ids(db, sessions[:4]))
            return len(rows) == 4 and all(status == "running" and partial for status, partial in rows.values())

        wait_until(victims_produced, 30, "4 running turns with output checkpointed")
        time.sleep(1.0)
        chaos.signal_worker("a", signal.SIGKILL).wait(10)
        chaos.start_named_worker("b")
        killed = [f.result(timeout=120) for f in victims]
        queued = [f.result(timeout=120) for f in waiting]
    no_server_errors(killed + queued)
    for session, outcome in zip(sessions[:4], killed):
        assert outcome.error is None and outcome.status == 200, (outcome.status, outcome.error)
        stop = outcome.stop()
        assert stop["stopReason"] == "error"
        assert stop["_meta"]["error"] == "The worker running this turn stopped before finishing."
        produced = folded(outcome)
        assert produced, "what the agent produced before the crash was lost"
        text = produced[0]["content"][0]["text"]
        # what the agent produced before the crash survives, in message and none mode alike
        assert text.startswith("tick 1 tick 2 ") and text.endswith(" ") and len(produced) == 1, produced
        assert history(chaos, session) == user("/slow 40 300") + produced
    for session, outcome in zip(sessions[4:], queued):
        assert outcome.body["stopReason"] == "end_turn", outcome.body
        assert history(chaos, session) == user("/slow 4 100") + ticks(4)
    for session in sessions:
        assert next_turn_works(chaos, session, "after the crash").body["stopReason"] == "end_turn"


def _running_turn_ids(db: Database, sessions: list[str]) -> list[str]:
    import psycopg

    with psycopg.connect(db.url) as conn:
        rows = conn.execute(
            "SELECT t.id FROM sessions_app_turn t JOIN sessions_app_session s ON s.id = t.session_id "
            "WHERE s.public_id = ANY(%s)",
            [sessions],
        ).fetchall()
    return [row[0] for row in rows]


def test_redis_restart_under_open_streams(chaos):
    """Redis is killed under 20 turn streams and restarted 5 s later. Meanwhile a new turn
    is refused with 503 and nothing is stored; after, a client retrying while its turn runs
    gets 409, every stream ends or closes, every turn ends `end_turn` with its whole answer
    in history, and the next requests all get answers."""
    chaos.ensure_up()
    sessions = new_sessions(chaos, 21)
    idle = sessions.pop()
    with ThreadPoolExecutor(20) as pool:
        streams = [pool.submit(post_turn, chaos, s, "/slow 24 500", stream="delta") for s in sessions]
        time.sleep(2.0)
        chaos.redis.stop()
        refused = post_turn(chaos, idle, "while redis is down")
        time.sleep(5.0)
        chaos.redis.start()
        retry = post_turn(chaos, sessions[0], "/slow 24 500", stream="delta")
        outcomes = [f.result(timeout=120) for f in streams]  # each ends or closes: none hangs
    no_server_errors([refused, retry, *outcomes])
    assert refused.status == 503, refused.raw
    assert history(chaos, idle) == []  # nothing half-written
    assert retry.status in (409, 503), retry.raw  # never a second turn beside a running one
    for session, outcome in zip(sessions, outcomes):
        assert outcome.status == 200, (outcome.status, outcome.error)
        stop = outcome.stop() or final_stop(chaos, session, outcome.turn_id)
        assert stop["stopReason"] == "end_turn", stop
        assert history(chaos, session) == user("/slow 24 500") + ticks(24)
        replay = final_stop(chaos, session, outcome.turn_id)  # re-attaching ends
        assert replay["stopReason"] == "end_turn"
    # right after the restart, every request is answered (no stale pooled connection hangs)
    with ThreadPoolExecutor(10) as pool:
        fresh = list(pool.map(lambda s: post_turn(chaos, s, "hello again"), sessions[:20]))
    no_server_errors(fresh)
    for outcome in fresh:
        assert outcome.error is None and outcome.status == 200, (outcome.status, outcome.error)
        assert outcome.body["messages"][0]["content"][0]["text"] == "echo: hello again"
    assert post_turn(chaos, idle, "redis is back").body["stopReason"] == "end_turn"


def test_postgres_fast_restart_under_load(chaos):
    """PostgreSQL restarts (`-m fast`: every connection dies) while 8 turns stream, 4 wait in
    `none` mode and a client keeps making JSON requests. Requests during the restart may get
    503 with Retry-After, nothing else; every turn ends `end_turn` with its whole answer."""
    chaos.ensure_up()
    sessions = new_sessions(chaos, 12)
    stop_requests = False
    side: list = []

    def json_requests():
        from .faults import request

        while not stop_requests:
            side.append(request(chaos, "GET", f"/v1/sessions/{sessions[0]}"))
            side.append(request(chaos, "POST", "/v1/sessions", json_body={"agent": {"name": "echo"}}))
            time.sleep(0.1)

    with ThreadPoolExecutor(14) as pool:
        loader = pool.submit(json_requests)
        turns = [
            pool.submit(post_turn, chaos, s, "/slow 10 400", stream="delta" if i < 8 else "none")
            for i, s in enumerate(sessions)
        ]
        time.sleep(1.5)
        chaos.pg.restart_fast()
        outcomes = [f.result(timeout=120) for f in turns]
        time.sleep(1.0)
        stop_requests = True
        loader.result(timeout=60)
    no_server_errors(outcomes + side)
    assert all(o.error is None for o in side), [repr(o.error) for o in side if o.error]
    assert {o.status for o in side} <= {200, 201, 503}
    for session, outcome in zip(sessions, outcomes):
        assert outcome.error is None and outcome.status == 200, (outcome.status, outcome.error)
        stop = outcome.stop() or final_stop(chaos, session, outcome.turn_id)
        assert stop["stopReason"] == "end_turn", stop
        assert history(chaos, session) == user("/slow 10 400") + ticks(10)
    for session in sessions[:4]:
        assert next_turn_works(chaos, session, "after the restart", timeout=10).body["stopReason"] == "end_turn"


def test_web_process_killed_during_posts(chaos):
    """Daphne is SIGKILLed while 40 clients post turns with an Idempotency-Key, and started
    again; each client retries with its key until it gets its answer. Every session ends
    with its message and the answer once, and takes the next turn at once."""
    chaos.ensure_up()
    sessions = new_sessions(chaos, 40)
    keys = {session: new_key() for session in sessions}

    def until_answered(session: str):
        deadline = time.monotonic() + 120
        attempts = []
        while time.monotonic() < deadline:
            outcome = post_turn(chaos, session, "/slow 3 200", key=keys[session])
            attempts.append(outcome)
            if outcome.status == 200 and outcome.stop() is not None:
                return outcome, attempts
            time.sleep(0.5)
        raise AssertionError(f"no answer for {session}: {[(a.status, a.error) for a in attempts]}")

    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(until_answered, s) for s in sessions]
        time.sleep(0.4)
        chaos.kill_web()
        chaos.start_web()
        results = [f.result(timeout=180) for f in futures]
    no_server_errors([a for _, attempts in results for a in attempts])
    interrupted = sum(len(attempts) > 1 for _, attempts in results)
    assert interrupted, "the kill interrupted no request: the test did not test anything"
    for session, (outcome, _) in zip(sessions, results):
        assert outcome.body["stopReason"] == "end_turn", outcome.body
        assert outcome.body["messages"] == ticks(3)
        assert history(chaos, session) == user("/slow 3 200") + ticks(3)  # once, whatever the retries
    for session in sessions[:10]:
        assert next_turn_works(chaos, session, "next", timeout=5).body["stopReason"] == "end_turn"


def test_burst_larger_than_the_worker_pool_waits_and_runs(chaos):
    """96 turns of 4 s at once on 8 worker threads: about 50 s of queue. Waiting is not
    failure: every turn runs to its end."""
    chaos.ensure_up()
    sessions = new_sessions(chaos, 96)
    with ThreadPoolExecutor(96) as pool:
        outcomes = list(pool.map(lambda s: post_turn(chaos, s, "/slow 2 4000"), sessions))
    no_server_errors(outcomes)
    for outcome in outcomes:
        assert outcome.error is None and outcome.status == 200, (outcome.status, outcome.error)
        assert outcome.body["stopReason"] == "end_turn", outcome.body
        assert outcome.body["messages"] == ticks(2)
    for session in sessions[:10]:
        assert history(chaos, session) == user("/slow 2 4000") + ticks(2)


def test_frozen_worker_declared_lost_is_fenced_off(chaos):
    """Both workers freeze (SIGSTOP: a stalled VM, a long pause) longer than the lease while
    a turn runs; its follower declares it lost and ends it with `error`, keeping what was
    streamed. The workers wake: the turn's worker finds its stream ended (the fence), stops
    its agent and writes nothing more. The turn ended once, history holds what its client
    was told, a re-attach replays that same ending, and the session goes on."""
    chaos.ensure_up()
    session = new_sessions(chaos, 1)[0]
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(post_turn, chaos, session, "/slow 20 300", stream="delta")
        time.sleep(1.5)
        for label in ("a", "b"):
            chaos.signal_worker(label, signal.SIGSTOP)
        try:
            outcome = stream.result(timeout=60)  # the follower ends it while the workers are frozen
        finally:
            for label in ("a", "b"):
                chaos.signal_worker(label, signal.SIGCONT)
    told = outcome.stop()
    assert told is not None and told["stopReason"] == "error", outcome.raw[-300:]
    shown = folded(outcome)
    assert shown and shown != ticks(20), shown  # it was cut short

    # The agent would have finished 6 s after its start: give the woken worker time to try.
    time.sleep(8)
    assert history(chaos, session) == user("/slow 20 300") + shown
    replay = request(chaos, "GET", f"/v1/sessions/{session}/turns/{outcome.turn_id}/events")
    stops = [e.data for e in replay.events if e.event == "turn_stop"]
    assert stops == [told], replay.raw[-400:]
    assert folded(replay) == shown
    assert next_turn_works(chaos, session, "awake").body["stopReason"] == "end_turn"
    assert history(chaos, session) == user("/slow 20 300") + shown + user("awake") + [
        {"role": "assistant", "content": [{"type": "text", "text": "echo: awake"}]}
    ]


def test_a_saturating_tenant_leaves_the_next_free_slot_on_either_worker_to_another(chaos, tmp_path):
    """The noisy neighbour on two workers: tenant A keeps all 8 threads of workers a and b
    busy with a backlog; tenant B's short turns each wait at most for one of A's turns to end,
    whichever worker frees first; A's excess is refused with 429, nothing fails."""
    from tests.e2e.test_fairness import noisy_neighbour

    chaos.ensure_up()
    noisy_neighbour(chaos, tmp_path, 2 * chaos.WORKER_THREADS)
