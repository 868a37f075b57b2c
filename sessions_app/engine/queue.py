"""The one queue: turns wait in PostgreSQL, workers are woken for them, and a worker thread
claims them here.

PostgreSQL is the one queue. A turn is committed `queued` and waits there until a worker
thread with a free slot claims it (sessions_app.engine.worker, `claim_next`: fair between
tenants by weight, within each tenant's running limit, pinned turns to their worker, in one
statement). When the turn commits, a worker's bell rings: on PostgreSQL, the notification
that the turn's insert sent, aimed at one worker (`aimed_worker`; heard by its listener,
sessions_app.engine.worker); on SQLite, a Celery message with no turn in it (to the worker
that holds the prompt a turn answers, when it is pinned), or, in the embedded mode, this
process's own worker. A lost
wake-up costs latency, never a turn: each worker looks for waiting turns every
AAP_WORKER_POLL_SECONDS while a thread of its is free, and a thread whose turn ends claims
the next itself. Celery holds no state that must be reconciled with PostgreSQL.

Here too: which turns hold or wait for a worker slot and where a waiting turn stands, the
workers' heartbeats that say how many slots there are (SQL for the same reason as
store.py: they run on every turn), and the queue as Prometheus gauges."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from celery import current_app
from celery.utils.nodenames import worker_direct
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count
from django.utils import timezone
from django.utils.module_loading import import_string
from prometheus_client.core import GaugeMetricFamily

from infra.handlers import release_connections
from infra.outages import DB_ERRORS

from ..models import Turn, Worker
from . import store
from .store import TENANT, S, T, _now, waiting

logger = logging.getLogger(__name__)

W = Worker._meta.db_table
_ACTIVE = f"t.status IN ('{Turn.QUEUED}', '{Turn.RUNNING}')"
_WAITING = waiting("t")
# What holds a worker slot.
_IN_FLIGHT = f"t.status = '{Turn.RUNNING}'"


def _room_sql(turn_id: str, tenant_id: int, workers_seen_since: datetime) -> tuple[str, list]:
    """SQL and its parameters for one row: (in flight, waiting, this tenant's in flight, this
    tenant's waiting, worker slots); turn `turn_id` (about to be stored) is left out of the
    waiting ones. store.start_turn reads it in the statement that stores the turn."""
    return (
        f"SELECT COALESCE(SUM(CASE WHEN t.status = %s THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN t.status = %s AND t.id <> %s THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN t.status = %s AND s.tenant_id = %s THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN t.status = %s AND t.id <> %s AND s.tenant_id = %s THEN 1 ELSE 0 END), 0), "
        f"(SELECT COALESCE(SUM(concurrency), 0) FROM {W} WHERE seen_at >= %s) "
        f"FROM {T} t JOIN {S} s ON s.id = t.session_id WHERE {_ACTIVE}",
        [
            Turn.RUNNING,
            Turn.QUEUED,
            turn_id,
            Turn.RUNNING,
            tenant_id,
            Turn.QUEUED,
            turn_id,
            tenant_id,
            connection.ops.adapt_datetimefield_value(workers_seen_since),
        ],
    )


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
    f"claimed AS (UPDATE {T} SET status = '{Turn.RUNNING}', started_at = %s, heartbeat_at = %s, worker_node = %s "
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
            [default_max_running, default_max_running, settings.AAP_TURN_QUEUE, node, pinned, _PICKS, now, now, node],
        )
        row = cursor.fetchone()
    return (row[0], store.claimed(row[1:], started)) if row else None


def worker_beat(node: str, concurrency: int) -> None:
    """A worker process is alive and runs up to `concurrency` turns at once."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {W} (node, queue, concurrency, seen_at) VALUES (%s, %s, %s, %s) "
            f"ON CONFLICT (node) DO UPDATE SET queue = EXCLUDED.queue, concurrency = EXCLUDED.concurrency, "
            f"seen_at = EXCLUDED.seen_at",
            [node, settings.AAP_TURN_QUEUE, concurrency, _now()],
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


# --- wake-ups, and where a waiting turn stands ------------------------------------------------


# The Celery task that wakes a worker (sessions_app.tasks), sent by name: tasks import the
# worker, which imports services, which import this module.
WAKE = "sessions_app.tasks.wake"
# This process's own worker, in the embedded mode (sessions_app.engine.worker), by name likewise.
EMBEDDED_WAKE = "sessions_app.engine.worker.wake_embedded"


# A worker's wake-up listener holds this session-level advisory lock (its node's key) while it
# listens (sessions_app.engine.worker); PostgreSQL releases it the moment that connection
# ends, as when the worker is killed.
_LISTENING_NAMESPACE = 0x4141_4C53


def listening_key(node_sql: str) -> str:
    """SQL of the advisory lock key of the worker named by the SQL expression `node_sql`."""
    return f"(({_LISTENING_NAMESPACE}::bigint << 32) | (hashtext({node_sql})::bigint & 4294967295))"


_AIM = (
    f"SELECT w.node FROM {W} w LEFT JOIN (SELECT t.worker_node AS node, COUNT(*) AS n FROM {T} t "
    f"WHERE {_ACTIVE} GROUP BY t.worker_node) a ON a.node = w.node WHERE w.seen_at >= %s AND w.queue = %s "
    f"AND NOT pg_try_advisory_xact_lock_shared({listening_key('w.node')}) "
    f"ORDER BY w.concurrency - COALESCE(a.n, 0) DESC, random() LIMIT 1"
)


def aimed_worker() -> tuple[str, list] | None:
    """SQL (and its parameters) of one value: the worker a new turn's wake-up goes to, on
    PostgreSQL (store.start_turn reads it in the statement that stores the turn; elsewhere
    None: a Celery message or the embedded worker wakes one already). Of the workers of
    this queue seen alive and listening (its listener holds its `listening_key`: a shared
    try of it fails; a success is let go at the commit), the one with the most free slots
    (its slots less the turns it runs and the waiting turns aimed at it), ties at random;
    NULL when there is none.

    One worker is woken, not all: every worker woken for a turn spends a claim, and only one
    finds it. A worker that cannot take the turn at once (every thread busy) looks when a
    thread frees, and so does any worker's thread that ends while turns wait (store.end_turn).
    A worker frozen (its heartbeat not yet stale, its connection open) may be aimed at: the
    turn waits for another worker's next look (AAP_WORKER_POLL_SECONDS), as for any lost
    wake-up; a killed one is not, its connection gone."""
    if connection.vendor != "postgresql":
        return None
    return (
        _AIM,
        [
            connection.ops.adapt_datetimefield_value(timezone.now() - timedelta(seconds=worker_stale_seconds())),
            settings.AAP_TURN_QUEUE,
        ],
    )


def wake_after_commit(node: str | None = None) -> None:
    """Inside the transaction that stores a turn: wake a worker once it commits, unless the
    turn's insert already did (PostgreSQL's NOTIFY, delivered at the commit)."""
    if settings.REDIS_URL and connection.vendor == "postgresql":
        return
    transaction.on_commit(lambda: wake(node))


def wake(node: str | None = None) -> None:
    """After a turn is committed: tell a worker that it waits (`node`: the worker it is
    pinned to). On PostgreSQL there is nothing to do: the statement that stored the turn
    notified the workers, who hear it at the commit (store.start_turn). Never raises:
    without a wake-up, the workers find the turn at their next look."""
    if not settings.REDIS_URL:
        import_string(EMBEDDED_WAKE)()
        return
    if connection.vendor == "postgresql":
        return
    queue = worker_direct(node) if node else settings.CELERY_TASK_DEFAULT_QUEUE
    try:
        current_app.send_task(WAKE, queue=queue, ignore_result=True)
    except Exception:  # best effort: a worker looks for turns on its own
        logger.warning("no worker could be woken now: the turn waits for the next look", exc_info=True)


def worker_stale_seconds() -> float:
    """A worker whose heartbeat is older than this no longer counts for capacity."""
    return max(5.0, 2 * settings.AAP_TURN_LEASE_SECONDS)


def capacity(counted: int | None = None) -> int:
    """How many turns the workers run at once: the threads of this process in the embedded
    mode, else the concurrency of every worker alive according to its heartbeat (`counted`:
    already read with the turns, `room_for`)."""
    if not settings.REDIS_URL:
        return settings.AAP_EMBEDDED_WORKERS
    if counted is not None:
        return counted
    return worker_slots(timezone.now() - timedelta(seconds=worker_stale_seconds()))


@dataclass(frozen=True)
class Room:
    """The worker slots as a just-stored turn finds them (`RoomQuery`)."""

    in_flight: int  # turns holding, or about to hold, a worker slot
    waiting: int  # other turns waiting for one
    tenant_in_flight: int  # of in_flight, this turn's tenant's
    tenant_waiting: int  # of waiting, this turn's tenant's
    capacity: int  # slots of the workers alive
    tenant_limit: int  # the tenant's running-turns limit (0: none)

    @property
    def free(self) -> int:
        return self.capacity - self.in_flight

    @property
    def takes_slot(self) -> bool:
        """A slot is free, no other turn waits for one and the tenant is under its limit:
        the fair order could only choose this turn."""
        under_limit = not self.tenant_limit or self.tenant_in_flight < self.tenant_limit
        return not self.waiting and self.free > 0 and under_limit

    def place(self) -> dict | None:
        """`queued_place` of the turn, when every other waiting turn is its tenant's: the fair
        order keeps a tenant's turns in the order they came, so it comes after them all, and
        no statement is needed to say where it stands. Only then (`tenant_waiting == waiting`)."""
        index = self.waiting  # 0-based: the others all go first
        n = self.tenant_waiting + 1  # the tenant's n-th waiting turn (fair_order's w.n)
        may_start = not self.tenant_limit or self.tenant_in_flight + n <= self.tenant_limit
        return _place(index, may_start, max(0, self.free))


@dataclass(frozen=True)
class RoomQuery:
    """How a turn about to be stored finds the worker slots: one row of counts that
    store.start_turn reads in the statement that stores the turn (`read`), then `room`."""

    sql: str
    params: list
    tenant_limit: int

    def room(self, row) -> Room:
        in_flight, waiting, tenant_in_flight, tenant_waiting, slots = (int(value or 0) for value in row)
        return Room(in_flight, waiting, tenant_in_flight, tenant_waiting, capacity(slots), self.tenant_limit)


def room_for(turn_id: str, tenant) -> RoomQuery:
    """Inside turn_start's transaction, before the turn is stored: the counts that say whether
    it will wait for a slot, and where it stands then (`queued_place`)."""
    since = timezone.now() - timedelta(seconds=worker_stale_seconds())
    sql, params = _room_sql(turn_id, tenant.pk, since)
    limit = getattr(tenant, "max_running_turns", None)
    if limit is None:
        limit = settings.AAP_TENANT_MAX_RUNNING_TURNS
    return RoomQuery(sql, params, limit or 0)


def _place(index: int, may_start: bool, free: int) -> dict | None:
    """The place of the turn at `index` (0-based) of the fair order with `free` slots free."""
    if not may_start:
        return {"position": max(1, index + 1 - free)}  # its tenant runs all it may: it waits for one of those
    position = index + 1 - free
    return {"position": position} if position > 0 else None


def queued_place(turn_id: str, room: Room | None = None) -> dict | None:
    """`{"position": n}` while the turn waits for a worker slot (n = 1: it takes the next one
    that frees, or the next its tenant may take), None once a slot is free for it, or it
    runs or is over. Also right after the turn is stored, inside its transaction, for
    `turn_start._meta.queued` (with the `room` it found before it was stored: when all the
    turns waiting are its tenant's, `Room.place` says it without a statement)."""
    if room is not None:
        if room.tenant_waiting == room.waiting:
            return room.place()
        waiting, free = room.waiting + 1, max(0, room.free)
    else:
        in_flight, waiting = slots_in_use()
        if not waiting:
            return None
        free = max(0, capacity() - in_flight)
    order = fair_order(waiting, settings.AAP_TENANT_MAX_RUNNING_TURNS)
    index = next((i for i, (waiting_id, _) in enumerate(order) if waiting_id == turn_id), None)
    if index is None:
        return None
    return _place(index, order[index][1], free)


# --- the queue as Prometheus gauges -----------------------------------------------------------


class QueueCollector:
    """Turns waiting for a worker and running now, read from PostgreSQL when scraped."""

    def collect(self):
        queued = GaugeMetricFamily("aap_turns_queued", "Turns accepted and not yet started by a worker.")
        running = GaugeMetricFamily("aap_turns_running", "Turns a worker is running now.")
        try:
            rows = Turn.objects.exclude(status=Turn.DONE).values("status").annotate(n=Count("id")).order_by()
            counts = {row["status"]: row["n"] for row in rows}
        except DB_ERRORS:
            logger.warning("queue depth unavailable", exc_info=True)
            return
        finally:
            release_connections()  # the port server's thread holds no connection between scrapes
        queued.add_metric([], counts.get(Turn.QUEUED, 0))
        running.add_metric([], counts.get(Turn.RUNNING, 0))
        yield queued
        yield running
