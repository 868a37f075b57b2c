"""A turn runner for the open-streams scenario: thousands of turns at once, few DB connections.

A Celery threads-pool worker holds one thread and one PostgreSQL connection for every
running turn (services.turn_execute keeps its connection while host.execute runs), so
K concurrent turns need K database connections; a shared PostgreSQL with
max_connections=100 cannot give 2,000. This process runs the same turns with the same code
as the Celery task, minus the thread per turn: it claims queued turns like turn_execute
(status queued -> running, lease set), builds the plan with services._plan, runs
sessions_app.host.execute on its asyncio loop, and persists with services._finish (which
publishes turn_stop) — the database work on a small thread pool (BENCH_RUNNER_DB_THREADS
connections). The HTTP side the scenario measures (Daphne following the turn's Redis
stream) is exactly the production one.

    python -m bench.turn_runner        (the stack's environment; stops on SIGTERM)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("bench.turn_runner")
POLL_SECONDS = 0.01


def _claim(limit: int = 200) -> list[str]:
    """Queued turns, marked running with a lease, as services.turn_execute does."""
    from django.db import transaction
    from django.utils import timezone

    from sessions_app import events
    from sessions_app.models import Turn

    backend = events.backend()
    with transaction.atomic():
        ids = list(
            Turn.objects.select_for_update(skip_locked=True)
            .filter(status=Turn.QUEUED)
            .order_by("created_at")
            .values_list("id", flat=True)[:limit]
        )
        for turn_id in ids:
            backend.set_lease_sync(turn_id)
        Turn.objects.filter(id__in=ids).update(status=Turn.RUNNING, started_at=timezone.now())
    return ids


def _prepare(turn_id: str):
    from sessions_app import services
    from sessions_app.models import Session, Turn

    turn = Turn.objects.get(id=turn_id)
    session = (
        Session.objects.select_related("agent", "tenant")
        .prefetch_related("agent__options", "agent__server_tools")
        .get(pk=turn.session_id)
    )
    plan, compacted = services._plan(turn, session)
    return plan, compacted, session.pk


def _finish(turn_id: str, session_pk: int, outcome, compacted) -> None:
    from sessions_app import services

    services._finish(turn_id, session_pk, outcome, compacted)


async def main() -> None:
    from django.db import close_old_connections

    from sessions_app import host

    loop = asyncio.get_running_loop()
    threads = int(os.environ.get("BENCH_RUNNER_DB_THREADS", "4"))
    db = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-db")
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    running: set[asyncio.Task] = set()

    async def run(turn_id: str) -> None:
        try:
            plan, compacted, session_pk = await loop.run_in_executor(db, _prepare, turn_id)
            outcome = await host.execute(plan)
            await loop.run_in_executor(db, _finish, turn_id, session_pk, outcome, compacted)
        except Exception:
            logger.exception("turn %s failed in the bench turn runner", turn_id)

    while not stop.is_set():
        try:
            ids = await loop.run_in_executor(db, _claim)
        except Exception:
            logger.exception("claiming turns failed")
            await loop.run_in_executor(db, close_old_connections)
            ids = []
        for turn_id in ids:
            task = loop.create_task(run(turn_id))
            running.add(task)
            task.add_done_callback(running.discard)
        if not ids:
            try:
                await asyncio.wait_for(stop.wait(), POLL_SECONDS)
            except TimeoutError:
                pass
    for task in running:
        task.cancel()
    db.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    import django

    django.setup()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main())
