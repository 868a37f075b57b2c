"""Bounds on what one turn may produce, and the joining of tiny deltas, so that no turn can
take a worker's shared runtime loop or Redis from the turns beside it.

- `OutputBudget` counts a turn's output bytes and stream entries; past either bound the
  turn ends `max_tokens` with a sentence (`TurnOutputExceeded`), alone.
- `DeltaRuns` keeps a run of same-kind deltas as one event whose text is joined when read:
  the fold of the joined events equals the fold of the originals, and a million one-word
  deltas become a few hundred stream entries once a turn streams faster than Redis writes.
"""

from __future__ import annotations

from django.conf import settings

_JOINABLE = ("text_delta", "thinking_delta")
# A turn's first entries go out one delta each (what a reader expects of a short answer);
# past this many, deltas that are still waiting for Redis join the one before them.
JOIN_AFTER_ENTRIES = 256
# Largest joined delta (characters) in one stream entry.
JOINED_CHARS = 64 * 1024


class TurnOutputExceeded(Exception):
    """A turn went past one of its output bounds; the message is safe to show."""


def _output_size(event: dict) -> int:
    name = event.get("event")
    if name in _JOINABLE:
        return len(event.get("delta", "").encode())
    if name == "tool_result" and isinstance(event.get("content"), str):
        return len(event["content"].encode())
    from ..protocol import dumps

    return len(dumps(event))


class OutputBudget:
    """Output bytes (the runtime's events) and stream entries (what Redis keeps) of one turn."""

    def __init__(self):
        self.max_bytes = settings.AAP_TURN_MAX_OUTPUT_BYTES
        self.max_entries = settings.AAP_TURN_MAX_EVENTS
        self.bytes = 0
        self.entries = 0
        self.exceeded: str = ""

    def _over(self, message: str) -> TurnOutputExceeded:
        self.exceeded = self.exceeded or message
        return TurnOutputExceeded(self.exceeded)

    def add_output(self, event: dict) -> None:
        if self.exceeded:
            raise TurnOutputExceeded(self.exceeded)
        self.bytes += _output_size(event)
        if self.max_bytes and self.bytes > self.max_bytes:
            raise self._over(
                f"The agent's answer passed this service's limit of {self.max_bytes} bytes per turn; it was cut there."
            )

    def add_entry(self) -> None:
        self.entries += 1
        if self.max_entries and self.entries > self.max_entries:
            raise self._over(
                f"The agent's answer passed this service's limit of {self.max_entries} events per turn; "
                "it was cut there."
            )


def joinable(event: dict) -> bool:
    return event.get("event") in _JOINABLE and len(event) == 2 and isinstance(event.get("delta"), str)


class DeltaRuns:
    """A list of events in which a joinable delta may join the run before it.

    Items are [seq, event, parts, chars]; `parts` (the run's texts) is None for an event that
    cannot be joined. Texts are joined only when read, so building a run costs O(n)."""

    __slots__ = ("items",)

    def __init__(self):
        self.items: list[list] = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def join(self, event: dict, limit: int | None = None) -> bool:
        """Join `event` to the last run if it can; True if it did."""
        if not self.items or not joinable(event):
            return False
        tail = self.items[-1]
        parts = tail[2]
        if parts is None or tail[1]["event"] != event["event"] or (limit is not None and tail[3] >= limit):
            return False
        parts.append(event["delta"])
        tail[3] += len(event["delta"])
        if len(parts) >= 1024:  # keep the number of small strings held bounded
            parts[:] = ["".join(parts)]
        return True

    def append(self, seq: int, event: dict) -> None:
        if joinable(event):
            self.items.append([seq, event, [event["delta"]], len(event["delta"])])
        else:
            self.items.append([seq, event, None, 0])

    def take(self) -> list[tuple[int, dict]]:
        """Every item as (seq, event), joined texts in place; the list is emptied."""
        items, self.items = self.items, []
        return [(seq, _joined(event, parts)) for seq, event, parts, _ in items]

    def events(self) -> list[dict]:
        return [_joined(event, parts) for _, event, parts, _ in self.items]


def _joined(event: dict, parts: list[str] | None) -> dict:
    if parts is None or (len(parts) == 1 and parts[0] is event["delta"]):
        return event
    return {"event": event["event"], "delta": "".join(parts)}
