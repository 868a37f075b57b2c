"""The embedded mode's event backend: the same interface as RedisEvents, inside one process."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

from django.conf import settings

from .base import Entries, StreamEnded, Watcher


class _MemoryLog:
    __slots__ = ("events", "expires_at", "waiters")

    def __init__(self):
        self.events: list[tuple[int, dict]] = []
        self.waiters: list[tuple[asyncio.AbstractEventLoop, Watcher]] = []
        self.expires_at: float | None = None


class MemoryEvents:
    """The embedded mode's event stream: one process, any threads, any event loops."""

    def __init__(self):
        self._logs: dict[str, _MemoryLog] = {}
        self._leases: dict[str, float] = {}
        self._cancelled: set[str] = set()
        self._cancel_handlers: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def _log(self, turn_id: str) -> _MemoryLog:
        log = self._logs.get(turn_id)
        if log is None:
            log = self._logs[turn_id] = _MemoryLog()
        return log

    def _prune(self) -> None:
        now = time.monotonic()
        for turn_id in [t for t, log in self._logs.items() if log.expires_at and log.expires_at < now]:
            del self._logs[turn_id]

    def publish_sync(self, turn_id: str, seq: int, event: dict, *, final: bool = False) -> None:
        with self._lock:
            log = self._log(turn_id)
            if log.events and log.events[-1][1].get("event") == "turn_stop":
                raise StreamEnded(turn_id)
            if log.events and log.events[-1][0] >= seq:
                if not final:
                    raise ValueError("event ids must increase")
                seq = log.events[-1][0] + 1  # the ending is never dropped: it goes last
            log.events.append((seq, event))
            if final:
                log.expires_at = time.monotonic() + settings.AAP_EVENT_RETENTION_SECONDS
                self._leases.pop(turn_id, None)
                self._prune()
            waiters = list(log.waiters)
        for loop, watcher in waiters:
            loop.call_soon_threadsafe(watcher.deliver, [(seq, event)])

    async def publish_many(self, turn_id: str, batch: list[tuple[int, dict]], *, expire: bool = True) -> None:
        for seq, event in batch:
            self.publish_sync(turn_id, seq, event)

    async def read_now(self, turn_id: str, after: int, count: int = 500) -> Entries:
        """`size` stays 0: the events are shared, not copied, whatever their number."""
        with self._lock:
            log = self._logs.get(turn_id)
            return Entries([item for item in log.events if item[0] > after][:count] if log else [])

    @contextlib.asynccontextmanager
    async def watch(self, turn_id: str):
        waiter = (asyncio.get_running_loop(), Watcher())
        with self._lock:
            self._log(turn_id).waiters.append(waiter)
        try:
            yield waiter[1]
        finally:
            with self._lock:
                log = self._logs.get(turn_id)
                if log is not None and waiter in log.waiters:
                    log.waiters.remove(waiter)
                if log is not None and not log.waiters and not log.events:
                    del self._logs[turn_id]  # watched ahead for a turn that was never started

    def read_all_sync(self, turn_id: str) -> list[tuple[int, dict]]:
        with self._lock:
            log = self._logs.get(turn_id)
            return list(log.events) if log else []

    def last_sync(self, turn_id: str) -> tuple[int, dict] | None:
        with self._lock:
            log = self._logs.get(turn_id)
            return log.events[-1] if log and log.events else None

    async def last(self, turn_id: str) -> tuple[int, dict] | None:
        return self.last_sync(turn_id)

    def set_lease_sync(self, turn_id: str) -> None:
        self._leases[turn_id] = time.monotonic() + settings.AAP_TURN_LEASE_SECONDS

    def take_lease_sync(self, turn_id: str) -> bool:
        self.set_lease_sync(turn_id)
        return turn_id in self._cancelled

    def refresh_leases_sync(self, turn_ids: list[str]) -> None:
        for turn_id in turn_ids:
            self.set_lease_sync(turn_id)

    def clear_lease_sync(self, turn_id: str) -> None:
        self._leases.pop(turn_id, None)

    def lease_alive_sync(self, turn_id: str) -> bool:
        return self._leases.get(turn_id, 0) > time.monotonic()

    def request_cancel_sync(self, turn_id: str) -> None:
        self._cancelled.add(turn_id)
        for handler in list(self._cancel_handlers):
            handler(turn_id)

    async def listen_cancels(self, on_cancel: Callable[[str], None]) -> None:
        """Until cancelled: dispatch cancel signals to `on_cancel` (a worker's running turns)."""
        self._cancel_handlers.append(on_cancel)
        try:
            await asyncio.Event().wait()
        finally:
            self._cancel_handlers.remove(on_cancel)
