"""Waking workers for the turns that wait in PostgreSQL, and where a waiting turn stands.

PostgreSQL is the one queue. A turn is committed `queued` and waits there until a worker
thread with a free slot claims it (sessions_app.engine.worker, schedule_store.claim_next: fair
between tenants by weight, within each tenant's running limit, in one statement). When
the turn commits, a worker's bell rings: on PostgreSQL, the notification that the turn's
insert sent (heard by every worker's listener, sessions_app.engine.worker); on SQLite, a Celery
message with no turn in it (to the worker that holds the prompt a turn answers, when it is
pinned), or, in the embedded mode, this process's own worker. A lost wake-up costs latency, never a turn: each worker looks for
waiting turns every AAP_WORKER_POLL_SECONDS while a thread of its is free, and a thread
whose turn ends claims the next itself. Celery holds no state that must be reconciled with
PostgreSQL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from celery import current_app
from celery.utils.nodenames import worker_direct
from django.conf import settings
from django.db import connection
from django.utils import timezone
from django.utils.module_loading import import_string

from . import schedule_store

logger = logging.getLogger(__name__)

# The Celery task that wakes a worker (sessions_app.tasks), sent by name: tasks import the
# worker, which imports services, which import this module.
WAKE = "sessions_app.tasks.wake"
# This process's own worker, in the embedded mode (sessions_app.engine.worker), by name likewise.
EMBEDDED_WAKE = "sessions_app.engine.worker.wake_embedded"


def wake(node: str | None = None) -> None:
    """After a turn is committed: tell a worker that it waits (`node`: the worker it is
    pinned to). On PostgreSQL there is nothing to do: the statement that stored the turn
    notified the workers, who hear it at the commit (turn_store.insert_turn). Never raises:
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
    already read with the turns, `schedule_store.room_for`)."""
    if not settings.REDIS_URL:
        return settings.AAP_EMBEDDED_WORKERS
    if counted is not None:
        return counted
    return schedule_store.worker_slots(timezone.now() - timedelta(seconds=worker_stale_seconds()))


@dataclass(frozen=True)
class Room:
    """The worker slots as a just-stored turn finds them (`room_for`)."""

    in_flight: int  # turns holding, or about to hold, a worker slot
    waiting: int  # other turns waiting for one
    tenant_in_flight: int  # of in_flight, this turn's tenant's
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


def room_for(turn_id: str, tenant) -> Room:
    """Inside turn_start's transaction, before the turn is stored, in one statement: whether
    it will wait for a slot, and where it stands then (`queued_place`)."""
    since = timezone.now() - timedelta(seconds=worker_stale_seconds())
    in_flight, waiting, tenant_in_flight, slots = schedule_store.room_for(turn_id, tenant.pk, since)
    limit = getattr(tenant, "max_running_turns", None)
    if limit is None:
        limit = settings.AAP_TENANT_MAX_RUNNING_TURNS
    return Room(in_flight, waiting, tenant_in_flight, capacity(slots), limit or 0)


def queued_place(turn_id: str, room: Room | None = None) -> dict | None:
    """`{"position": n}` while the turn waits for a worker slot (n = 1: it takes the next one
    that frees, or the next its tenant may take), None once a slot is free for it, or it
    runs or is over. Also right after the turn is stored, inside its transaction, for
    `turn_start._meta.queued` (with the `room` it found before it was stored)."""
    if room is not None:
        in_flight, waiting, free = room.in_flight, room.waiting + 1, max(0, room.free)
    else:
        in_flight, waiting = schedule_store.slots_in_use()
        if not waiting:
            return None
        free = max(0, capacity() - in_flight)
    order = schedule_store.fair_order(waiting, settings.AAP_TENANT_MAX_RUNNING_TURNS)
    index = next((i for i, (waiting_id, _) in enumerate(order) if waiting_id == turn_id), None)
    if index is None:
        return None
    if not order[index][1]:
        return {"position": max(1, index + 1 - free)}  # its tenant runs all it may: it waits for one of those
    position = index + 1 - free
    return {"position": position} if position > 0 else None
