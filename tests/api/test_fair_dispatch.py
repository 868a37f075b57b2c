"""Free worker slots go to waiting turns fairly between tenants (queue.claim_next):
the tenant with the fewest turns running per unit of its weight first. In-process, inside
the test's transaction; other tests' turns may be in the database, so every assertion looks
at the relative order of this test's own turns (which those cannot change)."""

from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.django_db


def _tenant(weight: int = 1):
    from tenancy.models import Tenant

    return Tenant.objects.create(name=f"fair-{uuid.uuid4().hex[:8]}", weight=weight)


def _turns(tenant, count: int, *, running: bool = False, node: str = "") -> list[str]:
    """`count` turns of `tenant`, one session each, in creation order."""
    from agents.models import Agent
    from sessions_app.models import Session, Turn

    agent, _ = Agent.objects.get_or_create(name="fair-echo", defaults={"runtime_kind": "echo"})
    ids = []
    for _ in range(count):
        session = Session.objects.create(tenant=tenant, agent=agent)
        turn = Turn.objects.create(session=session, status=Turn.RUNNING if running else Turn.QUEUED, pinned_node=node)
        ids.append(turn.id)
    return ids


def _order(*groups: list[str]) -> list[str]:
    from sessions_app.engine import queue

    mine = {turn_id for group in groups for turn_id in group}
    return [turn_id for turn_id, _ in queue.fair_order(100_000, 0) if turn_id in mine]


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
    _turns(early, 3, running=True)
    early_turns = _turns(early, 3)
    late_turns = _turns(late, 3)
    assert _order(early_turns, late_turns)[:3] == late_turns


def test_a_turn_waiting_for_a_full_pool_knows_its_place(monkeypatch):
    from sessions_app.engine import queue

    busy, quiet = _tenant(), _tenant()
    _turns(busy, 4, running=True)
    backlog = _turns(busy, 5)
    single = _turns(quiet, 1)
    monkeypatch.setattr(queue, "capacity", lambda counted=None: queue.slots_in_use()[0])  # every slot taken
    places = {turn_id: queue.queued_place(turn_id)["position"] for turn_id in backlog + single}
    assert places[single[0]] < min(places[t] for t in backlog)
    assert [places[t] for t in backlog] == sorted(places[t] for t in backlog)
    assert all(place >= 1 for place in places.values())

    # With a slot free for every waiting turn, none of them is queued.
    waiting = queue.slots_in_use()[1]
    monkeypatch.setattr(queue, "capacity", lambda counted=None: queue.slots_in_use()[0] + waiting)
    assert queue.queued_place(single[0]) is None


def test_the_declarative_file_sets_a_tenants_weight():
    from agents.services import AgentFileError, registry_apply
    from tenancy.models import Tenant

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
    from sessions_app.engine import queue

    settings.AAP_TENANT_MAX_RUNNING_TURNS = 0
    capped, free = _tenant(), _tenant()
    capped.max_running_turns = 3
    capped.save()
    _turns(capped, 2, running=True)
    capped_turns = _turns(capped, 3)
    free_turns = _turns(free, 2)
    order = [(t, ok) for t, ok in queue.fair_order(100_000, 0) if t in capped_turns + free_turns]
    assert order == [
        (free_turns[0], True),
        (free_turns[1], True),
        (capped_turns[0], True),
        (capped_turns[1], False),
        (capped_turns[2], False),
    ]
    # The service's default applies to a tenant that sets no limit of its own.
    free_first = [(t, ok) for t, ok in queue.fair_order(100_000, 1) if t in free_turns]
    assert free_first == [(free_turns[0], True), (free_turns[1], False)]


def _taken_in_order(mine: list[str], count: int, node: str = "node-a", *, pin_seconds: float = 30.0) -> list[str]:
    """What a thread of worker `node` claims, this test's turns only, until `count` of them are
    taken (a waiting turn another test left behind is claimed too, inside this test's
    transaction)."""
    from datetime import timedelta

    from django.utils import timezone

    from sessions_app.engine import queue

    taken: list[str] = []
    pinned_before = timezone.now() - timedelta(seconds=pin_seconds)
    for _ in range(len(mine) + 1000):
        following = queue.claim_next(node, 0, pinned_before)
        if following is None:
            break
        if following[0] in mine:
            taken.append(following[0])
            if len(taken) == count:
                break
    return taken


def test_a_free_thread_claims_the_next_turn_of_the_fair_order():
    from sessions_app.models import Turn

    busy, quiet = _tenant(), _tenant()
    _turns(busy, 4, running=True)
    backlog = _turns(busy, 3)
    single = _turns(quiet, 1)

    assert _taken_in_order(backlog + single, 2) == [single[0], backlog[0]]
    claimed = Turn.objects.get(id=single[0])
    assert claimed.status == Turn.RUNNING and claimed.started_at and claimed.heartbeat_at
    assert Turn.objects.get(id=backlog[1]).status == Turn.QUEUED


def test_a_claim_never_passes_a_tenants_running_limit():
    from sessions_app.models import Turn

    capped = _tenant()
    capped.max_running_turns = 2
    capped.save()
    _turns(capped, 1, running=True)
    waiting = _turns(capped, 3)
    assert _taken_in_order(waiting, 3) == [waiting[0]]  # 2 running now: the limit
    assert [Turn.objects.get(id=t).status for t in waiting[1:]] == [Turn.QUEUED, Turn.QUEUED]


