"""Celery tasks: thin, safe to run twice; the logic is in services."""

from celery import shared_task

from .dispatch import RUN_TURN
from .services import recovery
from .worker import run_turns


@shared_task(name=RUN_TURN, ignore_result=True)
def run_turn(turn_id: str) -> None:
    run_turns(turn_id)  # and, while turns wait, the ones the fair order gives this thread


@shared_task(name="sessions_app.tasks.sweep_stale_turns", ignore_result=True)
def sweep_stale_turns() -> int | None:
    return recovery.sweep_unless_running()  # skipped while a worker's own sweep runs
