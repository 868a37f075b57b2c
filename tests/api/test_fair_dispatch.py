"""Free worker slots go to waiting turns fairly between tenants (sessions_app.dispatch):
the tenant with the fewest turns in flight per unit of its weight first. In-process, inside
the test's transaction; other tests' turns may be in the database, so every assertion looks
at the relative order of this test's own turns (which those cannot change)."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db


def _tenant(weight: int = 1):
    from hosting.models import Tenant

    return Tenant.objects.create(name=f"fair-{uuid.uuid4().hex[:8]}", weight=weight)


def _turns(tenant, count: int, *, dispatched: bool = False, running: bool = False) -> list[str]:
    """`count` turns of `tenant`, one session each, in creation order."""
    from agents.models import Agent
    from sessions_app.models import Session, Turn

    agent, _ = Agent.objects.get_or_create(name="fair-echo", defaults={"runtime_kind": "echo"})
    ids = []
    for _ in range(count):
        session = Session.objects.create(tenant=tenant, agent=agent)
        turn = Turn.objects.create(
            session=session,
            status=Turn.RUNNING if running else Turn.QUEUED,
            dispatched_at=timezone.now() if dispatched or running else None,
        )
        ids.append(turn.id)
    return ids


def _order(*groups: list[str]) -> list[str]:
    from sessions_app import schedule_store

    mine = {turn_id for group in groups for turn_id in group}
    return [turn_id for turn_id, _ in schedule_store.fair_order(100_000, 0) if turn_id in mine]


def test_one_waiting_turn_of_a_tenant_goes_before_another_tenants_backlog():
    busy, quiet = _tenant(), _tenant()
    _turns(busy, 16, running=True)
    backlog = _turns(busy, 40)
    single = _turns(quiet, 1)
    order = _order(backlog, single)
    assert order[0] == single[0]
    assert order[1:] == backlog  # a tenant's own turns keep their order


def test_free_slots_are_shared_by_weight():
    light, heavy = _tenant(weight=1), _tenant(weight=3)
    light_turns = _turns(light, 10)
    heavy_turns = _turns(heavy, 10)
    first = _order(light_turns, heavy_turns)[:8]
    assert sum(turn_id in heavy_turns for turn_id in first) == 6
    assert sum(turn_id in light_turns for turn_id in first) == 2


def test_turns_in_flight_count_against_their_tenant():
    early, late = _tenant(), _tenant()
    _turns(early, 3, dispatched=True)  # handed to the broker, not yet running: slots taken
    early_turns = _turns(early, 3)
    late_turns = _turns(late, 3)
    assert _order(early_turns, late_turns)[:3] == late_turns


def test_a_turn_waiting_for_a_full_pool_knows_its_place(monkeypatch):
    from sessions_app import dispatch, schedule_store

    busy, quiet = _tenant(), _tenant()
    _turns(busy, 4, running=True)
    backlog = _turns(busy, 5)
    single = _turns(quiet, 1)
    monkeypatch.setattr(dispatch, "capacity", lambda counted=None: schedule_store.slots_in_use()[0])  # every slot taken
    places = {turn_id: dispatch.queued_place(turn_id)["position"] for turn_id in backlog + single}
    assert places[single[0]] < min(places[t] for t in backlog)
    assert [places[t] for t in backlog] == sorted(places[t] for t in backlog)
    assert all(place >= 1 for place in places.values())

    # With a slot free for every waiting turn, none of them is queued.
    waiting = schedule_store.slots_in_use()[1]
    monkeypatch.setattr(dispatch, "capacity", lambda counted=None: schedule_store.slots_in_use()[0] + waiting)
    assert dispatch.queued_place(single[0]) is None


def test_choosing_marks_turns_dispatched_fairly(monkeypatch):
    from sessions_app import dispatch, schedule_store
    from sessions_app.models import Turn

    busy, quiet = _tenant(), _tenant()
    _turns(busy, 2, running=True)
    backlog = _turns(busy, 3)
    single = _turns(quiet, 1)
    # One slot free beyond every other waiting turn in the database (each takes its own).
    others = [t for t, _ in schedule_store.fair_order(100_000, 0) if t not in backlog + single]
    in_flight = schedule_store.slots_in_use()[0]
    monkeypatch.setattr(dispatch, "capacity", lambda counted=None: in_flight + len(others) + 1)
    chosen = dispatch.choose_next()
    assert single[0] in chosen and not set(backlog) & set(chosen)
    assert Turn.objects.get(id=single[0]).dispatched_at is not None
    assert not Turn.objects.filter(id__in=backlog, dispatched_at__isnull=False).exists()
    assert dispatch.choose_next() == []  # every slot is taken now


def test_the_declarative_file_sets_a_tenants_weight():
    from agents.services import AgentFileError, registry_apply
    from hosting.models import Tenant

    name = f"fair-{uuid.uuid4().hex[:8]}"
    registry_apply({"tenants": [{"name": name, "weight": 4, "limits": {"maxRunningTurns": 2}}]})
    assert Tenant.objects.get(name=name).weight == 4
    registry_apply({"tenants": [{"name": name}]})
    assert Tenant.objects.get(name=name).weight == 4  # left alone when the file does not say
    for bad in (0, 1001, "2", True):
        with pytest.raises(AgentFileError, match="'weight' must be a whole number from 1 to 1000"):
            registry_apply({"tenants": [{"name": name, "weight": bad}]})


def test_the_client_tells_waiting_from_running():
    from aap.sse import SSEParser

    parser = SSEParser()
    (start,) = parser.feed(
        b'id: 1\nevent: turn_start\ndata: {"_meta": {"turnId": "turn_x", "queued": {"position": 2}}}\n\n'
    )
    assert start.queued == {"position": 2} and parser.queued == {"position": 2}
    assert parser.feed(b': queued {"position":1}\n\n') == [] and parser.queued == {"position": 1}
    parser.feed(b": ping\n\n")
    assert parser.queued == {"position": 1}
    (delta,) = parser.feed(b'id: 2\nevent: text_delta\ndata: {"delta": "hi"}\n\n')
    assert delta.queued is None and parser.queued is None
    (plain,) = SSEParser().feed(b'id: 1\nevent: turn_start\ndata: {"_meta": {"turnId": "turn_y"}}\n\n')
    assert plain.queued is None


def test_a_tenant_never_runs_more_turns_at_once_than_its_limit(settings):
    from sessions_app import schedule_store

    settings.AAP_TENANT_MAX_RUNNING_TURNS = 0
    capped, free = _tenant(), _tenant()
    capped.max_running_turns = 3
    capped.save()
    _turns(capped, 2, running=True)
    capped_turns = _turns(capped, 3)
    free_turns = _turns(free, 2)
    order = [(t, ok) for t, ok in schedule_store.fair_order(100_000, 0) if t in capped_turns + free_turns]
    assert order == [
        (free_turns[0], True),
        (free_turns[1], True),
        (capped_turns[0], True),
        (capped_turns[1], False),
        (capped_turns[2], False),
    ]
    # The service's default applies to a tenant that sets no limit of its own.
    free_first = [(t, ok) for t, ok in schedule_store.fair_order(100_000, 1) if t in free_turns]
    assert free_first == [(free_turns[0], True), (free_turns[1], False)]


def _taken_in_order(mine: list[str], count: int) -> list[str]:
    """What `take_next` claims, this test's turns only, until `count` of them are taken (a
    waiting turn another test left behind is claimed too, inside this test's transaction)."""
    from sessions_app import worker

    taken: list[str] = []
    for _ in range(len(mine) + 1000):
        following = worker.take_next()
        if following is None:
            break
        if following[0] in mine:
            taken.append(following[0])
            if len(taken) == count:
                break
    return taken


