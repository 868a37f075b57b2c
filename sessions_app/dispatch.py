"""Handing turns to workers, fairly between tenants, with the turn's row in PostgreSQL as the
outbox.

A turn is committed `queued` first. The broker only ever holds about as many turns as the
workers have free slots (their heartbeats in PostgreSQL say how many turns each runs at
once): the others wait in PostgreSQL, and whenever a slot frees (a turn ends, a worker
starts or beats with a free thread, a turn is accepted with slots free) `dispatch_next`
picks the next ones there (when a turn ends, its worker thread runs the first of them
itself: sessions_app.worker.run_turns), the tenant with the fewest turns in flight per unit of its
weight first (schedule_store.fair_order), and never more at once than the tenant's running-turns
limit. So a tenant's single short turn waits for one slot to free, not behind another
tenant's backlog, and a tenant whose limit is below the workers' slots leaves the rest free.

A turn handed to the broker is marked `dispatched_at` in PostgreSQL, then put on the
broker. Whatever happens between, or after (a crash of the web process, Redis down or
restarted, a worker dying between taking the message and claiming the turn), the row stays
`queued`: a dispatched turn that is neither claimed nor still on the broker's queue after
AAP_TURN_DISPATCH_GRACE_SECONDS is dispatched again, by the periodic sweep, by a client
following it, by the next request on its session (`on_its_way`). A second delivery is
harmless: a worker claims a turn once (turn_store.claim_turn). Waiting is never failure.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from functools import cache

from celery.utils.nodenames import worker_direct
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from hosting import broker

from . import events, schedule_store

logger = logging.getLogger(__name__)

# A turn sent to one worker's own queue (an answer to a prompt that worker holds) is marked
# in Redis for this long: it falls back to any worker sooner when no worker took it (the
# holder's routing key expires within 30 s when it dies). The shared queue needs no mark: it
# is read (`on_its_way`). In the embedded mode a turn handed to the pool is marked too.
PINNED_MARK_SECONDS = 30.0
EMBEDDED_MARK_SECONDS = 600.0

# The Celery task that runs a turn (sessions_app.tasks), sent by name: tasks import services,
# services import this module.
RUN_TURN = "sessions_app.tasks.run_turn"


@cache
def _embedded_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=settings.AAP_EMBEDDED_WORKERS, thread_name_prefix="aap-turn")


# What a thread of the embedded pool runs, by name like the Celery task (sessions_app.worker
# builds on this module, not the other way round).
EMBEDDED_RUNNER = "sessions_app.worker.run_embedded"


def enqueue_turn(turn_id: str, *, node: str | None = None) -> None:
    """Hand a turn to a Celery worker (REDIS_URL set) or to a thread of this process;
    `node` names the worker that must run it (its direct queue, `worker_direct`)."""
    if settings.REDIS_URL:
        # The task's id is the turn's: `on_its_way` finds the turn on the queue by it.
        queue = worker_direct(node) if node else settings.CELERY_TASK_DEFAULT_QUEUE
        broker.send_task(RUN_TURN, turn_id, (turn_id,), queue)
    else:
        _embedded_pool().submit(import_string(EMBEDDED_RUNNER), turn_id)


# The advisory lock that serializes choosing turns for free slots (one chooser at a time).
_DISPATCH_LOCK = 0x4141_5044_4953_5000


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


def _send(turn_id: str, node: str | None = None) -> bool:
    """Put a turn on the broker (a pinned one marked in Redis). False (logged) when the
    broker is unreachable: the turn stays queued and is dispatched again later."""
    try:
        enqueue_turn(turn_id, node=node)
        if node or not settings.REDIS_URL:
            events.backend().mark_dispatched_sync(turn_id, PINNED_MARK_SECONDS if node else EMBEDDED_MARK_SECONDS)
    except Exception as exc:
        logger.warning("turn %s stays queued: the broker is unreachable (%s)", turn_id, type(exc).__name__)
        return False
    return True


def on_its_way(turn_ids: list[str]) -> set[str]:
    """Of these dispatched, unclaimed turns, those still on their way to a worker: on the
    broker's shared queue, or marked (a pinned turn; the embedded mode's). The others were
    lost: in a Redis restart, by a web process that died before sending them, by a worker
    that died after taking them. Raises when Redis is unreachable (nothing can be sent then)."""
    backend = events.backend()
    found = {turn_id for turn_id in turn_ids if backend.dispatched_sync(turn_id)}
    if settings.REDIS_URL and len(found) < len(turn_ids):
        found |= set(turn_ids) & backend.queued_task_ids(settings.CELERY_TASK_DEFAULT_QUEUE)
    return found


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
    """Inside turn_start's transaction, before the turn is stored, in one statement. When
    `takes_slot`, the turn is stored already dispatched (committed with it) and
    `dispatch` sends it on commit: one statement instead of the chooser's
    transaction (lock, counts, order, mark) for every turn below saturation. Without the
    chooser's lock two turns accepted at the same instant may both take the last free slot:
    the later waits on the broker for the next thread, and the fair order holds from the next
    slot on."""
    since = timezone.now() - timedelta(seconds=worker_stale_seconds())
    in_flight, waiting, tenant_in_flight, slots = schedule_store.room_for(turn_id, tenant.pk, since)
    limit = getattr(tenant, "max_running_turns", None)
    if limit is None:
        limit = settings.AAP_TENANT_MAX_RUNNING_TURNS
    return Room(in_flight, waiting, tenant_in_flight, capacity(slots), limit or 0)


def dispatch(turn_id: str, *, node: str | None = None, room: Room | None = None) -> bool:
    """Hand a just-accepted turn over: one pinned to a worker (`node`) goes to it at once,
    as does one stored with a free slot (`room.takes_slot`); any other takes its place among
    the turns waiting for a free slot. When every slot was taken as it was stored, the
    next turn to end chooses among the waiting ones (this one included, once committed):
    the chooser is not run for nothing on each turn accepted at saturation."""
    if room is not None and room.takes_slot:
        return _send(turn_id)
    if node is None:
        if room is not None and room.free <= 0:
            # Every slot taken: the next turn to end takes this one or one before it (its
            # end says whether turns wait, turn_store.end_turn, and its thread claims the
            # first of them). A turn ending as this one was stored (neither saw the other)
            # leaves its slot to the worker's next heartbeat round (liveness), which fills it.
            return False
        # A slot looks free while others wait: mostly a worker thread between two turns,
        # about to claim the next itself. The chooser settles it unless another one is at
        # work already; then this request does not queue behind it (a request only tries the
        # chooser's lock: it never waits for another's choice). Should that one have read the
        # turns before this one was committed, the next turn accepted, or a worker's heartbeat
        # round, chooses.
        return turn_id in dispatch_next(wait=False)
    try:
        schedule_store.mark_dispatched([turn_id])
    except Exception as exc:
        logger.warning("turn %s stays queued: PostgreSQL is unreachable (%s)", turn_id, type(exc).__name__)
        return False
    return _send(turn_id, node)


def dispatch_next(*, wait: bool = True) -> list[str]:
    """Fill the free worker slots with waiting turns chosen fairly; returns their ids. Never
    raises: a turn not dispatched now stays queued and waits for the next chance. `wait`:
    queue behind a chooser at work in another thread or process; else leave it to that one."""
    try:
        chosen = choose_next(wait=wait)
    except Exception as exc:
        logger.warning("waiting turns could not be dispatched now (%s)", type(exc).__name__)
        return []
    return [turn_id for turn_id in chosen if _send(turn_id)]


def choose_next(*, wait: bool = True) -> list[str]:
    """Mark the waiting turns that take the free worker slots as dispatched; their ids.
    Nothing when another chooser holds the lock and `wait` is false."""
    if not schedule_store.any_waiting():
        return []
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                if wait:
                    cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_DISPATCH_LOCK])
                else:
                    cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_DISPATCH_LOCK])
                    if not cursor.fetchone()[0]:
                        return []
        since = timezone.now() - timedelta(seconds=worker_stale_seconds())
        in_flight, waiting, _, slots = schedule_store.room_for("", 0, since)
        free = capacity(slots) - in_flight
        if free <= 0 or not waiting:
            return []
        order = schedule_store.fair_order(free, settings.AAP_TENANT_MAX_RUNNING_TURNS)
        return schedule_store.mark_dispatched([turn_id for turn_id, may_start in order if may_start])


def queued_place(turn_id: str, room: Room | None = None) -> dict | None:
    """`{"position": n}` while the turn waits for a worker slot (n = 1: it takes the next one
    that frees, or the next its tenant may take), None once it is dispatched, running or
    over. Also right after the turn is stored, inside its transaction, for
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


