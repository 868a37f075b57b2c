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
  this worker's queue aimed at it (or at no worker: queue.aimed_worker) is a wake-up. A
  wake-up rings one free thread; one that finds none is not kept as a debt: a thread that
  frees looks again if a wake-up found no free thread since its last look began
  (`_missed`), so no turn waits for the timer because it was committed while every thread
  was busy, and no thread looks for a turn another thread was rung for. Elsewhere the
  wake-up is a Celery message (SQLite with a broker) or the embedded mode's commit hook;
- its heartbeat row in PostgreSQL every round, saying how many turns it runs at once (what
  `queued` positions are counted against);
- a sweep for lost turns every SWEEP_SECONDS on a thread of its own (one worker at a time
  across the deployment); it reads PostgreSQL only;
- what it keeps about the turns it runs, handed to each (`turn_execute`):
  their heartbeats and leases (`liveness`, two threads of its own), their tasks on the
  runtime loop, which its cancel listener reaches (`running`), and the histories it read
  (`histories`).

Nothing about turns is kept outside a Worker: two in one process share no turn. The module
keeps only which Worker is this process's (`start_worker`, `wake_embedded`), for the Celery
signals and the wake-ups that reach the process.

A claimed turn runs on its slot thread (`turn_execute`): planned from PostgreSQL, run by the
host (sessions_app.engine.host), and finished: its messages, pending calls and usage stored
atomically, then `turn_stop` published."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from agents.models import Agent
from agents.runtimes.base import PermissionAnswer, ServerToolBinding, ToolCall
from agents.selectors import AgentDefinition, agent_definition, option_rows, server_tool_specs
from infra import crypto, metrics, tracing
from infra.logs import bind_log_context, log_context

from ..models import Turn
from ..protocol import dumps, unstorable
from . import events, host, queue, recovery, store
from .host import RunningTurns
from .store import LOST_ERROR, apply_compaction, publish_stop, publish_stop_if_missing

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
        self._missed = 0  # wake-ups that found no free thread (each thread compares its last look's)
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
            if self._rung < self._idle:
                self._rung += 1
                self._bell.notify()
            else:
                self._missed += 1
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
        missed = self._missed
        while self.serving:
            taken = None
            if look:
                # A turn stored from here on, this look (the claim, or the end of the turn it
                # claims) may miss; one stored before, it sees.
                missed = self._missed
                taken = self.take()
            if taken is None:
                connection.close()  # idle: no connection held while nothing runs
                look = self._wait(missed)
                continue
            if look == TIMER:
                self._look_again()
            turn_id, claimed = taken
            look = WOKEN if self._run(turn_id, claimed) else None

    def _wait(self, missed: int) -> str | None:
        """Wait for a wake-up (WOKEN), or, for the one free thread that looks on a timer, the
        next look (TIMER); None once the worker stops. `missed`: the wake-ups that had found
        no free thread when this thread's last look began; if one did since, it looks at once.
        The thread that looks on the timer hands that on to another free thread as it stops
        waiting (it may take a turn and run it): a turn whose wake-up was lost is found while
        any thread is free."""
        with self._bell:
            if self._missed != missed:
                return WOKEN  # a turn stored after that look began found no thread to look for it
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
                return turn_execute(
                    turn_id, claimed, liveness=self.liveness, running=self.running, histories=self.histories
                )
            except Exception:
                # Never raised further: the thread serves on, and the turn, still `running`
                # with no heartbeat, ends as lost.
                logger.error("turn %s failed on its worker thread", turn_id, exc_info=True)
                connection.close()  # whatever state it was left in: the pool checks it on return
                return True

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
        params = direct_connection_params()
        while self.serving:
            try:
                with psycopg.connect(**params, autocommit=True) as conn:
                    # Wake-ups are aimed at this worker while this connection holds its key
                    # (queue.aimed_worker); one aimed before it listens is caught up below. A
                    # web's statement may hold the key shared for a moment; another live
                    # worker of the same name would hold it for good.
                    conn.execute("SET lock_timeout = '10s'")
                    conn.execute(f"SELECT pg_advisory_lock({queue.listening_key('%s')})", [self.node])
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
        """A notification about a turn of this worker's queue, aimed at it or at no worker."""
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


