"""A worker's claim of a turn: at most once, and on PostgreSQL with the turn's session read in
the same statement (what session_for_turn reads on its own)."""

from __future__ import annotations

import contextlib
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from sessions_app.api.services.sessions import session_create
from sessions_app.engine import queue, store
from sessions_app.engine.worker import direct_connection_params
from sessions_app.models import Session, Turn, Worker
from tenancy.models import Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def session_pk():
    call_command("seed_demo", stdout=open("/dev/null", "w"))
    created = session_create(
        tenant=Tenant.objects.get(name="demo"), agent_config={"name": "echo"}, messages=None, tools=None
    )
    return Session.objects.get(public_id=created.public_id).pk


def _queued(session_pk: int) -> str:
    turn_id = "turn_" + uuid.uuid4().hex
    store.start_turn(
        turn_id,
        session_pk,
        "delta",
        [{"toolCallId": "c1", "granted": True}],
        first_seq=1,
        messages=[],
        session_fields={},
        aim=queue.aimed_worker(),
    )
    return turn_id


def _claim_mine(mine: set[str], node: str = "node-a"):
    """Claims as a thread would, until one of `mine` is taken (other tests' waiting turns are
    claimed too, inside this test's transaction); the claim and the statements it took."""
    from datetime import timedelta

    from django.utils import timezone

    for _ in range(1000):
        with CaptureQueriesContext(connection) as queries:
            taken = queue.claim_next(node, 0, timezone.now() - timedelta(seconds=30))
        if taken is None or taken[0] in mine:
            return taken, len(queries)
    raise AssertionError("never claimed")


def test_a_claim_reads_the_turn_and_its_session_in_one_statement(session_pk):
    turn_id = _queued(session_pk)
    taken, statements = _claim_mine({turn_id})
    assert taken is not None and taken[0] == turn_id
    claimed = taken[1]
    assert statements == 1
    assert (claimed.session_pk, claimed.stream, claimed.permissions) == (
        session_pk,
        "delta",
        [{"toolCallId": "c1", "granted": True}],
    )
    assert claimed.session == store.session_for_turn(session_pk)
    assert claimed.session.tenant_name == "demo"
    assert _claim_mine({turn_id})[0] is None  # claimed once: nothing left to claim


def test_the_fallback_claim_of_one_turn_is_once_too(session_pk):
    turn_id = _queued(session_pk)
    claimed = store.claim_turn(turn_id)
    assert claimed is not None and claimed.session == store.session_for_turn(session_pk)
    assert store.claim_turn(turn_id) is None


@contextlib.contextmanager
def _listening(*nodes: str):
    """Each of `nodes` holds its listener's lock, as a worker listening for wake-ups does."""
    params = direct_connection_params()
    with contextlib.ExitStack() as stack:
        for node in nodes:
            conn = stack.enter_context(psycopg.connect(**params, autocommit=True))
            conn.execute(f"SELECT pg_advisory_lock({queue.listening_key('%s')})", [node])
            # Let go before the connection closes: the server ends a closed one a moment later.
            stack.callback(conn.execute, "SELECT pg_advisory_unlock_all()")
        yield


def test_a_turn_wakes_the_live_worker_of_its_queue_with_the_most_free_slots(session_pk):
    from datetime import timedelta

    from django.utils import timezone

    tag = uuid.uuid4().hex[:8]
    now = timezone.now()
    Worker.objects.all().delete()  # only this test's workers (the test's transaction rolls back)
    small, large = f"small-{tag}", f"large-{tag}"
    Worker.objects.create(node=small, concurrency=2, seen_at=now)
    Worker.objects.create(node=large, concurrency=4, seen_at=now)
    # Neither another queue's worker nor one whose heartbeat stopped is woken, however free,
    # nor one that does not listen (killed: its connection, and its lock, are gone).
    Worker.objects.create(node=f"elsewhere-{tag}", queue="other", concurrency=99, seen_at=now)
    Worker.objects.create(node=f"gone-{tag}", concurrency=99, seen_at=now - timedelta(hours=1))
    Worker.objects.create(node=f"killed-{tag}", concurrency=99, seen_at=now)

    def aimed_at(turn_id: str) -> str:
        return Turn.objects.get(id=turn_id).worker_node

    with _listening(small, large, f"elsewhere-{tag}", f"gone-{tag}"):
        first, second = _queued(session_pk), _queued(session_pk)
        # Free slots: large 4, then 3 with the first turn waiting for it; small 2.
        assert [aimed_at(first), aimed_at(second)] == [large, large]
        # A claim counts the turn against the worker that runs it: small has 1 free, large 3.
        taken, _ = _claim_mine({first, second}, node=small)
        assert taken is not None and aimed_at(taken[0]) == small
        assert aimed_at(_queued(session_pk)) == large
    # With no worker listening, the wake-up goes to every worker.
    assert aimed_at(_queued(session_pk)) == ""
