"""The one lock order of every transaction on a session and its turns (docs/api.md,
"Guarantees"): the session's row first, then the turn's. A turn's end is one statement on
PostgreSQL; these tests hold the session's row from another connection and check what that
statement holds while it waits for it."""

from __future__ import annotations

import contextlib
import threading

import psycopg
import pytest
from django.db import connection

from sessions_app.engine import store
from sessions_app.engine.worker import direct_connection_params
from sessions_app.models import Message, Session, Turn

from ..turn_checks import wait_until
from .test_fair_dispatch import _tenant, _turns

pytestmark = pytest.mark.django_db(transaction=True)

ENDING = {
    "messages": [{"role": "assistant", "content": "kept"}],
    "stop_reason": "end_turn",
    "cancelled": False,
    "error": "",
    "prompt_tokens": 3,
    "completion_tokens": 2,
    "model_calls": 1,
    "pending_calls": [],
}


def _end_in_thread(turn_id: str, session_pk: int) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["ended"] = store.end_turn(turn_id, session_pk, **ENDING)
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _waits_for_a_lock(other: psycopg.Connection) -> None:
    """Until the ending's backend waits for a lock (the session's row, held by `other`)."""

    def waiting() -> int:
        other.execute("SELECT pg_stat_clear_snapshot()")  # inside its transaction, the view is read once
        (count,) = other.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE 'WITH locked%%'"
        ).fetchone()
        return count

    wait_until(waiting, timeout=10, interval=0.02, message="the turn's end to wait for the session's lock")


@contextlib.contextmanager
def _end_waiting_for_the_session(turn_id: str, session_pk: int):
    """Another connection holds the session's row while the turn's end waits for it; what
    it does inside commits as the block ends, and the end goes on. Yields that connection
    and where the end's result goes."""
    with psycopg.connect(**direct_connection_params()) as other:
        other.execute(f"SELECT 1 FROM {store.S} WHERE id = %s FOR UPDATE", [session_pk])
        thread, result = _end_in_thread(turn_id, session_pk)
        _waits_for_a_lock(other)
        yield other, result
        other.commit()
        thread.join(10)
    assert not thread.is_alive()


def _running_turn() -> tuple[str, int]:
    if connection.vendor != "postgresql":
        pytest.skip("the lock order is PostgreSQL's: SQLite serializes writers")
    (turn_id,) = _turns(_tenant(), 1, running=True)
    session_pk = Turn.objects.get(id=turn_id).session_id
    Session.objects.filter(pk=session_pk).update(active_turn_id=turn_id, message_seq=2)
    return turn_id, session_pk


def test_a_turns_end_waiting_for_its_session_holds_no_lock_on_the_turn():
    """A delete (or the sweep) holding the session can lock the turn while the end waits, so
    the two never wait for each other; once it has ended the turn, the end writes nothing."""
    turn_id, session_pk = _running_turn()
    with _end_waiting_for_the_session(turn_id, session_pk) as (other, result):
        # NOWAIT: an error at once if the waiting end had locked the turn's row before the session's.
        other.execute(f"SELECT 1 FROM {store.T} WHERE id = %s FOR UPDATE NOWAIT", [turn_id])
        other.execute(f"UPDATE {store.T} SET status = %s, error = %s WHERE id = %s", [Turn.DONE, "lost", turn_id])
    assert result["ended"] is None
    session = Session.objects.get(pk=session_pk)
    assert (session.message_seq, session.active_turn_id, session.prompt_tokens) == (2, turn_id, 0)
    assert not Message.objects.filter(session_id=session_pk).exists()
    assert Turn.objects.get(id=turn_id).error == "lost"


def test_a_turns_end_reads_the_sessions_position_after_its_lock():
    """What a transaction holding the session committed is what the end appends after."""
    turn_id, session_pk = _running_turn()
    with _end_waiting_for_the_session(turn_id, session_pk) as (other, result):
        other.execute(f"UPDATE {store.S} SET message_seq = 7 WHERE id = %s", [session_pk])
    assert result["ended"].message_seq == 7
    assert Session.objects.get(pk=session_pk).message_seq == 8
    assert list(Message.objects.filter(session_id=session_pk).values_list("kind", "seq").order_by("kind")) == [
        (Message.COMPACTED, 8),
        (Message.FULL, 8),
    ]
    assert Turn.objects.get(id=turn_id).output_seq == 8