def test_a_thread_whose_turn_ended_claims_the_next_turn_of_the_fair_order(monkeypatch):
    from sessions_app import dispatch
    from sessions_app.models import Turn

    busy, quiet = _tenant(), _tenant()
    _turns(busy, 4, running=True)
    backlog = _turns(busy, 3)
    single = _turns(quiet, 1)
    monkeypatch.setattr(dispatch, "capacity", lambda counted=None: 1_000_000)  # the ended turn's slot is free
    sent: list[str] = []
    monkeypatch.setattr(dispatch, "_send", lambda turn_id, node=None: sent.append(turn_id) or True)

    assert _taken_in_order(backlog + single, 2) == [single[0], backlog[0]]
    claimed = Turn.objects.get(id=single[0])
    assert claimed.status == Turn.RUNNING and claimed.started_at and claimed.dispatched_at
    assert not sent  # the thread runs it itself: nothing goes through the broker
    assert Turn.objects.get(id=backlog[1]).status == Turn.QUEUED


def test_a_thread_leaves_its_slot_to_a_turn_sent_through_the_broker_meanwhile(monkeypatch):
    from sessions_app import dispatch, worker
    from sessions_app.models import Turn

    waiting = _turns(_tenant(), 1)
    # Every slot is held (running, or dispatched through the broker and about to run): the
    # thread goes back to the broker instead of taking a waiting turn beyond the workers' slots.
    monkeypatch.setattr(dispatch, "capacity", lambda counted=None: 0)
    assert worker.take_next() is None
    assert Turn.objects.get(id=waiting[0]).status == Turn.QUEUED


def test_the_statement_ending_a_turn_says_whether_others_wait():
    from sessions_app import turn_store

    tenant = _tenant()
    (running,) = _turns(tenant, 1, running=True)
    _turns(tenant, 1)
    ended = turn_store.end_turn(
        running, stop_reason="end_turn", cancelled=False, error="", prompt_tokens=0, completion_tokens=0, model_calls=0
    )
    assert ended is not None and ended.others_waiting
    # Ended once: a second ending finds it no longer running.
    again = turn_store.end_turn(
        running, stop_reason="end_turn", cancelled=False, error="", prompt_tokens=0, completion_tokens=0, model_calls=0
    )
    assert again is None


def test_a_request_does_not_queue_behind_a_chooser_at_work(monkeypatch):
    """The chooser's lock is held elsewhere (another process choosing right now): the web
    request that found a slot free leaves the choice to it instead of waiting (the periodic
    callers, a worker's heartbeat round and the sweep, still wait for their turn at the lock)."""
    import time

    import psycopg
    from django.db import connection

    from sessions_app import dispatch, schedule_store
    from sessions_app.models import Turn

    (waiting,) = _turns(_tenant(), 1)
    others = [t for t, _ in schedule_store.fair_order(100_000, 0) if t != waiting]
    in_flight = schedule_store.slots_in_use()[0]
    monkeypatch.setattr(dispatch, "capacity", lambda counted=None: in_flight + len(others) + 1)
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], password=db["PASSWORD"] or None, dbname=db["NAME"]
    ) as holder:
        holder_pid = holder.info.backend_pid
        holder.execute("SELECT pg_advisory_lock(%s)", [dispatch._DISPATCH_LOCK])
        assert dispatch.choose_next(wait=False) == []  # at once: another chooser is at work
        assert Turn.objects.get(id=waiting).dispatched_at is None
    with connection.cursor() as cursor:  # the holder's backend is gone before the test database is dropped
        for _ in range(100):
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # else read once per transaction
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [holder_pid])
            if not cursor.fetchone()[0]:
                break
            time.sleep(0.02)
    assert waiting in dispatch.choose_next(wait=False)  # nobody else choosing: this one does
