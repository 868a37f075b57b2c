"""Lost turns: a running turn whose worker is gone (stale heartbeat, lapsed lease) ends with
`error`, keeping what it produced."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from infra import metrics
from infra.outages import OUTAGE_ERRORS

from ..models import IdempotencyKey, Session, Turn
from ..protocol import fold
from . import events, queue
from .store import LOST_ERROR, append_messages, publish_stop, publish_stop_if_missing

logger = logging.getLogger(__name__)


def _is_lost(turn: Turn) -> bool:
    """A running turn of this deployment's queue whose PostgreSQL heartbeat is stale and whose
    Redis lease has lapsed. Queued turns are never lost: they wait for a worker, however long
    the queue. A turn of another queue (AAP_TURN_QUEUE: a deployment sharing the database, not
    Redis) is never lost here: its lease and its events are in that deployment's Redis, and
    ending it from this one would store and tell an answer without them."""
    if turn.status != Turn.RUNNING or turn.queue != settings.AAP_TURN_QUEUE:
        return False
    beat = turn.heartbeat_at or turn.started_at
    if beat is not None and (timezone.now() - beat).total_seconds() < settings.AAP_TURN_LEASE_SECONDS:
        return False
    try:
        if events.backend().lease_alive_sync(turn.id):
            return False  # e.g. PostgreSQL was down longer than the lease: the worker lives
    except OUTAGE_ERRORS:  # Redis down: the heartbeat alone decides
        logger.warning("the lease of turn %s is unreadable; its heartbeat decides", turn.id, exc_info=True)
    return True


def _produced_before_loss(turn: Turn, streamed: list[tuple[int, dict]]) -> tuple[list[dict], list[dict]]:
    """What the lost worker's agent produced, and the events of it nobody was sent yet.

    `message` and `none` modes publish whole blocks only; the worker's last checkpoint
    (`partial`: its output as message-mode events) also holds the block it was in and any
    it had not published. The stream's events are a prefix of the checkpoint's then."""
    shown = [e for _, e in streamed if e["event"] not in ("turn_start", "turn_stop")]
    if turn.partial and turn.stream != "delta":
        import json

        checkpoint = json.loads(turn.partial)
        if len(checkpoint) >= len(shown) and fold(checkpoint[: len(shown)]) == fold(shown):
            return fold(checkpoint), checkpoint[len(shown) :]
    return fold(shown), []


def finalize_if_lost(turn: Turn, session: Session) -> bool:
    """Inside a transaction holding the session lock: end a lost turn with `error`.

    What the lost worker had already produced is folded into history, so the history
    still equals what listeners saw (and more, in message/none modes). Returns True when
    the turn was (or is now) over.
    """
    if turn.status == Turn.DONE:
        return True
    if not _is_lost(turn):
        return False
    streamed = events.backend().read_all_sync(turn.id)
    produced, unsent = _produced_before_loss(turn, streamed)
    message = LOST_ERROR
    Turn.objects.filter(id=turn.id).update(
        status=Turn.DONE,
        stop_reason="error",
        error=message,
        finished_at=timezone.now(),
        partial="",
        output_seq=session.message_seq + 1 if produced else 0,
    )
    append_messages(session, produced, turn=turn)
    session.pending_calls = []
    session.active_turn = None
    session.save(update_fields=["message_seq", "pending_calls", "active_turn", "updated_at"])
    last = streamed[-1][0] if streamed else 0
    turn_id = turn.id

    def publish_end():
        # Listeners get the rest of what history now holds, then the ending.
        try:
            for offset, event in enumerate(unsent, start=1):
                events.backend().publish_sync(turn_id, last + offset, event)
        except Exception:  # history holds the output; listeners get the ending regardless
            logger.warning("could not publish the recovered output of %s", turn_id, exc_info=True)
        publish_stop(turn_id, "error", {"error": message}, seq=last + len(unsent) + 1)

    transaction.on_commit(publish_end)
    logger.warning("turn %s was lost (%s); ended with error", turn.id, turn.status)
    metrics.turn_lost(turn.status)
    turn.status = Turn.DONE
    return True


_LIVENESS_FIELDS = ("status", "created_at", "session_id", "heartbeat_at", "started_at", "queue")


def turn_recover_if_lost(turn_id: str) -> bool:
    """End the turn with `error` if its worker is gone; give a finished turn's stream its
    missing `turn_stop`. Returns True if the turn is over (a queued one waits for a worker)."""
    turn = Turn.objects.filter(id=turn_id).only(*_LIVENESS_FIELDS).first()
    if turn is None:
        return True
    if turn.status == Turn.QUEUED:
        if not settings.REDIS_URL:
            queue.wake()  # the embedded worker starts with the first turn after a restart
        return False
    if turn.status == Turn.DONE:
        publish_stop_if_missing(turn_id)
        return True
    if not _is_lost(turn):
        return False
    with transaction.atomic():
        session = Session.objects.select_for_update().filter(pk=turn.session_id).first()
        turn = Turn.objects.select_for_update().filter(id=turn_id).first()
        if session is None or turn is None:
            return True
        return finalize_if_lost(turn, session)


def forget_expired_idempotency_keys() -> int:
    """Delete the Idempotency-Keys older than AAP_IDEMPOTENCY_SECONDS (a key the API finds
    expired is deleted there too: sessions_app.api.admission)."""
    cutoff = timezone.now() - timedelta(seconds=settings.AAP_IDEMPOTENCY_SECONDS)
    return IdempotencyKey.objects.filter(created_at__lt=cutoff).delete()[0]


def sweep_stale_turns() -> int:
    """End every lost turn of this deployment's queue, forget expired Idempotency-Keys (run
    periodically); returns how many turns were ended. It reads PostgreSQL only: a Redis that
    is down or full (nothing can be published) does not keep the lost turns from being ended."""
    forget_expired_idempotency_keys()
    ended = 0
    running = Turn.objects.filter(status=Turn.RUNNING, queue=settings.AAP_TURN_QUEUE)
    for turn_id in running.values_list("id", flat=True):
        turn = Turn.objects.filter(id=turn_id).only(*_LIVENESS_FIELDS).first()
        if turn is None or not _is_lost(turn):
            continue
        try:
            ended += bool(turn_recover_if_lost(turn_id))
        except Exception:  # e.g. its events unreadable now: the next sweep tries again
            logger.warning("the sweep could not end lost turn %s", turn_id, exc_info=True)
    return ended


# One sweep at a time across every worker (a session-level advisory lock in PostgreSQL).
_SWEEP_LOCK = 0x4141_5053_5745_4550


def sweep_unless_running() -> int | None:
    """Sweep, unless another process sweeps right now (None then). Workers run this on
    their own clock: the sweep needs no broker message, so a full or unreachable Redis
    does not stop it."""
    if connection.vendor != "postgresql":
        return sweep_stale_turns()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [_SWEEP_LOCK])
        if not cursor.fetchone()[0]:
            return None
    try:
        return sweep_stale_turns()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [_SWEEP_LOCK])
