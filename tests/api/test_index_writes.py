"""What a turn costs the indexes: the statements that store and end a turn change no indexed
column of its session, so PostgreSQL updates the session's row in place (a HOT update, no
new index entry), and no index repeats another's leading column."""

from __future__ import annotations

import pytest
from django.db import connection

from sessions_app.api.services.turns import turn_start
from sessions_app.engine import store
from sessions_app.models import Session, Turn
from tenancy.models import Tenant

from .conftest import API_TENANT, own_sessions
from .test_lock_order import ENDING


@pytest.fixture(autouse=True)
def _postgres_only():
    if connection.vendor != "postgresql":
        pytest.skip("index entries and HOT updates are PostgreSQL's")


def _start(api, session_id: str) -> Turn:
    tenant = Tenant.objects.get(name=API_TENANT)
    return turn_start(tenant=tenant, session_id=session_id, data={"messages": [{"role": "user", "content": "hi"}]})


def _session_updates() -> tuple[int, int]:
    """This transaction's updates of session rows: all of them, and those made in place."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_stat_get_xact_tuples_updated(%s::regclass), pg_stat_get_xact_tuples_hot_updated(%s::regclass)",
            [store.S, store.S],
        )
        return cursor.fetchone()


def test_a_turns_start_and_end_update_its_session_in_place(api):
    session_id = api.create_session()
    before = _session_updates()
    turn = _start(api, session_id)
    Turn.objects.filter(id=turn.id).update(status=Turn.RUNNING)
    assert store.end_turn(turn.id, own_sessions().get(public_id=session_id).pk, **ENDING) is not None
    updated, in_place = (now - then for now, then in zip(_session_updates(), before))
    assert (updated, in_place) == (2, 2)


def test_no_index_of_the_turn_path_repeats_another_or_serves_prefix_matches():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename, indexdef FROM pg_indexes WHERE tablename = ANY(%s)", [[store.S, store.T, store.M]]
        )
        indexes = cursor.fetchall()
    assert not [definition for _, definition in indexes if "varchar_pattern_ops" in definition]
    leading: dict[tuple[str, str], list[str]] = {}
    for table, definition in indexes:
        first = definition.split("(", 1)[1].split(")")[0].split(",")[0].split()[0]
        leading.setdefault((table, first), []).append(definition)
    assert {key: found for key, found in leading.items() if len(found) > 1} == {}


def test_a_turn_deleted_on_its_own_leaves_its_session_usable(api, admin_client):
    """An operator deleting a queued or running turn in Django admin leaves the session's
    pointer to it: the session's pages, its next turn and its deletion read it as no
    active turn."""
    session_id = api.create_session()
    turn = _start(api, session_id)
    deleted = admin_client.post(f"/admin/sessions_app/turn/{turn.id}/delete/", {"post": "yes"})
    assert deleted.status_code == 302 and not Turn.objects.filter(id=turn.id).exists()
    session = Session.objects.get(public_id=session_id)
    assert session.active_turn_id == turn.id
    assert admin_client.get(f"/admin/sessions_app/session/{session.pk}/change/").status_code == 200
    assert api.get(f"/v1/sessions/{session_id}").status_code == 200
    following = _start(api, session_id)
    assert Session.objects.get(public_id=session_id).active_turn_id == following.id
    Turn.objects.filter(id=following.id).delete()
    assert api.delete(f"/v1/sessions/{session_id}").status_code == 204
    assert not Session.objects.filter(public_id=session_id).exists()
