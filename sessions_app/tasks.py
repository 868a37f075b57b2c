"""Celery tasks: thin, safe to run twice; the logic is in services."""

from concurrent.futures import ThreadPoolExecutor
from functools import cache

from celery import shared_task
from django.conf import settings
from django.db import close_old_connections

from hosting.logs import log_context

from . import dispatch, services


@shared_task(name="sessions_app.tasks.run_turn", ignore_result=True)
def run_turn(turn_id: str) -> None:
    with log_context(turn=turn_id):
        try:
            services.turn_execute(turn_id)
        finally:
            dispatch.dispatch_next()  # this slot is free: the next waiting turn, chosen fairly


@shared_task(name="sessions_app.tasks.sweep_stale_turns", ignore_result=True)
def sweep_stale_turns() -> int:
    return services.sweep_stale_turns()


@cache
def _embedded_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=settings.AAP_EMBEDDED_WORKERS, thread_name_prefix="aap-turn")


def _run_embedded(turn_id: str) -> None:
    close_old_connections()
    try:
        with log_context(turn=turn_id):
            try:
                services.turn_execute(turn_id)
            finally:
                dispatch.dispatch_next()
    finally:
        close_old_connections()


def enqueue_turn(turn_id: str, *, node: str | None = None) -> None:
    """Hand a turn to a Celery worker (REDIS_URL set) or to a thread of this process;
    `node` names the worker that must run it (its direct queue, `worker_direct`)."""
    if settings.REDIS_URL and node:
        from celery.utils.nodenames import worker_direct

        run_turn.apply_async((turn_id,), queue=worker_direct(node))
    elif settings.REDIS_URL:
        run_turn.delay(turn_id)
    else:
        _embedded_pool().submit(_run_embedded, turn_id)
