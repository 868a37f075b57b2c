"""Handing turns to workers, with the turn's row in PostgreSQL as the outbox.

A turn is committed `queued` first and put on the broker after. Whatever happens between
(a crash of the web process, Redis down or restarted), the row stays `queued`, and a queued
turn whose dispatch left no mark in Redis is dispatched again: by the periodic sweep, by a
client following it, by the next request on its session. A second delivery is harmless:
a worker claims a turn once (turn_store.claim_turn). Waiting in the queue is never failure.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import cache

from celery import current_app
from celery.utils.nodenames import worker_direct
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from hosting.logs import log_context

from . import events, turn_store
from .services import execution

logger = logging.getLogger(__name__)

# A dispatch mark lasts this long: a queued turn whose mark is gone is dispatched again.
# Pinned turns (an answer to a prompt one worker holds) fall back to any worker sooner: the
# holder's routing key expires within 30 s when it dies.
MARK_SECONDS = 600.0
PINNED_MARK_SECONDS = 30.0

# The Celery task that runs a turn (sessions_app.tasks), sent by name: tasks import services,
# services import this module.
RUN_TURN = "sessions_app.tasks.run_turn"


@cache
def _embedded_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=settings.AAP_EMBEDDED_WORKERS, thread_name_prefix="aap-turn")


def _run_embedded(turn_id: str) -> None:
    close_old_connections()
    try:
        with log_context(turn=turn_id):
            execution.turn_execute(turn_id)
    finally:
        close_old_connections()


def enqueue_turn(turn_id: str, *, node: str | None = None) -> None:
    """Hand a turn to a Celery worker (REDIS_URL set) or to a thread of this process;
    `node` names the worker that must run it (its direct queue, `worker_direct`)."""
    if settings.REDIS_URL and node:
        current_app.send_task(RUN_TURN, args=(turn_id,), queue=worker_direct(node))
    elif settings.REDIS_URL:
        current_app.send_task(RUN_TURN, args=(turn_id,))
    else:
        _embedded_pool().submit(_run_embedded, turn_id)


def dispatch(turn_id: str, *, node: str | None = None) -> bool:
    """Put a queued turn on the broker and mark it dispatched. False (logged) when the
    broker is unreachable: the turn stays queued and is dispatched again later."""
    backend = events.backend()
    try:
        enqueue_turn(turn_id, node=node)
        backend.mark_dispatched_sync(turn_id, PINNED_MARK_SECONDS if node else MARK_SECONDS)
    except Exception as exc:
        logger.warning("turn %s stays queued: the broker is unreachable (%s)", turn_id, type(exc).__name__)
        return False
    return True


def redispatch_if_lost(turn_id: str, created_at) -> bool:
    """Dispatch a queued turn again when its dispatch left no trace. True if it did."""
    if (timezone.now() - created_at).total_seconds() < settings.AAP_TURN_DISPATCH_GRACE_SECONDS:
        return False  # its web process may still be handing it over
    try:
        if events.backend().dispatched_sync(turn_id):
            return False
    except Exception:
        return False  # Redis is down: nothing can be dispatched now anyway
    logger.warning("turn %s was queued without a dispatch; dispatching it again", turn_id)
    return dispatch(turn_id)


def dispatch_pending() -> int:
    """Dispatch every queued turn whose dispatch left no trace (run periodically)."""
    cutoff = timezone.now() - timedelta(seconds=settings.AAP_TURN_DISPATCH_GRACE_SECONDS)
    backend = events.backend()
    sent = 0
    for turn_id in turn_store.queued_turns(cutoff):
        if not backend.dispatched_sync(turn_id):
            logger.warning("turn %s was queued without a dispatch; dispatching it again", turn_id)
            sent += dispatch(turn_id)
    return sent
