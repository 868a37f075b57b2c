"""Content helpers, the fold (events -> messages) and the stream-mode shaper.

The invariant of AAP: folding a turn's events gives exactly the messages that `stream: "none"`
returns and that the turn appends to `full` history, in every stream mode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

DATA_URI_RE = re.compile(r"^data:[\w.+-]+/[\w.+-]+;base64,[A-Za-z0-9+/=\s]+$")


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII kept as is (the wire form of every AAP body and event)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def content_text(content: Any) -> str:
    """The text of a content value: a string, or its text blocks joined by a newline."""
    if isinstance(content, str):
        return content
    return "\n".join(block.get("text", "") for block in content if block.get("type") == "text")


def content_images(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return []
    return [block for block in content if block.get("type") == "image"]


def image_kind(url: str) -> str | None:
    """`"http"` for an https:// image URL, `"data"` for a base64 data URI, else None."""
    if url.startswith("https://") and len(url) > len("https://"):
        return "http"
    if DATA_URI_RE.match(url):
        return "data"
    return None


def tool_uses(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The `tool_use` blocks of an assistant message."""
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, list):
        return []
    return [block for block in content if block.get("type") == "tool_use"]


def denial_text(reason: str | None) -> str:
    """The tool message AAP stores for a denied permission."""
    return f"Tool call denied: {reason}" if reason else "Tool call denied"


def fold(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold a turn's events (`{"event": name, ...}` dicts) into the messages they stand for.

    Text and thinking deltas join into blocks of one assistant message (a `text` or
    `thinking` event is one whole block); a `tool_call` adds a `tool_use` block; a
    `tool_result` closes the assistant message and adds a `tool` message. `turn_start` and
    `turn_stop` carry no content.
    """
    messages: list[dict[str, Any]] = []
    blocks: list[dict[str, Any]] | None = None
    last_delta: str | None = None  # the kind of delta the last block was built from

    for event in events:
        name = event["event"]
        if name in ("text_delta", "thinking_delta", "text", "thinking"):
            kind = "text" if name.startswith("text") else "thinking"
            piece = event.get("delta") if name.endswith("_delta") else event[kind]
            if blocks is None:
                blocks = []
            if name.endswith("_delta") and last_delta == kind and blocks and blocks[-1]["type"] == kind:
                blocks[-1][kind] += piece
            else:
                blocks.append({"type": kind, kind: piece})
            last_delta = kind if name.endswith("_delta") else None
        elif name == "tool_call":
            if blocks is None:
                blocks = []
            blocks.append(
                {"type": "tool_use", "toolCallId": event["toolCallId"], "name": event["name"], "input": event["input"]}
            )
            last_delta = None
        elif name == "tool_result":
            if blocks:
                messages.append({"role": "assistant", "content": blocks})
            blocks, last_delta = None, None
            messages.append({"role": "tool", "toolCallId": event["toolCallId"], "content": event["content"]})
    if blocks:
        messages.append({"role": "assistant", "content": blocks})
    return messages


class MessageShaper:
    """Shapes a runtime's delta events for one stream mode.

    `delta` passes events through; `message` (and `none`, which is published in message
    shape for re-attach) joins runs of deltas into one `text` / `thinking` event per part.
    """

    def __init__(self, mode: str):
        self.mode = mode
        self._kind: str | None = None
        self._parts: list[str] = []

    def feed(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if self.mode == "delta":
            return [event]
        name = event["event"]
        if name in ("text_delta", "thinking_delta"):
            kind = name[: -len("_delta")]
            out = self.flush() if self._kind not in (None, kind) else []
            self._kind = kind
            self._parts.append(event["delta"])
            return out
        return [*self.flush(), event]

    def flush(self) -> list[dict[str, Any]]:
        if self._kind is None:
            return []
        event = {"event": self._kind, self._kind: "".join(self._parts)}
        self._kind, self._parts = None, []
        return [event]
