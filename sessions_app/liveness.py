"""Heartbeats of running turns, written to PostgreSQL and Redis by the process running them.

One thread per worker process updates every running turn's `heartbeat_at` in one statement
every third of AAP_TURN_LEASE_SECONDS, and stores what the agent produced so far in the
modes that publish only whole blocks (`message`, `none`), so a crash loses none of it.
Another keeps each running turn's Redis lease, from its claim until its end is stored, on
the same clock but on its own: a statement that hangs while PostgreSQL stalls never delays
it. A turn is declared lost only when its heartbeat is stale and its lease has lapsed too,
so a worker that is alive but cannot reach PostgreSQL (it retries its finish meanwhile) is
not declared lost for that alone.

A Celery worker process also beats for itself (`serve_as_worker`): its row says how many
turns it runs at once, which is the capacity sessions_app.dispatch fills, and while it has a
free thread each round offers it to the turns waiting in PostgreSQL. It also sweeps for lost
turns every SWEEP_SECONDS on a thread of its own (one worker at a time), so lost turns end
even when no broker message can be sent (Redis full or down).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.conf import settings
from django.db import connection

from . import events, schedule_store, turn_store

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_running: dict[str, Callable[[], str | None] | None] = {}
_last_partial: dict[str, str] = {}
_thread: threading.Thread | None = None
_leaser: threading.Thread | None = None
_sweeper: threading.Thread | None = None
# How often a worker process sweeps for lost turns (services.recovery.sweep_unless_running).
SWEEP_SECONDS = 10.0
_worker: tuple[str, int] | None = None  # (node name, concurrency) in a Celery worker process


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


def serve_as_worker(node: str, concurrency: int) -> None:
    """This process runs up to `concurrency` turns at once: say so now and every round."""
    global _worker, _sweeper
    with _lock:
        _worker = (node, concurrency)
        _ensure_thread()
        if _sweeper is None or not _sweeper.is_alive():
            _sweeper = threading.Thread(target=_sweep_forever, name="aap-sweep", daemon=True)
            _sweeper.start()
    try:
        _worker_round()
    except Exception as exc:
        logger.warning("the worker's heartbeat could not be written: %s", type(exc).__name__)
    finally:
        connection.close()


def serving() -> bool:
    """This process is a Celery worker that takes turns (not shutting down)."""
    return _worker is not None


def stop_serving() -> None:
    """The worker is shutting down: its slots no longer count (running turns still beat)."""
    global _worker
    with _lock:
        node, _worker = (_worker or (None, 0))[0], None
    if node:
        try:
            schedule_store.worker_gone(node)
        except Exception:
            pass  # its heartbeat goes stale instead
        finally:
            connection.close()


def _worker_round() -> None:
    from . import dispatch

    with _lock:
        worker, busy = _worker, len(_running)
    if worker is None:
        return
    schedule_store.worker_beat(*worker)
    if busy < worker[1]:
        dispatch.dispatch_next()


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
        except Exception:
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
        except Exception as exc:  # PostgreSQL restarting: the next round tries again
            logger.warning("turn heartbeats could not be written: %s", type(exc).__name__)
        try:
            _worker_round()
        except Exception as exc:
            logger.warning("the worker's heartbeat could not be written: %s", type(exc).__name__)
        finally:
            connection.close()


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
        except Exception as exc:  # Redis restarting: the heartbeat in PostgreSQL stands alone
            logger.warning("turn leases could not be refreshed: %s", type(exc).__name__)


def _sweep_forever() -> None:
    """A worker's own sweep for lost turns, on its own thread (a long sweep never delays the
    heartbeats), one worker at a time: it depends on PostgreSQL only, not on a broker
    message reaching a worker."""
    import time

    from .services import recovery

    while True:
        time.sleep(SWEEP_SECONDS)
        if _worker is None:
            continue  # shutting down
        try:
            recovery.sweep_unless_running()
        except Exception as exc:  # PostgreSQL restarting: the next round tries again
            logger.warning("the sweep for lost turns failed: %s", type(exc).__name__)
        finally:
            connection.close()
