"""The statements of the one queue: the claim that hands the next waiting turn to a worker
thread (fair between tenants, within each tenant's running limit, pinned turns to their
worker), which turns hold or wait for a worker slot, and the workers' heartbeats that say
how many slots there are. SQL for the same reason as turn_store: they run on every turn."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import connection
from django.utils import timezone

from ..models import Turn, Worker
from . import store
from .store import TENANT, S, T, _now, waiting

W = Worker._meta.db_table
_ACTIVE = f"t.status IN ('{Turn.QUEUED}', '{Turn.RUNNING}')"
_WAITING = waiting("t")
# What holds a worker slot.
_IN_FLIGHT = f"t.status = '{Turn.RUNNING}'"


def room_for(turn_id: str, tenant_id: int, workers_seen_since: datetime) -> tuple[int, int, int, int]:
    """(in flight, waiting, this tenant's in flight, worker slots) in one statement; turn
    `turn_id` (about to be stored) is left out of the waiting ones."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COALESCE(SUM(CASE WHEN t.status = %s THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN t.status = %s AND t.id <> %s THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN t.status = %s AND s.tenant_id = %s THEN 1 ELSE 0 END), 0), "
            f"(SELECT COALESCE(SUM(concurrency), 0) FROM {W} WHERE seen_at >= %s) "
            f"FROM {T} t JOIN {S} s ON s.id = t.session_id WHERE {_ACTIVE}",
            [
                Turn.RUNNING,
                Turn.QUEUED,
                turn_id,
                Turn.RUNNING,
                tenant_id,
                connection.ops.adapt_datetimefield_value(workers_seen_since),
            ],
        )
        row = cursor.fetchone()
    return tuple(int(value or 0) for value in row)  # type: ignore[return-value]