def direct_connection_params() -> dict:
    """psycopg.connect()'s arguments for a connection of one's own (outside Django and its
    pool) to the database of Django's `connection`."""
    return {k: v for k, v in connection.get_connection_params().items() if k != "cursor_factory"}


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
    """The embedded mode (queue.EMBEDDED_WAKE): this web process's own worker, started
    with the first turn (it then takes the turns that waited for it, too)."""
    global _current
    if _current is None:
        with _embedded_lock:
            if _current is None:
                worker = Worker("embedded", settings.AAP_EMBEDDED_WORKERS, beats=False)
                worker.start()
                _current = worker
    _current.wake()


# --- heartbeats of running turns --------------------------------------------------------------
# Heartbeats of running turns, written to PostgreSQL and Redis by the worker running them.
#
# A worker's `Liveness` (its `Worker` owns one) keeps the turns it runs: one
# thread updates every tracked turn's `heartbeat_at` in one statement every third of
# AAP_TURN_LEASE_SECONDS, and stores what the agent produced so far in the modes that
# publish only whole blocks (`message`, `none`), so a crash loses none of it. Another keeps
# each tracked turn's Redis lease, from its claim until its end is stored, on the same clock
# but on its own: a statement that hangs while PostgreSQL stalls never delays it. A turn is
# declared lost only when its heartbeat is stale and its lease has lapsed too, so a worker
# that is alive but cannot reach PostgreSQL (it retries its finish meanwhile) is not
# declared lost for that alone.


def interval() -> float:
    return max(0.2, settings.AAP_TURN_LEASE_SECONDS / 3)


class Liveness:
    """The turns one worker runs now, and the two threads that keep them alive (`start`,
    `stop`). `track` and `untrack` are called from the worker's slot threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Callable[[], str | None] | None] = {}
        self._last_partial: dict[str, str] = {}
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, target in (("aap-heartbeat", self._beat_forever), ("aap-lease", self._keep_leases_forever)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """No more rounds (once no turn of this worker runs: a tracked turn would end as lost)."""
        self._stopped.set()

    def track(self, turn_id: str, partial: Callable[[], str | None] | None = None) -> None:
        """Keep the turn's heartbeat while it runs; `partial()` gives its output so far (JSON)."""
        with self._lock:
            self._running[turn_id] = partial

    def untrack(self, turn_id: str) -> None:
        with self._lock:
            self._running.pop(turn_id, None)
            self._last_partial.pop(turn_id, None)

    def tracked(self) -> list[str]:
        """The turns this worker runs now."""
        with self._lock:
            return list(self._running)

    def beat(self) -> None:
        """One round: every tracked turn's heartbeat, and the partial outputs that changed."""
        with self._lock:
            running = dict(self._running)
        if not running:
            return
        partials = {}
        for turn_id, source in running.items():
            if source is None:
                continue
            try:
                text = source()
            except Exception:  # a runtime's callback: its partial text is optional
                logger.debug("the partial output of turn %s is unreadable", turn_id, exc_info=True)
                continue
            if text and text != self._last_partial.get(turn_id):
                partials[turn_id] = text
        try:
            store.heartbeat(list(running), partials)
            with self._lock:
                # Only turns still tracked: one untracked meanwhile keeps no entry behind.
                self._last_partial.update({t: text for t, text in partials.items() if t in self._running})
        finally:
            connection.close()  # back to the pool; a broken one is discarded

    def keep_leases(self) -> None:
        """One round: the Redis lease of every tracked turn, in one round trip."""
        running = self.tracked()
        if running:
            events.backend().refresh_leases_sync(running)

    def _beat_forever(self) -> None:
        while not self._stopped.wait(interval()):
            try:
                self.beat()
            except Exception:  # the thread's boundary; PostgreSQL restarting: the next round tries again
                logger.warning("turn heartbeats could not be written", exc_info=True)

    def _keep_leases_forever(self) -> None:
        while not self._stopped.wait(interval()):
            try:
                self.keep_leases()
            except Exception:  # the thread's boundary; Redis restarting: the PostgreSQL heartbeat stands alone
                logger.warning("turn leases could not be refreshed", exc_info=True)


