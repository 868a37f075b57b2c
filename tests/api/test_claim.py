"""A worker's claim of a turn: at most once, and on PostgreSQL with the turn's session read in
the same statement (what session_for_turn reads on its own)."""

from __future__ import annotations

import uuid

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from hosting.models import Tenant
from sessions_app import turn_store
from sessions_app.models import Session
from sessions_app.services.sessions import session_create

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
    turn_store.insert_turn(turn_id, session_pk, "delta", [{"toolCallId": "c1", "granted": True}])
    return turn_id


def test_a_claim_reads_the_turn_and_its_session_in_one_statement(session_pk):
    turn_id = _queued(session_pk)
    with CaptureQueriesContext(connection) as queries:
        claimed = turn_store.claim_turn(turn_id)
    assert claimed is not None
    assert len(queries) == 1
    assert (claimed.session_pk, claimed.stream, claimed.permissions) == (
        session_pk,
        "delta",
        [{"toolCallId": "c1", "granted": True}],
    )
    assert claimed.session == turn_store.session_for_turn(session_pk)
    assert claimed.session.tenant_name == "demo"
    assert turn_store.claim_turn(turn_id) is None  # a second delivery finds nothing to do


def test_a_thread_claiming_the_first_waiting_turn_reads_its_session_too(session_pk):
    first, second = _queued(session_pk), _queued(session_pk)
    with CaptureQueriesContext(connection) as queries:
        taken = turn_store.claim_first([second, first])
    assert taken is not None
    turn_id, claimed = taken
    assert turn_id == second
    assert len(queries) == 1
    assert claimed.session == turn_store.session_for_turn(session_pk)
    assert turn_store.claim_first([second]) is None
