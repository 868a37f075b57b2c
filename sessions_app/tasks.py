"""Celery tasks: thin, safe to run twice; the logic is in services."""

from celery import shared_task

from .engine import recovery, worker
from .engine.queue import WAKE


@shared_task(name=WAKE, ignore_result=True)
def wake() -> None:
    worker.wake()  # a free thread of this worker looks for the waiting turns now


@shared_task(name="sessions_app.tasks.sweep_stale_turns", ignore_result=True)
def sweep_stale_turns() -> int | None:
    return recovery.sweep_unless_running()  # skipped while a worker's own sweep runs