def _grace_passed(since) -> bool:
    return since is None or (timezone.now() - since).total_seconds() >= settings.AAP_TURN_DISPATCH_GRACE_SECONDS


def redispatch_if_lost(turn_id: str, created_at) -> bool:
    """A queued turn someone looks at: dispatch it again when its dispatch left no trace, or
    give it a free slot if one is there. True if it was sent."""
    if not _grace_passed(created_at):
        return False  # its web process may still be handing it over
    try:
        state = schedule_store.waiting_since(turn_id)
    except Exception:
        return False
    if state is None or state[0] != "queued":
        return False
    if state[1] is None:
        return turn_id in dispatch_next()
    if not _grace_passed(state[1]):
        return False
    try:
        if on_its_way([turn_id]):
            return False
    except Exception:
        return False  # Redis is down: nothing can be dispatched now anyway
    logger.warning("turn %s was dispatched but never reached a worker; dispatching it again", turn_id)
    return _send(turn_id)


def dispatch_pending() -> int:
    """Dispatch again every dispatched turn that never reached a worker (`on_its_way`),
    then fill the free slots (run periodically)."""
    cutoff = timezone.now() - timedelta(seconds=settings.AAP_TURN_DISPATCH_GRACE_SECONDS)
    dispatched = schedule_store.dispatched_turns(cutoff)
    sent = 0
    if dispatched:
        arriving = on_its_way(dispatched)
        for turn_id in dispatched:
            if turn_id not in arriving:
                logger.warning("turn %s was dispatched but never reached a worker; dispatching it again", turn_id)
                sent += _send(turn_id)
    return sent + len(dispatch_next())
