"""How a turn ends on its stream and in its stored result: the `turn_stop` event (published
once, rebuilt from the turn's row when its publication was lost and the stream is whole)
and the `none`-mode body."""

from __future__ import annotations

import logging

from .. import events, turn_store
from ..models import Turn
from ..protocol import fold

logger = logging.getLogger(__name__)


LOST_ERROR = "The worker running this turn stopped before finishing."


def _stored_stop(turn: Turn) -> tuple[str, dict]:
    meta: dict = {}
    if turn.cancelled:
        meta["cancelled"] = True
    if turn.error:
        meta["error"] = turn.error
    if turn.model_calls:
        meta["usage"] = {"promptTokens": turn.prompt_tokens, "completionTokens": turn.completion_tokens}
        if turn.usage_estimated:
            meta["usage"]["estimated"] = True
    return turn.stop_reason or "error", meta


def publish_stop_if_missing(turn_id: str) -> None:
    """A finished turn whose stream has events but no `turn_stop` (its publication failed:
    Redis was down or full) gets one built from its row, so followers end — only when the
    stream holds every event from the first and they fold into what history keeps. A
    `turn_stop` after a hole would tell its readers a wrong answer; without one a stream
    closes as interrupted and its reader goes to history."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return
    try:
        last = events.backend().last_sync(turn_id)
        if last is None or last[1].get("event") == "turn_stop":
            return
        streamed = events.backend().read_all_sync(turn_id)
    except Exception:
        return
    if not _tells_what_history_keeps(turn, streamed):
        logger.warning("turn %s: its live events miss part of its output; no turn_stop is rebuilt", turn_id)
        return
    stop_reason, meta = _stored_stop(turn)
    publish_stop(turn_id, stop_reason, meta, seq=streamed[-1][0] + 1)


def _tells_what_history_keeps(turn: Turn, streamed: list[tuple[int, dict]]) -> bool:
    """Every event from the first is there, and they fold into the turn's stored output."""
    if [seq for seq, _ in streamed] != list(range(1, len(streamed) + 1)):
        return False
    shown = [event for _, event in streamed if event.get("event") not in ("turn_start", "turn_stop")]
    return fold(shown) == turn_store.turn_output(turn.id, turn.session_id, turn.output_seq)


def publish_stop(turn_id: str, stop_reason: str, meta: dict, *, seq: int | None = None) -> None:
    backend = events.backend()
    event = {"event": "turn_stop", "stopReason": stop_reason}
    if meta:
        event["_meta"] = meta
    try:
        # The last event: its publish also clears the turn's lease.
        backend.publish_sync(turn_id, seq or events.last_seq_sync(turn_id) + 1, event, final=True)
    except Exception as exc:
        logger.warning("could not publish turn_stop of %s: %s", turn_id, type(exc).__name__)
        try:
            backend.clear_lease_sync(turn_id)
        except Exception:
            pass


def turn_result(turn_id: str) -> dict | None:
    """A finished turn's `stream: "none"` body, from PostgreSQL alone (None: not finished)."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return None
    stop_reason, meta = _stored_stop(turn)
    messages = turn_store.turn_output(turn_id, turn.session_id, turn.output_seq)
    return {"stopReason": stop_reason, "messages": messages, "_meta": {"turnId": turn_id, **meta}}