# --- kept histories ---------------------------------------------------------------------------
# A worker's copy of each recent session's compacted history, parsed, so a turn reads and
# parses only the rows its session gained since this worker last ran one of its turns (each
# `Worker` keeps its own `KeptHistories`).
#
# A kept copy is used only when the rows it was built from are still there, checked with two
# index probes whatever the history's length: the session's first compacted row and its last
# one at or before the copy's end must be rows of the copy (the same position and row id).
# History only grows at its end; compaction deletes rows at its start and inserts any summary
# there, always with new, higher ids; a lost turn whose worker finished after all has its
# recovered output replaced at the end, with new ids too. So a first row that is one of the
# copy's means nothing was inserted before it (a window that dropped the oldest rows leaves
# the copy's rows from there on), and a last row that is the copy's last means nothing at its
# end was replaced. Otherwise the whole history is read again.
# The copy is only ever read: each turn gets new lists.


SESSIONS_KEPT = 64  # per worker; a session's copy is at most its compacted history
BEFORE_EVERYTHING = -(2**62)


@dataclass(frozen=True)
class _Kept:
    seqs: tuple[int, ...]  # in order
    messages: tuple[dict, ...]
    turns: tuple[str | None, ...]  # the turn id each row was stored with
    ids: tuple[int, ...]  # row ids

    def start_of(self, first: tuple[int, int] | None, last: tuple[int, int] | None) -> int | None:
        """Where the rows still there begin in this copy, or None when the copy is stale."""
        if first is None or last is None or last != (self.seqs[-1], self.ids[-1]):
            return None
        index = bisect.bisect_left(self.seqs, first[0])
        if index == len(self.seqs) or (self.seqs[index], self.ids[index]) != first:
            return None
        return index


class KeptHistories:
    def __init__(self, size: int = SESSIONS_KEPT):
        self.size = size
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()  # worker threads plan turns at the same time
        self.parsed_last = 0  # rows the last load parsed (observability, tests)

    def load(self, session_pk: int, turn_id: str) -> tuple[list[int], list[dict], list[dict]]:
        """The session's compacted history (its positions and its messages, in order) and the
        messages of `turn_id` in it. New lists each time: the caller may change them."""
        with self._lock:
            kept = self._kept.pop(session_pk, None)
        start = None
        if kept is not None:
            first, last, new = store.compacted_history_after(session_pk, kept.seqs[-1])
            start = kept.start_of(first, last)
        if kept is None or start is None:
            kept, start = None, 0
            _, _, new = store.compacted_history_after(session_pk, BEFORE_EVERYTHING)
        seqs = list(kept.seqs[start:]) if kept else []
        messages = list(kept.messages[start:]) if kept else []
        turns = list(kept.turns[start:]) if kept else []
        ids = list(kept.ids[start:]) if kept else []
        for seq, data, row_turn, row_id in new:
            seqs.append(seq)
            messages.append(json.loads(data))
            turns.append(row_turn)
            ids.append(row_id)
        self.parsed_last = len(new)
        if seqs:
            with self._lock:
                self._kept[session_pk] = _Kept(tuple(seqs), tuple(messages), tuple(turns), tuple(ids))
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
        # A turn's messages are the history's last rows as it is planned: only the running turn
        # writes to its session. (A retried plan of the same turn finds them in the kept copy.)
        own = len(turns)
        while own and turns[own - 1] == turn_id:
            own -= 1
        return seqs, messages, messages[own:]

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


# --- running a claimed turn -------------------------------------------------------------------
# Running a queued turn on a worker: claim it once, plan it from PostgreSQL, run the
# agent, persist its messages, pending calls and usage atomically, then publish `turn_stop`.
#
# What a worker keeps about its turns (their heartbeats, their tasks, the histories it read)
# is the worker's own (`Worker`), handed to `turn_execute`.


def effective_options(agent: Agent | AgentDefinition, stored: dict) -> dict[str, str]:
    """Every declared option's value for the runtime: set value, else default (decrypted)."""
    values = {}
    for option in option_rows(agent):
        if option.name in stored:
            values[option.name] = crypto.decrypt(stored[option.name]) if option.is_secret else stored[option.name]
        else:
            values[option.name] = option.default_value()
    return values


def _server_bindings(agent: AgentDefinition, refs: list[dict] | None) -> dict[str, ServerToolBinding]:
    if not refs:
        return {}
    specs = {spec["name"]: spec for spec in server_tool_specs(agent)}
    rows = {tool.name: tool for tool in agent.server_tools}
    bindings = {}
    for ref in refs:
        spec = specs.get(ref["name"])
        if spec is None:
            continue  # the operator removed it since; the agent no longer sees it
        row = rows.get(ref["name"])
        bindings[ref["name"]] = ServerToolBinding(
            spec=spec,
            trust=bool(ref.get("trust")),
            implementation=row.implementation if row else "",
            settings=row.settings if row else {},
        )
    return bindings


