"""How a turn ends on its stream and in its stored result: the `turn_stop` event (published
once, rebuilt from the turn's row when its publication was lost) and the `none`-mode body."""

from __future__ import annotations

import logging

from .. import events, turn_store
from ..models import Turn

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
    return turn.stop_reason or "error", meta


def publish_stop_if_missing(turn_id: str) -> None:
    """A finished turn whose stream has events but no `turn_stop` (its publication failed:
    Redis was down) gets one built from its row, so followers end."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return
    try:
        last = events.backend().last_sync(turn_id)
    except Exception:
        return
    if last is None or last[1].get("event") == "turn_stop":
        return
    stop_reason, meta = _stored_stop(turn)
    publish_stop(turn_id, stop_reason, meta, seq=last[0] + 1)


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
