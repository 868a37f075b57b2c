"""A worker: the threads that take turns from PostgreSQL and run them, and what keeps it known.

`Worker` owns one worker process's part (a Celery worker's, built and started by its
`worker_ready` signal in hosting.celery through `start_worker` and drained at its shutdown;
or the embedded mode's, inside the web process; a test can make several without either):

- `concurrency` slot threads. A free one claims the next waiting turn in one statement
  (`take`, the one hand-off of a turn to a thread: queue.claim_next), runs it, and
  claims again while turns wait; with nothing to claim it waits for a wake-up (`wake`), and
  one free thread looks again every AAP_WORKER_POLL_SECONDS (the next free one at once when
  that finds a turn), so a lost wake-up costs latency, never a turn;
- on PostgreSQL, a listener thread: the statement that stores a turn notifies
  store.WAKE_CHANNEL, delivered when its transaction commits, and each notification for
  this worker's queue (and not pinned to another worker) is a wake-up. A wake-up that finds
  no free thread is not kept as a debt: a thread that frees looks again if anything was
  heard since its last look began (`_heard`), so no turn waits for the timer because it was
  committed while every thread was busy. Elsewhere the wake-up is a Celery message (SQLite
  with a broker) or the embedded mode's commit hook;
- its heartbeat row in PostgreSQL every round, saying how many turns it runs at once (what
  `queued` positions are counted against);
- a sweep for lost turns every SWEEP_SECONDS on a thread of its own (one worker at a time
  across the deployment); it reads PostgreSQL only;
- what it keeps about the turns it runs, handed to each (services.execution.turn_execute):
  their heartbeats and leases (`liveness`, two threads of its own), their tasks on the
  runtime loop, which its cancel listener reaches (`running`), and the histories it read
  (`histories`).

Nothing about turns is kept outside a Worker: two in one process share no turn. The module
keeps only which Worker is this process's (`start_worker`, `wake_embedded`), for the Celery
signals and the wake-ups that reach the process.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from infra import tracing
from infra.logs import log_context

from . import execution, queue, recovery, store
from .host import RunningTurns
from .kept_history import KeptHistories
from .liveness import Liveness, interval

logger = logging.getLogger(__name__)

# How often a worker process sweeps for lost turns (recovery.sweep_unless_running).
SWEEP_SECONDS = 10.0
# Why a free slot thread looks for waiting turns: a wake-up, or its timer.
WOKEN, TIMER = "woken", "timer"
# The wake-up listener: how often it checks that the worker still serves, and how soon it
# connects again after losing PostgreSQL.
LISTEN_CHECK_SECONDS = 1.0
LISTEN_RETRY_SECONDS = 1.0


class Worker:
    """One process's turn threads: `concurrency` of them, under the name `node`. `beats`: it
    writes its heartbeat row and sweeps (a Celery worker); the embedded mode's does not, and
    looks for turns only when woken (its own requests wake it)."""

    def __init__(self, node: str, concurrency: int, *, beats: bool = True):
        self.node = node
        self.concurrency = concurrency
        self.beats = beats
        self._stopped = threading.Event()
        self._bell = threading.Condition()
        self._rung = 0  # wake-ups rung for waiting threads that have not taken them yet
        self._idle = 0  # slot threads waiting for a wake-up
        self._heard = 0  # wake-ups heard so far (a thread compares it with its last look's)
        self._looking = False  # a free thread looks for turns every AAP_WORKER_POLL_SECONDS
        self._look_now = False  # the next free thread looks on the timer at once (_look_again)
        self._threads: list[threading.Thread] = []
        self._slots: list[threading.Thread] = []
        self.liveness = Liveness()
        self.running = RunningTurns()
        self.histories = KeptHistories()

    @property
    def serving(self) -> bool:
        """It takes new turns (not shutting down)."""
        return not self._stopped.is_set()

    def start(self) -> None:
        """Say now that this worker's slots are there, then keep saying it and sweeping; its
        slot threads look for waiting turns at once (some may have waited for a worker)."""
        self.running.listen()
        self.liveness.start()
        if self.beats:
            if connection.vendor == "postgresql":
                listener = threading.Thread(target=self._listen_forever, name="aap-wake-listener", daemon=True)
                listener.start()
                self._threads.append(listener)
            try:
                self.round()
            except Exception:  # the thread's boundary: the next round tries again
                logger.warning("the worker's heartbeat could not be written", exc_info=True)
            finally:
                connection.close()
            for name, target in (("aap-worker-beat", self._beat_forever), ("aap-sweep", self._sweep_forever)):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        for number in range(self.concurrency):
            thread = threading.Thread(target=self._serve, name=f"aap-turn-{number}", daemon=True)
            thread.start()
            self._slots.append(thread)

    def wake(self) -> None:
        """A turn waits: a free thread looks for it now (or the next thread to free up, if it
        looked before this)."""
        with self._bell:
            self._heard += 1
            if self._rung < self._idle:
                self._rung += 1
                self._bell.notify()
        # Let the woken thread take the interpreter now: otherwise it may wait for this one's
        # switch interval (5 ms) before it can claim the turn.
        time.sleep(0)

    def stop(self) -> None:
        """A warm shutdown: no new turn is taken (running ones finish, `drain`); its slots no
        longer count."""
        self._stopped.set()
        with self._bell:
            self._bell.notify_all()
        if not self.beats:
            return
        try:
            queue.worker_gone(self.node)
        except Exception:  # its heartbeat goes stale instead
            logger.warning("the worker's departure could not be recorded", exc_info=True)
        finally:
            connection.close()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the running turns to end (after `stop`), each slot for up to `timeout`;
        then, if they all ended, its turns' heartbeats and cancel listener stop. Whether
        they all ended."""
        for thread in self._slots:
            thread.join(timeout)
        if any(thread.is_alive() for thread in self._slots):
            return False  # the turns still running keep their heartbeats
        self.liveness.stop()
        self.running.close()
        return True

    def round(self) -> None:
        """Its heartbeat row."""
        if self.serving:
            queue.worker_beat(self.node, self.concurrency)

    def take(self) -> tuple[str, store.ClaimedTurn] | None:
        """Claim the waiting turn the fair order gives a free thread of this worker; None when
        none may start now, or PostgreSQL is unreachable (the turns wait for the next look).
        Never raises."""
        pinned_before = timezone.now() - timedelta(seconds=settings.AAP_TURN_PIN_SECONDS)
        try:
            return queue.claim_next(self.node, settings.AAP_TENANT_MAX_RUNNING_TURNS, pinned_before)
        except Exception:  # the slot's boundary: it claims again on its next look
            logger.warning("waiting turns could not be claimed now", exc_info=True)
            connection.close()  # a broken connection goes back to the pool, which discards it
            return None

    def _serve(self) -> None:
        """A slot thread: claim, run, and claim again while turns wait; else wait to be woken."""
        look: str | None = WOKEN  # at once: turns may have waited for a worker
        heard = self._heard
        while self.serving:
            taken = None
            if look:
                # Whatever is heard from here on, this look (the claim, or the end of the turn
                # it claims) may miss; what was heard before, it sees.
                heard = self._heard
                taken = self.take()
            if taken is None:
                connection.close()  # idle: no connection held while nothing runs
                look = self._wait(heard)
                continue
            if look == TIMER:
                self._look_again()
            turn_id, claimed = taken
            look = WOKEN if self._run(turn_id, claimed) else None

    def _wait(self, heard: int) -> str | None:
        """Wait for a wake-up (WOKEN), or, for the one free thread that looks on a timer, the
        next look (TIMER); None once the worker stops. `heard`: the wake-ups heard when this
        thread's last look began; if one came since, it looks at once. The thread that looks
        on the timer hands that on to another free thread as it stops waiting (it may take a
        turn and run it): a turn whose wake-up was lost is found while any thread is free."""
        with self._bell:
            if self._heard != heard:
                return WOKEN  # a turn may have been stored after that look began
            self._idle += 1
            try:
                while self.serving:
                    poll = settings.AAP_WORKER_POLL_SECONDS if self.beats else None
                    if self._rung:
                        self._rung -= 1
                        return WOKEN
                    if self._look_now:
                        self._look_now = False
                        return TIMER
                    if poll is None or self._looking:
                        self._bell.wait()
                        continue
                    self._looking = True
                    try:
                        timed_out = not self._bell.wait(poll)
                    finally:
                        self._looking = False
                        self._bell.notify()  # another free thread, if one waits, takes the timer on
                    if timed_out:
                        return TIMER
                return None
            finally:
                self._idle -= 1

    def _look_again(self) -> None:
        """A look on the timer found a turn: its wake-up was lost, and others' may have been
        too (wake-ups are lost in bursts: claims that found their turn taken). The next free
        thread looks at once, not a poll later, and so on while looks find turns."""
        with self._bell:
            self._look_now = True
            self._bell.notify()

    def _run(self, turn_id: str, claimed: store.ClaimedTurn) -> bool:
        """Run a claimed turn; whether turns were waiting as it ended (then it looks again)."""
        with log_context(turn=turn_id), tracing.continued(claimed.trace_parent):
            try:
                return execution.turn_execute(
                    turn_id, claimed, liveness=self.liveness, running=self.running, histories=self.histories
                )
            except Exception:
                # Never raised further: the thread serves on, and the turn, still `running`
                # with no heartbeat, ends as lost.
                logger.error("turn %s failed on its worker thread", turn_id, exc_info=True)
                return True
            finally:
                close_old_connections()

    def _beat_forever(self) -> None:
        while not self._stopped.wait(interval()):
            try:
                self.round()
            except Exception:  # the thread's boundary: the next round tries again
                logger.warning("the worker's heartbeat could not be written", exc_info=True)
            finally:
                connection.close()

    def _listen_forever(self) -> None:
        """Wake-ups from PostgreSQL: LISTEN on store.WAKE_CHANNEL over a connection of its
        own (outside the pool; a transaction-pooling proxy cannot carry it). A lost
        connection is replaced every LISTEN_RETRY_SECONDS; meanwhile the timed look finds the
        turns, and once listening again one look catches up."""
        import psycopg
        from psycopg import sql

        failing = False
        params = {k: v for k, v in connection.get_connection_params().items() if k != "cursor_factory"}
        while self.serving:
            try:
                with psycopg.connect(**params, autocommit=True) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(store.WAKE_CHANNEL)))
                    if failing:
                        logger.warning("wake-ups from PostgreSQL are heard again")
                        failing = False
                    # Turns stored while nothing listened, as many as there are: looked
                    # for as the timer does, each find making the next free thread look.
                    self._look_again()
                    while self.serving:
                        for note in conn.notifies(timeout=LISTEN_CHECK_SECONDS):
                            if self._for_me(note.payload):
                                self.wake()
            except Exception:  # the thread's boundary: the timed look covers until it listens again
                if not failing:
                    logger.warning(
                        "wake-ups from PostgreSQL are not heard now: turns wait for the timed look", exc_info=True
                    )
                failing = True
                self._stopped.wait(LISTEN_RETRY_SECONDS)

    def _for_me(self, payload: str) -> bool:
        """A notification about a turn of this worker's queue, not pinned to another worker."""
        queue, _, node = payload.partition("\t")
        return queue == settings.AAP_TURN_QUEUE and node in ("", self.node)

    def _sweep_forever(self) -> None:
        """Its own sweep for lost turns, on a thread of its own (a long sweep never delays
        the heartbeats): it depends on PostgreSQL only, not on a broker message."""
        while not self._stopped.wait(SWEEP_SECONDS):
            try:
                recovery.sweep_unless_running()
            except Exception:  # the thread's boundary; PostgreSQL restarting: the next round tries again
                logger.warning("the sweep for lost turns failed", exc_info=True)
            finally:
                connection.close()


# This process's worker: a Celery worker's, or the embedded mode's (None until then).
_current: Worker | None = None
_embedded_lock = threading.Lock()


def start_worker(node: str, concurrency: int) -> Worker:
    """The one entry point of a Celery worker (its `worker_ready` signal): build and start it."""
    global _current
    _current = Worker(node, concurrency)
    _current.start()
    return _current


def stop_worker() -> None:
    """A warm shutdown's start: take no new turn."""
    if _current is not None:
        _current.stop()


def drain_worker() -> None:
    """A warm shutdown's end: wait for the running turns to end."""
    if _current is not None:
        _current.drain()


def wake() -> None:
    """A wake-up reached this worker process (the Celery task sessions_app.tasks.wake)."""
    if _current is not None:
        _current.wake()


def wake_embedded() -> None:
    """The embedded mode (dispatch.EMBEDDED_WAKE): this web process's own worker, started
    with the first turn (it then takes the turns that waited for it, too)."""
    global _current
    if _current is None:
        with _embedded_lock:
            if _current is None:
                worker = Worker("embedded", settings.AAP_EMBEDDED_WORKERS, beats=False)
                worker.start()
                _current = worker
    _current.wake()