@dataclasses.dataclass
class _Compacted:
    """The compacted history a turn was planned with (positions and messages, in order)."""

    seqs: list[int]
    messages: list[dict]

    def then(self, seqs: list[int], messages: list[dict]) -> list[tuple[int, dict]]:
        """As (seq, message) pairs, followed by the turn's own."""
        return list(zip(self.seqs + seqs, self.messages + messages))


def _plan(
    turn_id: str, claimed: store.ClaimedTurn, session: store.TurnSession, histories: KeptHistories
) -> tuple[host.TurnPlan, _Compacted]:
    agent = agent_definition(session.agent_id, session.agent_revision)
    seqs, messages, incoming = histories.load(claimed.session_pk, turn_id)
    permissions = [
        PermissionAnswer(ToolCall(p["toolCallId"], p["name"], p.get("input", {})), p["granted"], p.get("reason"))
        for p in claimed.permissions
    ]
    plan = host.TurnPlan(
        turn_id=turn_id,
        session_id=session.public_id,
        tenant=session.tenant_name,
        agent_name=agent.name,
        runtime_kind=agent.runtime_kind,
        config=agent.runtime_config or {},
        options=effective_options(agent, session.options),
        options_set=frozenset(session.options),
        server_tools=_server_bindings(agent, session.server_tools),
        client_tools={tool["name"]: tool for tool in session.client_tools or []},
        history=list(messages),  # the runtime's (the host appends answered permissions to it)
        incoming=incoming,
        permissions=permissions,
        stream=claimed.stream,
        capabilities=agent.capabilities(),
    )
    return plan, _Compacted(seqs, messages)


DB_ERRORS = (OperationalError, InterfaceError)


def _with_db_retry(function, *args):
    """Call `function`, retrying while PostgreSQL is briefly unreachable (a restart, a
    failover): a worker's claim or finish must not turn a database blip into a lost turn."""
    deadline = time.monotonic() + settings.AAP_DB_RETRY_SECONDS
    pause = 0.2
    while True:
        try:
            return function(*args)
        except DB_ERRORS as exc:
            if time.monotonic() > deadline:
                raise
            logger.warning("database unavailable (%s); retrying %s", type(exc).__name__, function.__name__)
            connection.close()  # a broken connection goes back to the pool, which discards it
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def _output_json(running: host.RunningTurns, turn_id: str) -> str | None:
    shaped = running.output_so_far(turn_id)
    return dumps(shaped) if shaped else None


def turn_execute(
    turn_id: str,
    claimed: store.ClaimedTurn,
    *,
    liveness: Liveness,
    running: host.RunningTurns,
    histories: KeptHistories,
) -> bool:
    """Run a turn a worker thread claimed (queue.claim_next) to its end and persist
    it, with the worker's `liveness` (its heartbeat), `running` turns (a cancel reaches it
    there) and kept `histories`. Returns whether other turns were waiting for a worker slot
    as it ended (True when that is not known): the thread then claims the next."""
    # From here a cancel signal is kept for the turn; before, it is read with the lease.
    running.expect(turn_id)
    try:
        # The Redis lease backs up the PostgreSQL heartbeat.
        if events.backend().take_lease_sync(turn_id):
            running.cancel(turn_id)
    except Exception:  # the lease is a backup: the turn runs without it (a cancel was refused with 503)
        logger.warning("no Redis lease for turn %s; its heartbeat stands alone", turn_id, exc_info=True)
    metrics.turn_claimed(claimed.waited)
    liveness.track(turn_id, None if claimed.stream == "delta" else lambda: _output_json(running, turn_id))
    try:
        return _execute_claimed(turn_id, claimed, running, histories)
    finally:
        liveness.untrack(turn_id)
        running.remove(turn_id)


