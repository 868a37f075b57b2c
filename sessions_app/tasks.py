"""Celery tasks: thin, safe to run twice; the logic is in services."""

from celery import shared_task

from hosting.logs import log_context

from .dispatch import RUN_TURN, dispatch_next
from .services import execution, recovery


@shared_task(name=RUN_TURN, ignore_result=True)
def run_turn(turn_id: str) -> None:
    with log_context(turn=turn_id):
        try:
            execution.turn_execute(turn_id)
        finally:
            dispatch_next()  # this slot is free: the next waiting turn, chosen fairly


@shared_task(name="sessions_app.tasks.sweep_stale_turns", ignore_result=True)
def sweep_stale_turns() -> int:
    return recovery.sweep_stale_turns()
