"""What both event backends (memory.py, redis.py) are built from: a read of a turn's stream
(its (seq, event) pairs and how many bytes they came as), what a follower waits on, and the
end of a stream."""

from __future__ import annotations

import asyncio


class Entries(list):
    """(seq, event) pairs in order; `size`: the bytes read for them (0 where nothing is copied)."""

    size = 0


# A follower reads a stream in rounds of at most this many bytes about (entries are at most
# host.JOINED_CHARS): it holds one round while its client is slow, not the whole turn.
ROUND_BYTES = 64 * 1024
MIN_COUNT, MAX_COUNT = 4, 500


def next_count(count: int, read: Entries) -> int:
    """How many entries the next round asks for, after a round of `count` gave `read`."""
    if read.size > ROUND_BYTES:
        return MIN_COUNT
    if len(read) >= count and read.size < ROUND_BYTES // 4:
        return min(MAX_COUNT, count * 4)
    return count


# --- what a follower of a turn waits on, whichever backend serves the events ---


class Watcher:
    """A follower's inbox: events pushed as they are published, and a wake-up signal."""

    __slots__ = ("pushed", "wake")

    def __init__(self):
        self.wake = asyncio.Event()
        self.pushed: list[tuple[int, dict]] = []

    def deliver(self, items: list[tuple[int, dict]]) -> None:
        self.pushed.extend(items)
        self.wake.set()

    def take(self, after: int) -> list[tuple[int, dict]]:
        items = [item for item in self.pushed if item[0] > after]
        self.pushed.clear()
        return items


# --- the end of a turn's stream: after its `turn_stop` the stream takes no more events ---


class StreamEnded(Exception):
    """A write to a turn's stream after its `turn_stop`: the turn has ended (declared lost
    while its worker was frozen, say) and the writer's events would come after its ending."""

    def __init__(self, turn_id: str):
        super().__init__(f"the stream of turn {turn_id} has ended")
        self.turn_id = turn_id