def slots_in_use() -> tuple[int, int]:
    """(turns holding a worker slot, turns waiting for one)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COALESCE(SUM(CASE WHEN t.status = %s THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN t.status = %s THEN 1 ELSE 0 END), 0) "
            f"FROM {T} t WHERE {_ACTIVE}",
            [Turn.RUNNING, Turn.QUEUED],
        )
        in_flight, waiting = cursor.fetchone()
    return int(in_flight), int(waiting)


_FAIR_ORDER = (
    f"WITH inflight AS (SELECT s.tenant_id AS tenant_id, COUNT(*) AS n FROM {T} t "
    f"JOIN {S} s ON s.id = t.session_id WHERE {_IN_FLIGHT} GROUP BY s.tenant_id), "
    f"waiting AS (SELECT t.id AS id, t.created_at AS created_at, t.pinned_node AS pinned_node, t.queue AS queue, "
    f"s.tenant_id AS tenant_id, "
    f"ROW_NUMBER() OVER (PARTITION BY s.tenant_id ORDER BY t.created_at, t.id) AS n "
    f"FROM {T} t JOIN {S} s ON s.id = t.session_id WHERE {_WAITING}), "
    f"ranked AS (SELECT w.id AS id, w.created_at AS created_at, w.pinned_node AS pinned_node, w.queue AS queue, "
    f"(COALESCE(i.n, 0) + w.n) * 1.0 / tn.weight AS share, "
    f"CASE WHEN COALESCE(tn.max_running_turns, %s) = 0 "
    f"OR COALESCE(i.n, 0) + w.n <= COALESCE(tn.max_running_turns, %s) THEN 1 ELSE 0 END AS may_start "
    f"FROM waiting w JOIN {TENANT} tn ON tn.id = w.tenant_id LEFT JOIN inflight i ON i.tenant_id = w.tenant_id) "
)
_IN_FAIR_ORDER = "FROM ranked ORDER BY may_start DESC, share, created_at, id LIMIT %s"


def fair_order(
    limit: int, default_max_running: int, *, node: str | None = None, pinned_before: datetime | None = None
) -> list[tuple[str, bool]]:
    """Waiting turns in the order free worker slots should take them, each with whether it
    may take one now. A tenant's n-th waiting turn would make it run (its turns in flight + n)
    at once: lowest of that per unit of the tenant's weight first, then oldest first (so a
    tenant's own turns keep their order). A turn that would pass its tenant's running-turns
    limit (`default_max_running` where the tenant sets none; 0: no limit) may not start yet:
    those come last. With `node`: only the turns a thread of that worker may take (in its
    queue, AAP_TURN_QUEUE; not pinned to another worker, or accepted before `pinned_before`)."""
    order = _IN_FAIR_ORDER
    params: list[int | str | None] = [default_max_running, default_max_running, limit]
    if node is not None:
        order = order.replace(
            "FROM ranked", "FROM ranked WHERE queue = %s AND (pinned_node = '' OR pinned_node = %s OR created_at < %s)"
        )
        params[2:2] = [settings.AAP_TURN_QUEUE, node, connection.ops.adapt_datetimefield_value(pinned_before)]
    with connection.cursor() as cursor:
        cursor.execute(f"{_FAIR_ORDER}SELECT id, may_start {order}", params)
        return [(row[0], bool(row[1])) for row in cursor.fetchall()]


# The claim: the first waiting turn of the fair order that may start, is pinned to no other
# worker (or its pin expired) and that no other thread is claiming (SKIP LOCKED: threads
# claiming at the same instant take the next one instead of waiting), queued -> running.
_CLAIM = (
    f"{_FAIR_ORDER[len('WITH ') :]}, "
    f"pick AS (SELECT q.id FROM {T} q JOIN (SELECT id, share, created_at FROM ranked WHERE may_start = 1 "
    f"AND queue = %s AND (pinned_node = '' OR pinned_node = %s OR created_at < %s) "
    f"ORDER BY share, created_at, id LIMIT %s) r "
    f"ON r.id = q.id WHERE q.status = '{Turn.QUEUED}' ORDER BY r.share, r.created_at, r.id LIMIT 1 "
    f"FOR UPDATE OF q SKIP LOCKED), "
    f"claimed AS (UPDATE {T} SET status = '{Turn.RUNNING}', started_at = %s, heartbeat_at = %s "
    f"WHERE id = (SELECT id FROM pick) AND status = '{Turn.QUEUED}' RETURNING id, {store.CLAIMED_COLUMNS})"
)
# How many of the fair order's first turns one claim may skip (taken by threads claiming at
# the same instant) before it reads the order again.
_PICKS = 8


def claim_next(node: str, default_max_running: int, pinned_before: datetime) -> tuple[str, store.ClaimedTurn] | None:
    """The one hand-off of a turn to a worker thread: claim the waiting turn the fair order
    gives the slot of a thread of worker `node`, with its session; None when none may start
    now. Only turns of this process's queue (AAP_TURN_QUEUE). A turn pinned to another worker is taken once it was accepted before `pinned_before`."""
    started = timezone.now()
    now = connection.ops.adapt_datetimefield_value(started)
    pinned = connection.ops.adapt_datetimefield_value(pinned_before)
    if connection.vendor != "postgresql":  # the embedded default (SQLite): writes are serialized
        for turn_id, may_start in fair_order(_PICKS, default_max_running, node=node, pinned_before=pinned_before):
            taken = store.claim_turn(turn_id) if may_start else None
            if taken is not None:
                return turn_id, taken
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            store.with_session(_CLAIM, "claimed"),
            [default_max_running, default_max_running, settings.AAP_TURN_QUEUE, node, pinned, _PICKS, now, now],
        )
        row = cursor.fetchone()
    return (row[0], store.claimed(row[1:], started)) if row else None


def worker_beat(node: str, concurrency: int) -> None:
    """A worker process is alive and runs up to `concurrency` turns at once."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {W} (node, concurrency, seen_at) VALUES (%s, %s, %s) "
            f"ON CONFLICT (node) DO UPDATE SET concurrency = EXCLUDED.concurrency, seen_at = EXCLUDED.seen_at",
            [node, concurrency, _now()],
        )


def worker_gone(node: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {W} WHERE node = %s", [node])


def worker_slots(seen_since: datetime) -> int:
    """Turns the workers seen alive since `seen_since` can run at once."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COALESCE(SUM(concurrency), 0) FROM {W} WHERE seen_at >= %s",
            [connection.ops.adapt_datetimefield_value(seen_since)],
        )
        return int(cursor.fetchone()[0])
