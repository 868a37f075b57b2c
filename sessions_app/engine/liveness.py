"""Heartbeats of running turns, written to PostgreSQL and Redis by the worker running them.

A worker's `Liveness` (sessions_app.engine.worker.Worker owns one) keeps the turns it runs: one
thread updates every tracked turn's `heartbeat_at` in one statement every third of
AAP_TURN_LEASE_SECONDS, and stores what the agent produced so far in the modes that
publish only whole blocks (`message`, `none`), so a crash loses none of it. Another keeps
each tracked turn's Redis lease, from its claim until its end is stored, on the same clock
but on its own: a statement that hangs while PostgreSQL stalls never delays it. A turn is
declared lost only when its heartbeat is stale and its lease has lapsed too, so a worker
that is alive but cannot reach PostgreSQL (it retries its finish meanwhile) is not
declared lost for that alone.

A worker's own heartbeat row, its sweep for lost turns and its slot threads are
sessions_app.engine.worker's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.conf import settings
from django.db import connection

from . import events, store

logger = logging.getLogger(__name__)


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
