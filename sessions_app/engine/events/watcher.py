"""What a follower of a turn waits on, whichever backend serves the events."""

from __future__ import annotations

import asyncio


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
