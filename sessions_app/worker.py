"""A worker: what a process that runs turns does besides running them.

`Worker` is one Celery worker process's part (built and started by the worker's signals in
hosting.celery, stopped at its warm shutdown; a test can make one without Celery):

- its own heartbeat row in PostgreSQL, every round, saying how many turns it runs at once
  (the capacity sessions_app.dispatch fills); while it has a free thread, each round offers
  it to the turns waiting in PostgreSQL;
- a sweep for lost turns every SWEEP_SECONDS on a thread of its own (one worker at a time
  across the deployment), so lost turns end even when no broker message can be sent.

`run_turns` is what a worker thread does with a turn handed to it, by the Celery task or by
the embedded mode's pool (`run_embedded`): run it, then, while turns wait for a slot, the
ones the fair order gives the slot it freed. The turns' own heartbeats and leases are
sessions_app.liveness's.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from hosting import tracing
from hosting.logs import describe_failure, log_context

from . import dispatch, liveness, schedule_store, turn_store
from .services import execution, recovery

logger = logging.getLogger(__name__)

# How often a worker process sweeps for lost turns (services.recovery.sweep_unless_running).
SWEEP_SECONDS = 10.0


class Worker:
    """One worker process: `concurrency` threads for turns, under the name `node`."""

    def __init__(self, node: str, concurrency: int):
        self.node = node
        self.concurrency = concurrency
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def serving(self) -> bool:
        """It takes new turns (not shutting down)."""
        return not self._stopped.is_set()

    def start(self) -> None:
        """Say now that this worker's slots are there, then keep saying it and sweeping."""
        try:
            self.round()
        except Exception as exc:
            logger.warning("the worker's heartbeat could not be written: %s", describe_failure(exc))
        finally:
            connection.close()
        for name, target in (("aap-worker-beat", self._beat_forever), ("aap-sweep", self._sweep_forever)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """A warm shutdown: its slots no longer count (running turns still beat and finish)."""
        self._stopped.set()
        try:
            schedule_store.worker_gone(self.node)
        except Exception:
            pass  # its heartbeat goes stale instead
        finally:
            connection.close()

    def round(self) -> None:
        """Its heartbeat row; a free thread takes the waiting turns the fair order gives it."""
        if not self.serving:
            return
        schedule_store.worker_beat(self.node, self.concurrency)
        if liveness.tracked() < self.concurrency:
            dispatch.dispatch_next()

    def _beat_forever(self) -> None:
        while not self._stopped.wait(liveness.interval()):
            try:
                self.round()
            except Exception as exc:
                logger.warning("the worker's heartbeat could not be written: %s", describe_failure(exc))
            finally:
                connection.close()

    def _sweep_forever(self) -> None:
        """Its own sweep for lost turns, on a thread of its own (a long sweep never delays
        the heartbeats): it depends on PostgreSQL only, not on a broker message."""
        while not self._stopped.wait(SWEEP_SECONDS):
            try:
                recovery.sweep_unless_running()
            except Exception as exc:  # PostgreSQL restarting: the next round tries again
                logger.warning("the sweep for lost turns failed: %s", describe_failure(exc))
            finally:
                connection.close()


# This process's worker, when it is a Celery worker (None in a web process).
_current: Worker | None = None


def start_worker(node: str, concurrency: int) -> Worker:
    """The one entry point (the Celery worker's `worker_ready` signal): build and start it."""
    global _current
    _current = Worker(node, concurrency)
    _current.start()
    return _current


def stop_worker() -> None:
    if _current is not None:
        _current.stop()


def _takes_turns() -> bool:
    """This process still takes new turns: the embedded mode's pool, or a Celery worker
    that is not shutting down."""
    return not settings.REDIS_URL or (_current is not None and _current.serving)


def run_embedded(turn_id: str) -> None:
    """A thread of the embedded mode's pool (dispatch.EMBEDDED_RUNNER)."""
    close_old_connections()
    try:
        run_turns(turn_id)
    finally:
        close_old_connections()


# How long one worker thread keeps taking the next waiting turn itself (run_turns); then the
# next goes through the broker, and the thread's task ends.
CHAIN_SECONDS = 20.0


def run_turns(turn_id: str) -> None:
    """Run a turn on this thread (a Celery task's, or the embedded pool's), then, while turns
    wait for a worker slot, the one the fair order gives the slot it freed: the thread claims
    and runs it itself. At saturation that is two statements per turn (the fair order's first,
    its claim) instead of the chooser's transaction, a broker message published, consumed and
    acknowledged, and a Redis mark set and cleared. Whether others wait comes with the
    statement that ends the turn, so below saturation a turn's end costs nothing more.

    The chain stops when nothing waits, when this worker is shutting down (a warm shutdown
    takes no new turn: the waiting ones stay in PostgreSQL for the other workers), and after
    CHAIN_SECONDS (the next one then goes through the broker). A turn is claimed here by the
    same conditional UPDATE as from the broker, so it runs once; if this process dies while it
    runs, its heartbeat stops and it is recovered like any other running turn."""
    deadline = time.monotonic() + CHAIN_SECONDS
    claimed: turn_store.ClaimedTurn | None = None
    while True:
        with log_context(turn=turn_id), tracing.new_trace() if claimed else nullcontext():
            try:
                others_waiting = execution.turn_execute(turn_id, claimed=claimed)
            except BaseException:
                dispatch.dispatch_next()  # this slot is free: the next waiting turn, through the broker
                raise
        if not others_waiting:
            return
        if time.monotonic() > deadline or not _takes_turns():
            dispatch.dispatch_next()
            return
        following = take_next()
        if following is None:
            return
        turn_id, claimed = following


# The first turns of the fair order a thread reads at once: threads ending together each
# claim one of them instead of reading the order again after losing a race.
_PICKS = 4


def take_next() -> tuple[str, turn_store.ClaimedTurn] | None:
    """For a worker thread whose turn just ended: claim the waiting turn the fair order gives
    its slot. None when nothing may start (nothing waits, every waiting turn's tenant runs
    all it may, or the slot was given to a turn sent through the broker), or PostgreSQL is
    unreachable (the waiting turns stay queued for the next chance). Threads ending together
    read the same order: each claims the first of it no other thread holds
    (turn_store.claim_first). Never raises."""
    try:
        since = timezone.now() - timedelta(seconds=dispatch.worker_stale_seconds())
        order, in_flight, slots = schedule_store.fair_order_with_room(
            _PICKS, settings.AAP_TENANT_MAX_RUNNING_TURNS, since
        )
        if in_flight >= dispatch.capacity(slots):
            # The slot this thread freed went to a turn sent through the broker meanwhile
            # (the chooser saw it free): the thread goes back to the broker, which has it.
            return None
        candidates = [turn_id for turn_id, may_start in order if may_start]
        if not candidates:
            return None
        taken = turn_store.claim_first(candidates)
        if taken is not None:
            return taken
        if len(order) < _PICKS:
            return None  # every waiting turn was taken meanwhile
    except Exception as exc:
        logger.warning("waiting turns could not be dispatched now: %s", describe_failure(exc))
        return None
    dispatch.dispatch_next(wait=False)  # contended: the chooser settles it, unless one is at work already
    return None
