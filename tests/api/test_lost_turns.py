"""A lost turn is ended only by its own deployment: the one whose queue it waits in
(AAP_TURN_QUEUE), whose Redis holds its events and its lease. Two deployments may share one
database and not one Redis; the other's sweep, or a follower on its web, must not end a turn
whose output it cannot see (it would store an empty answer and tell it to no one)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

pytestmark = pytest.mark.django_db


def _running_turn(queue: str) -> str:
    """A running turn whose worker is gone: its heartbeat long stale, no lease."""
    from django.utils import timezone

    from agents.models import Agent
    from sessions_app.models import Session, Turn
    from tenancy.models import Tenant

    tenant = Tenant.objects.create(name=f"lost-{uuid.uuid4().hex[:8]}")
    agent, _ = Agent.objects.get_or_create(name="lost-echo", defaults={"runtime_kind": "echo"})
    session = Session.objects.create(tenant=tenant, agent=agent)
    long_ago = timezone.now() - timedelta(hours=1)
    turn = Turn.objects.create(
        session=session, status=Turn.RUNNING, queue=queue, started_at=long_ago, heartbeat_at=long_ago
    )
    Session.objects.filter(pk=session.pk).update(active_turn=turn)
    return turn.id


def _status(turn_id: str) -> tuple[str, str]:
    from sessions_app.models import Turn

    turn = Turn.objects.get(id=turn_id)
    return turn.status, turn.error


def test_the_sweep_and_a_follower_end_only_lost_turns_of_their_own_queue(settings):
    from sessions_app.engine import recovery
    from sessions_app.models import Turn

    settings.AAP_TURN_QUEUE = "this-deployment"
    mine, theirs = _running_turn("this-deployment"), _running_turn("another-deployment")
    assert recovery.sweep_stale_turns() == 1
    assert _status(mine) == (Turn.DONE, recovery.LOST_ERROR)  # the positive control
    assert _status(theirs) == (Turn.RUNNING, "")
    assert recovery.turn_recover_if_lost(theirs) is False  # not over, as far as this deployment knows
    assert _status(theirs) == (Turn.RUNNING, "")
    settings.AAP_TURN_QUEUE = "another-deployment"  # its own deployment ends it
    assert recovery.turn_recover_if_lost(theirs) is True
    assert _status(theirs) == (Turn.DONE, recovery.LOST_ERROR)
