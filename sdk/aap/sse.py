"""Server-Sent Events: framing AAP events, and an incremental parser for the client side."""

from __future__ import annotations

import json
import re
from typing import Any

from .messages import dumps
from .types import Event, QueuedPlace

SSE_PING = b": ping\n\n"
_EOL = re.compile(rb"\r\n|\r|\n")


def event_data(event: dict[str, Any]) -> dict[str, Any]:
    """An event's SSE `data:` object: the event without its name."""
    return {key: value for key, value in event.items() if key != "event"}


def sse_frame(event_id: str | int | None, event: dict[str, Any]) -> bytes:
    """One SSE frame for an event dict `{"event": name, ...}`, with an `id:` when given."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event['event']}\ndata: {dumps(event_data(event))}\n\n".encode()


class SSEParser:
    """Incremental SSE parser (the WHATWG event-stream rules): feed it bytes as they arrive,
    in chunks of any size, and get the complete AAP events. Comments (`: ping`) are counted
    in `pings`; `last_event_id` is the last `id:` seen (what to send as `Last-Event-ID`);
    `queued` is the place of the latest `: queued {"position": n}` comment of this service
    (a turn waiting for a worker), None once an event follows it."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self.last_event_id: str | None = None
        self.pings = 0
        self.queued: QueuedPlace | None = None
        self.retry_ms: int | None = None

    def feed(self, chunk: bytes) -> list[Event]:
        self._buffer += chunk
        events: list[Event] = []
        while True:
            line, found = self._next_line()
            if not found:
                return events
            event = self._line(line)
            if event is not None:
                events.append(event)

    def finish(self) -> list[Event]:
        """The events still held when the stream ends (only a final lone \r can hold one)."""
        if self._buffer.endswith(b"\r"):
            self._buffer = self._buffer[:-1] + b"\n"
        return self.feed(b"")

    def _next_line(self) -> tuple[str, bool]:
        match = _EOL.search(self._buffer)
        if match is None or (match.group() == b"\r" and match.end() == len(self._buffer)):
            return "", False  # no whole line yet (a final \r may be the first half of \r\n)
        line, self._buffer = self._buffer[: match.start()], self._buffer[match.end() :]
        return line.decode("utf-8"), True

    def _line(self, line: str) -> Event | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            self.pings += 1
            if line.startswith(": queued "):
                try:
                    place = json.loads(line[len(": queued ") :])
                except ValueError:
                    place = None
                position = place.get("position") if isinstance(place, dict) else None
                self.queued = QueuedPlace(position=position) if isinstance(position, int) else None
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self.retry_ms = int(value)
        return None

    def _dispatch(self) -> Event | None:
        event_id, self._id = self._id, None
        if event_id is not None:
            self.last_event_id = event_id
        if not self._data:
            self._event = ""
            return None
        raw, name = "\n".join(self._data), self._event or "message"
        self._data, self._event = [], ""
        data = json.loads(raw)
        numeric = event_id if event_id is not None and event_id.isascii() and event_id.isdigit() else None
        event = Event(name, data if isinstance(data, dict) else {"data": data}, int(numeric) if numeric else None)
        self.queued = event.queued  # turn_start says whether it waits; any later event: it runs
        return event


def parse_sse(raw: bytes) -> list[Event]:
    """All complete events of an SSE body."""
    parser = SSEParser()
    return parser.feed(raw) + parser.finish()
