"""Heartbeats of running turns, written to PostgreSQL and Redis by the process running them.

One thread per worker process updates every running turn's `heartbeat_at` in one statement
every third of AAP_TURN_LEASE_SECONDS, and stores what the agent produced so far in the
modes that publish only whole blocks (`message`, `none`), so a crash loses none of it.
Another keeps each running turn's Redis lease, from its claim until its end is stored, on
the same clock but on its own: a statement that hangs while PostgreSQL stalls never delays
it. A turn is declared lost only when its heartbeat is stale and its lease has lapsed too,
so a worker that is alive but cannot reach PostgreSQL (it retries its finish meanwhile) is
not declared lost for that alone.

A Celery worker process's own heartbeat, its sweep for lost turns and its turn chain are
sessions_app.engine.worker's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.conf import settings
from django.db import connection

from . import events, turn_store

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_running: dict[str, Callable[[], str | None] | None] = {}
_last_partial: dict[str, str] = {}
_thread: threading.Thread | None = None
_leaser: threading.Thread | None = None


def interval() -> float:
    return max(0.2, settings.AAP_TURN_LEASE_SECONDS / 3)


def _ensure_thread() -> None:
    global _thread, _leaser
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_beat_forever, name="aap-heartbeat", daemon=True)
        _thread.start()
    if _leaser is None or not _leaser.is_alive():
        _leaser = threading.Thread(target=_keep_leases_forever, name="aap-lease", daemon=True)
        _leaser.start()


def track(turn_id: str, partial: Callable[[], str | None] | None = None) -> None:
    """Keep the turn's heartbeat while it runs; `partial()` gives its output so far (JSON)."""
    with _lock:
        _running[turn_id] = partial
        _ensure_thread()


def untrack(turn_id: str) -> None:
    with _lock:
        _running.pop(turn_id, None)
        _last_partial.pop(turn_id, None)


def beat() -> None:
    """One round: every tracked turn's heartbeat, and the partial outputs that changed."""
    with _lock:
        running = dict(_running)
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
        if text and text != _last_partial.get(turn_id):
            partials[turn_id] = text
    try:
        turn_store.heartbeat(list(running), partials)
        _last_partial.update(partials)
    finally:
        connection.close()  # back to the pool; a broken one is discarded


def _beat_forever() -> None:
    import time

    while True:
        time.sleep(interval())
        try:
            beat()
        except Exception:  # the thread's boundary; PostgreSQL restarting: the next round tries again
            logger.warning("turn heartbeats could not be written", exc_info=True)


def keep_leases() -> None:
    """One round: the Redis lease of every tracked turn, in one round trip."""
    with _lock:
        running = list(_running)
    if running:
        events.backend().refresh_leases_sync(running)


def _keep_leases_forever() -> None:
    import time

    while True:
        time.sleep(interval())
        try:
            keep_leases()
        except Exception:  # the thread's boundary; Redis restarting: the PostgreSQL heartbeat stands alone
            logger.warning("turn leases could not be refreshed", exc_info=True)


def tracked() -> int:
    """How many turns this process runs now."""
    with _lock:
        return len(_running)