def test_a_pinned_turn_goes_to_its_worker_until_its_pin_expires():
    from sessions_app.models import Turn

    (pinned,) = _turns(_tenant(), 1, node="node-holder")
    assert _taken_in_order([pinned], 1, node="node-other") == []
    assert Turn.objects.get(id=pinned).status == Turn.QUEUED
    assert _taken_in_order([pinned], 1, node="node-holder") == [pinned]

    (orphan,) = _turns(_tenant(), 1, node="node-gone")
    assert _taken_in_order([orphan], 1, node="node-other", pin_seconds=-60) == [orphan]  # its holder is gone


def test_one_statement_ends_a_turn_stores_its_output_and_says_whether_others_wait():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from sessions_app.engine import store
    from sessions_app.models import Message, Session, Turn

    tenant = _tenant()
    (running,) = _turns(tenant, 1, running=True)
    _turns(tenant, 1)
    session_pk = Turn.objects.get(id=running).session_id
    Session.objects.filter(pk=session_pk).update(active_turn_id=running, message_seq=4, prompt_tokens=10)
    answer = [{"role": "assistant", "content": "one"}, {"role": "assistant", "content": "two"}]
    ending = {
        "messages": answer,
        "stop_reason": "end_turn",
        "cancelled": False,
        "error": "",
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "model_calls": 1,
        "pending_calls": [],
    }
    with CaptureQueriesContext(connection) as queries:
        ended = store.end_turn(running, session_pk, **ending)
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert ended == store.EndedTurn(others_waiting=True, message_seq=4)
    turn, session = Turn.objects.get(id=running), Session.objects.get(pk=session_pk)
    assert (turn.status, turn.output_seq, turn.prompt_tokens) == (Turn.DONE, 5, 7)  # its output starts at 5
    assert (session.active_turn_id, session.message_seq, session.prompt_tokens) == (None, 6, 17)
    stored = Message.objects.filter(session_id=session_pk, turn_id=running).order_by("kind", "seq")
    assert [(m.kind, m.seq, m.data) for m in stored] == [
        (kind, seq, store.dumps(message))
        for kind in sorted([Message.COMPACTED, Message.FULL])
        for seq, message in zip((5, 6), answer)
    ]
    assert store.turn_output(running, session_pk, turn.output_seq) == answer
    # Ended once: a second ending finds it no longer running and writes nothing.
    assert store.end_turn(running, session_pk, **ending) is None
    session = Session.objects.get(pk=session_pk)
    assert (session.message_seq, session.prompt_tokens) == (6, 17)
    assert Message.objects.filter(session_id=session_pk, turn_id=running).count() == 4


@pytest.mark.parametrize("other_tenant_waits", [False, True], ids=["only its tenant waits", "another tenant waits"])
@pytest.mark.parametrize("limit", [None, 2], ids=["no limit", "at its limit"])
def test_a_streamed_turn_is_stored_and_placed_by_one_statement_after_the_lock(monkeypatch, limit, other_tenant_waits):
    """turn_start on PostgreSQL: the session's lock, then one statement that stores the turn and
    reads where the worker slots stand. When every waiting turn is its tenant's, its place in
    `turn_start` needs no statement (Room.place); otherwise the fair order is read. Either
    way the place is the one the fair order gives once the turn is stored."""
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from sessions_app.api.services import turns
    from sessions_app.api.services.sessions import session_create
    from sessions_app.engine import events, queue
    from tenancy.models import Tenant

    call_command("seed_demo", stdout=open("/dev/null", "w"))
    tenant = Tenant.objects.get(name="demo")
    Tenant.objects.filter(pk=tenant.pk).update(max_running_turns=limit, max_queued_turns=100)
    tenant.refresh_from_db()
    session_id = session_create(tenant=tenant, agent_config={"name": "echo"}, messages=None, tools=None).public_id
    _turns(tenant, 2, running=True)
    _turns(tenant, 3)
    if other_tenant_waits:
        _turns(_tenant(), 1)
    in_flight = queue.slots_in_use()[0]
    monkeypatch.setattr(queue, "capacity", lambda counted=None: in_flight)  # every slot taken
    published: list[dict] = []
    monkeypatch.setattr(events.backend(), "publish_sync", lambda turn_id, seq, event, **kw: published.append(event))

    body = {"messages": [{"role": "user", "content": "where do I stand?"}], "stream": "delta"}
    with CaptureQueriesContext(connection) as queries:
        turn = turns.turn_start(tenant=tenant, session_id=session_id, data=body)

    statements = [q["sql"] for q in queries]
    (stored,) = [sql for sql in statements if "INSERT INTO sessions_app_turn" in sql]
    assert " seen AS (SELECT COALESCE(SUM(CASE WHEN t.status" in stored  # the slots, read as it is stored
    assert not [sql for sql in statements if sql.startswith("SELECT COALESCE(SUM(CASE WHEN t.status")]
    fair_order = [sql for sql in statements if "ROW_NUMBER()" in sql]
    assert len(fair_order) == other_tenant_waits  # read only when another tenant's turns wait
    told = published[0]["_meta"]["queued"]
    assert told == queue.queued_place(turn.id)  # as the fair order says, now the turn is stored
    assert told == {"position": 4 if not other_tenant_waits else 5}  # after the 3 (and the other tenant's 1)
