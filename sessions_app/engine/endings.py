"""How a turn ends on its stream and in its stored result: the `turn_stop` event (published
once, rebuilt from the turn's row when its publication was lost and the stream is whole)
and the `none`-mode body."""

from __future__ import annotations

import logging
from typing import Any

from infra.outages import OUTAGE_ERRORS

from ..models import Turn
from ..protocol import fold
from . import events, turn_store

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
    except OUTAGE_ERRORS:
        logger.warning("turn %s: its live events are unreadable; no turn_stop is rebuilt", turn_id, exc_info=True)
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


def _block_events(block: dict, mode: str) -> list[dict]:
    kind = block.get("type")
    if kind in ("text", "thinking"):
        if mode == "delta":
            return [{"event": f"{kind}_delta", "delta": block[kind]}]
        return [{"event": kind, kind: block[kind]}]
    if kind == "tool_use":
        return [
            {"event": "tool_call", "toolCallId": block["toolCallId"], "name": block["name"], "input": block["input"]}
        ]
    raise ValueError(f"no event stands for a {kind!r} block")


def _blocks(message: dict) -> list[dict]:
    content = message.get("content")
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def _message_events(message: dict, mode: str, skip_blocks: int = 0) -> list[dict]:
    if message.get("role") == "tool":
        return [{"event": "tool_result", "toolCallId": message["toolCallId"], "content": message["content"]}]
    if message.get("role") != "assistant":
        raise ValueError("a turn's output holds assistant and tool messages only")
    return [event for block in _blocks(message)[skip_blocks:] for event in _block_events(block, mode)]


class FoldCursor:
    """Where a stream's reader stands in what its events fold into (aap.messages.fold), kept
    without their text: the messages it has whole, and the kind and length of each block of
    the one still open. A follower keeps one (not the events) to rebuild the rest of a turn
    whose live events were lost (`rebuilt_ending`)."""

    __slots__ = ("blocks", "closed", "last_delta")

    def __init__(self):
        self.closed = 0  # messages complete (an assistant message closed by a tool result, tool messages)
        self.blocks: list[list] | None = None  # [kind, length] per block of the open assistant message
        self.last_delta: str | None = None

    def feed(self, event: dict) -> None:
        name = event.get("event")
        if name in ("text_delta", "thinking_delta", "text", "thinking"):
            kind = "text" if name.startswith("text") else "thinking"
            piece = event.get("delta", "") if name.endswith("_delta") else event.get(kind, "")
            if self.blocks is None:
                self.blocks = []
            if name.endswith("_delta") and self.last_delta == kind and self.blocks and self.blocks[-1][0] == kind:
                self.blocks[-1][1] += len(piece)
            else:
                self.blocks.append([kind, len(piece)])
            self.last_delta = kind if name.endswith("_delta") else None
        elif name == "tool_call":
            if self.blocks is None:
                self.blocks = []
            self.blocks.append(["tool_use", 0])
            self.last_delta = None
        elif name == "tool_result":
            self.closed += 2 if self.blocks else 1
            self.blocks, self.last_delta = None, None


def _tail(cursor: FoldCursor, stored: list[dict], mode: str) -> list[dict]:
    """The events that take a reader at `cursor` to `stored` (ValueError when the stored
    messages do not have the shape the reader was shown)."""
    shown = cursor.closed + (1 if cursor.blocks else 0)
    if shown > len(stored):
        raise ValueError("the reader was shown more messages than history keeps")
    tail: list[dict] = []
    if cursor.blocks:
        message = stored[cursor.closed]
        target = _blocks(message)
        if message.get("role") != "assistant" or len(target) < len(cursor.blocks):
            raise ValueError("the message shown last is not the stored one")
        for (kind, length), block in zip(cursor.blocks, target):
            held = block.get(kind, "") if kind != "tool_use" else ""
            if block.get("type") != kind or len(held) < length:
                raise ValueError("a block shown is not the stored one")
        kind, length = cursor.blocks[-1]
        rest = target[len(cursor.blocks) - 1].get(kind, "") if kind != "tool_use" else ""
        if len(rest) > length:
            if mode != "delta" or cursor.last_delta != kind:
                raise ValueError("only a delta stream shows part of a block")
            tail.append({"event": f"{kind}_delta", "delta": rest[length:]})
        tail += _message_events(message, mode, skip_blocks=len(cursor.blocks))
    for message in stored[shown:]:
        tail += _message_events(message, mode)
    return tail


def rebuilt_ending(turn_id: str, cursor: FoldCursor, mode: str) -> list[dict] | None:
    """For a follower whose turn ended in PostgreSQL while its live events stopped short (lost
    with Redis): the rest of the turn, rebuilt from history, then its `turn_stop` rebuilt from
    the turn's row (stop reason, error, usage). `cursor`: where the events it sent, every one
    from the first, left its reader. None when the turn is not over, or the stored output does
    not have the shape the reader was shown: no ending that folds into history can be told."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return None
    stored = turn_store.turn_output(turn.id, turn.session_id, turn.output_seq)
    try:
        tail = _tail(cursor, stored, mode)
    except (ValueError, KeyError, TypeError, AttributeError):
        logger.warning("turn %s: what its follower was sent is not the start of its history", turn_id)
        return None
    stop_reason, meta = _stored_stop(turn)
    stop: dict[str, Any] = {"event": "turn_stop", "stopReason": stop_reason}
    if meta:
        stop["_meta"] = meta
    return [*tail, stop]


def publish_stop(turn_id: str, stop_reason: str, meta: dict, *, seq: int | None = None) -> None:
    backend = events.backend()
    event: dict[str, Any] = {"event": "turn_stop", "stopReason": stop_reason}
    if meta:
        event["_meta"] = meta
    try:
        # The last event: its publish also clears the turn's lease. Without `seq` (another
        # process ends the turn: a delete, a cancel) it goes after whatever the stream holds
        # when it is written, so an event the worker writes meanwhile cannot take its place.
        backend.publish_sync(turn_id, seq or 1, event, final=True)
    except Exception:  # the turn's ending stands in PostgreSQL whatever its live event does
        logger.warning("could not publish turn_stop of %s", turn_id, exc_info=True)
        try:
            backend.clear_lease_sync(turn_id)
        except Exception:  # the lease expires by itself
            logger.warning("could not clear the lease of %s", turn_id, exc_info=True)


def turn_result(turn_id: str) -> dict | None:
    """A finished turn's `stream: "none"` body, from PostgreSQL alone (None: not finished)."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return None
    stop_reason, meta = _stored_stop(turn)
    messages = turn_store.turn_output(turn_id, turn.session_id, turn.output_seq)
    return {"stopReason": stop_reason, "messages": messages, "_meta": {"turnId": turn_id, **meta}}