def _execute_claimed(
    turn_id: str, claimed: store.ClaimedTurn, running: host.RunningTurns, histories: KeptHistories
) -> bool:
    session = claimed.session or _with_db_retry(store.session_for_turn, claimed.session_pk)
    if session is None:
        return True
    bind_log_context(tenant=session.tenant_name, session=session.public_id)
    try:
        plan, compacted = _with_db_retry(_plan, turn_id, claimed, session, histories)
    except Exception:  # the turn's boundary: it ends with an error
        logger.error("turn %s could not be prepared", turn_id, exc_info=True)
        try:
            last = events.last_seq_sync(turn_id)
        except Exception:  # its ending is numbered from the start then
            logger.warning("the last event of turn %s is unreadable", turn_id, exc_info=True)
            last = 1
        outcome = host.TurnOutcome(
            "error",
            [],
            [],
            last,
            error="The turn could not be prepared.",
            stop_meta={"error": "The turn could not be prepared."},
        )
        compacted = _Compacted([], [])
    else:
        # The agent may run for minutes: give the connection back to the pool meanwhile.
        connection.close()
        outcome = host.execute_sync(plan, running)
    try:
        return _with_db_retry(_finish, turn_id, claimed.session_pk, outcome, compacted)
    except Exception:
        # Never re-raised to Celery, which would log the database's text (it quotes the values).
        logger.error("turn %s could not be stored", turn_id, exc_info=True)
        try:
            events.backend().clear_lease_sync(turn_id)  # with its heartbeat stopped, it ends as lost
        except Exception:  # the lease expires by itself
            logger.warning("could not clear the lease of %s", turn_id, exc_info=True)
        return True


def _finish(turn_id: str, session_pk: int, outcome: host.TurnOutcome, compacted: _Compacted) -> bool:
    """Persist a turn's messages, pending calls and usage atomically, then publish turn_stop.
    Locks the session, then the turn (the one lock order, docs/api.md "Guarantees").
    Returns whether other turns wait for a worker slot (True when not known)."""
    problem = unstorable(outcome.pending_calls)
    if problem:
        # History keeps the calls as produced (stored as text); jsonb cannot keep them pending.
        sentence = (
            "The agent produced a tool call that cannot be kept waiting for an answer: its input holds "
            "a NUL character (\\u0000) or a non-finite number."
        )
        outcome = dataclasses.replace(
            outcome,
            stop_reason="error",
            pending_calls=[],
            error=sentence,
            stop_meta={**outcome.stop_meta, "error": sentence},
        )
    rewrites = store.compaction_rewrites(outcome.compaction, len(compacted.seqs) + len(outcome.messages))
    compaction = outcome.compaction if rewrites else None
    # The session's row is locked first, then the turn's, by store.end_turn: a turn's end with
    # nothing to compact is one statement, and a compaction joins it in one transaction.
    with transaction.atomic() if compaction is not None else contextlib.nullcontext():
        ended = _end_turn(turn_id, session_pk, outcome)
        if ended is not None and compaction is not None:
            last = ended.message_seq + len(outcome.messages)
            seqs = list(range(ended.message_seq + 1, last + 1))
            apply_compaction(session_pk, last, compacted.then(seqs, outcome.messages), compaction)
    if ended is None:
        # Deleted with its session, a retry whose first commit went through, or a turn
        # declared lost while this worker was frozen or cut off: it ended once already, and
        # what its clients were told then is what history keeps (the fence, docs/api.md
        # "Guarantees"). The stream gets the stored ending if it lacks one.
        if _declared_lost(turn_id):
            logger.warning("turn %s finished after it was declared lost; its answer is not kept", turn_id)
        transaction.on_commit(lambda: publish_stop_if_missing(turn_id))
        return True
    meta = dict(outcome.stop_meta)
    if outcome.model_calls:
        meta["usage"] = {"promptTokens": outcome.prompt_tokens, "completionTokens": outcome.completion_tokens}
        if outcome.usage_estimated:
            meta["usage"]["estimated"] = True
    transaction.on_commit(lambda: publish_stop(turn_id, outcome.stop_reason, meta, seq=outcome.last_seq + 1))
    return ended.others_waiting


def _end_turn(turn_id: str, session_pk: int, outcome: host.TurnOutcome) -> store.EndedTurn | None:
    """running -> done with the outcome's stop reason, error, usage and messages, appended to
    the session's history (store.end_turn)."""
    return store.end_turn(
        turn_id,
        session_pk,
        messages=outcome.messages,
        stop_reason=outcome.stop_reason,
        cancelled=outcome.cancelled,
        error=outcome.error[:500],
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        model_calls=outcome.model_calls,
        pending_calls=outcome.pending_calls,
        usage_estimated=outcome.usage_estimated,
    )


def _declared_lost(turn_id: str) -> bool:
    return Turn.objects.filter(id=turn_id, status=Turn.DONE, error=LOST_ERROR).exists()
