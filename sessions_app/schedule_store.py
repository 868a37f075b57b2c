"""The statements of fair dispatch (sessions_app.dispatch): which turns hold or wait for a
worker slot, the fair order of the waiting ones, and the workers' heartbeats that say how
many slots there are. SQL for the same reason as turn_store: they run on every turn."""

from __future__ import annotations

from datetime import datetime

from django.db import connection

from .models import Turn, Worker
from .turn_store import TENANT, S, T, _now, waiting

W = Worker._meta.db_table
_ACTIVE = f"t.status IN ('{Turn.QUEUED}', '{Turn.RUNNING}')"
_WAITING = waiting("t")
# Running, or handed to the broker and about to run: what holds (or will hold) a worker slot.
_IN_FLIGHT = f"{_ACTIVE} AND (t.status = '{Turn.RUNNING}' OR t.dispatched_at IS NOT NULL)"


def any_waiting() -> bool:
    """Some turn waits for a worker slot (one indexed read: the chooser's work is skipped
    when nothing waits, which is every turn's end below saturation)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {T} t WHERE {_WAITING} LIMIT 1")
        return cursor.fetchone() is not None


def room_for(turn_id: str, tenant_id: int, workers_seen_since: datetime) -> tuple[int, int, int, int]:
    """(in flight, waiting, this tenant's in flight, worker slots) in one statement; turn
    `turn_id` (about to be stored) is left out of the waiting ones."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COALESCE(SUM(CASE WHEN t.status = %s OR t.dispatched_at IS NOT NULL THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN t.status = %s AND t.dispatched_at IS NULL AND t.id <> %s THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN (t.status = %s OR t.dispatched_at IS NOT NULL) AND s.tenant_id = %s "
            f"THEN 1 ELSE 0 END), 0), "
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
            f"SELECT COALESCE(SUM(CASE WHEN t.status = %s OR t.dispatched_at IS NOT NULL THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN t.status = %s AND t.dispatched_at IS NULL THEN 1 ELSE 0 END), 0) "
            f"FROM {T} t WHERE {_ACTIVE}",
            [Turn.RUNNING, Turn.QUEUED],
        )
        in_flight, waiting = cursor.fetchone()
    return int(in_flight), int(waiting)


_FAIR_ORDER = (
    f"WITH inflight AS (SELECT s.tenant_id AS tenant_id, COUNT(*) AS n FROM {T} t "
    f"JOIN {S} s ON s.id = t.session_id WHERE {_IN_FLIGHT} GROUP BY s.tenant_id), "
    f"waiting AS (SELECT t.id AS id, t.created_at AS created_at, s.tenant_id AS tenant_id, "
    f"ROW_NUMBER() OVER (PARTITION BY s.tenant_id ORDER BY t.created_at, t.id) AS n "
    f"FROM {T} t JOIN {S} s ON s.id = t.session_id WHERE {_WAITING}), "
    f"ranked AS (SELECT w.id AS id, w.created_at AS created_at, "
    f"(COALESCE(i.n, 0) + w.n) * 1.0 / tn.weight AS share, "
    f"CASE WHEN COALESCE(tn.max_running_turns, %s) = 0 "
    f"OR COALESCE(i.n, 0) + w.n <= COALESCE(tn.max_running_turns, %s) THEN 1 ELSE 0 END AS may_start "
    f"FROM waiting w JOIN {TENANT} tn ON tn.id = w.tenant_id LEFT JOIN inflight i ON i.tenant_id = w.tenant_id) "
)
_IN_FAIR_ORDER = "FROM ranked ORDER BY may_start DESC, share, created_at, id LIMIT %s"


def fair_order(limit: int, default_max_running: int) -> list[tuple[str, bool]]:
    """Waiting turns in the order free worker slots should take them, each with whether it
    may take one now. A tenant's n-th waiting turn would make it run (its turns in flight + n)
    at once: lowest of that per unit of the tenant's weight first, then oldest first (so a
    tenant's own turns keep their order). A turn that would pass its tenant's running-turns
    limit (`default_max_running` where the tenant sets none; 0: no limit) may not start yet:
    those come last."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"{_FAIR_ORDER}SELECT id, may_start {_IN_FAIR_ORDER}",
            [default_max_running, default_max_running, limit],
        )
        return [(row[0], bool(row[1])) for row in cursor.fetchall()]


def fair_order_with_room(
    limit: int, default_max_running: int, workers_seen_since: datetime
) -> tuple[list[tuple[str, bool]], int, int]:
    """fair_order, with (turns in flight, worker slots) read by the same statement; nothing
    when no turn waits."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"{_FAIR_ORDER}SELECT id, may_start, (SELECT COALESCE(SUM(n), 0) FROM inflight), "
            f"(SELECT COALESCE(SUM(concurrency), 0) FROM {W} WHERE seen_at >= %s) {_IN_FAIR_ORDER}",
            [
                default_max_running,
                default_max_running,
                connection.ops.adapt_datetimefield_value(workers_seen_since),
                limit,
            ],
        )
        rows = cursor.fetchall()
    if not rows:
        return [], 0, 0
    return [(row[0], bool(row[1])) for row in rows], int(rows[0][2]), int(rows[0][3])


def mark_dispatched(turn_ids: list[str]) -> list[str]:
    """Record that these queued turns go to the broker now; returns those still queued."""
    if not turn_ids:
        return []
    marks = ", ".join(["%s"] * len(turn_ids))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {T} SET dispatched_at = %s WHERE status = %s AND id IN ({marks}) RETURNING id",
            [_now(), Turn.QUEUED, *turn_ids],
        )
        return [row[0] for row in cursor.fetchall()]


def dispatched_turns(older_than: datetime, limit: int = 500) -> list[str]:
    """Queued turns handed to the broker before `older_than` and not yet claimed, oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {T} t WHERE t.status = %s AND t.dispatched_at IS NOT NULL AND t.dispatched_at < %s "
            f"ORDER BY t.dispatched_at LIMIT %s",
            [Turn.QUEUED, connection.ops.adapt_datetimefield_value(older_than), limit],
        )
        return [row[0] for row in cursor.fetchall()]


def waiting_since(turn_id: str) -> tuple[str, datetime | None] | None:
    """(status, dispatched_at) of a turn; None when it is gone."""
    return Turn.objects.filter(id=turn_id).values_list("status", "dispatched_at").first()


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
