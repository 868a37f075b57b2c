"""PostgreSQL that stalls or keeps dropping connections while turns run.

A stall (every PostgreSQL process stopped: a saturated disk, a paused VM) is longer than the
lease: workers whose turns finished meanwhile cannot store them until it ends, yet no turn
is declared lost for that alone (their Redis leases are kept) and every client is told the
answer history keeps. Flapping connections (every backend terminated every 2 s) are
replaced by the pools: no finished turn ends `error` for them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from .faults import (
    SILENCE_SECONDS,
    final_stop,
    folded,
    history,
    new_sessions,
    next_turn_works,
    no_server_errors,
    post_turn,
    ticks,
    user,
)

pytestmark = pytest.mark.timeout(300)

MODES = ("delta", "message", "none")


def _told_equals_history(chaos, session: str, outcome, text: str, ticks_count: int) -> None:
    assert outcome.error is None and outcome.status == 200, (outcome.status, outcome.error, outcome.raw[-300:])
    stop = outcome.stop() or final_stop(chaos, session, outcome.turn_id)
    assert stop["stopReason"] == "end_turn", stop
    kept = history(chaos, session)
    assert kept == user(text) + ticks(ticks_count), kept
    if outcome.stop() is not None:
        assert folded(outcome) == ticks(ticks_count)


def test_a_postgres_stall_longer_than_the_lease_declares_no_turn_lost(chaos):
    """12 turns in the three stream modes; 1 s in, PostgreSQL stops for 4 leases and longer
    than a client waits in silence. The turns finish during the stall, their workers wait to
    store them; those still queued wait for it. Every stream keeps pinging meanwhile (its
    checks of PostgreSQL hang, its pings do not wait for them), and every client is told
    `end_turn` with the whole answer, which is what history holds."""
    chaos.ensure_up()
    sessions = new_sessions(chaos, 12)
    text = "/slow 6 300"
    with ThreadPoolExecutor(12) as pool:
        turns = [pool.submit(post_turn, chaos, s, text, stream=MODES[i % 3]) for i, s in enumerate(sessions)]
        time.sleep(1.0)
        frozen = chaos.pg.freeze()
        try:
            time.sleep(max(4 * 3, SILENCE_SECONDS) + 3)  # the chaos stack's lease is 3 s
        finally:
            chaos.pg.thaw(frozen)
        outcomes = [f.result(timeout=120) for f in turns]
    no_server_errors(outcomes)
    for session, outcome in zip(sessions, outcomes):
        _told_equals_history(chaos, session, outcome, text, 6)
    assert next_turn_works(chaos, sessions[0], "after the stall", timeout=30).body["stopReason"] == "end_turn"


def _terminate_backends(url: str, stop: threading.Event, every: float) -> int:
    """Terminate every connection to the service's database, again and again."""
    killed = 0
    while not stop.wait(every):
        with psycopg.connect(url.replace("/aap", "/postgres"), autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'aap' AND pid <> pg_backend_pid()"
            ).fetchall()
            killed += len(rows)
    return killed


def test_flapping_connections_fail_no_finished_turn(chaos):
    """Every connection to the database is terminated every 2 s for the whole run while 24
    turns are posted and run. A POST may be refused (503, nothing stored); every accepted
    turn ends `end_turn` with the answer history holds."""
    chaos.ensure_up()
    sessions = new_sessions(chaos, 24)
    text = "/slow 6 400"
    stop = threading.Event()
    url = chaos.pg.url.replace("postgres://", "postgresql://", 1)
    with ThreadPoolExecutor(25) as pool:
        killer = pool.submit(_terminate_backends, url, stop, 2.0)
        try:
            turns = []
            for i, session in enumerate(sessions):
                turns.append(pool.submit(post_turn, chaos, session, text, stream=MODES[i % 3]))
                time.sleep(0.25)
            outcomes = [f.result(timeout=180) for f in turns]
        finally:
            stop.set()  # never left running for the tests after this one
        assert killer.result(timeout=30) > 0
    no_server_errors(outcomes)
    accepted = [(s, o) for s, o in zip(sessions, outcomes) if o.status != 503]
    assert len(accepted) >= len(sessions) // 2, [o.status for o in outcomes]
    for session, outcome in accepted:
        _told_equals_history(chaos, session, outcome, text, 6)
    for session, outcome in zip(sessions, outcomes):
        if outcome.status == 503:
            assert history(chaos, session) == [], "a refused POST stored its turn"
