"""A turn's live events, its liveness lease and its cancel signal.

With REDIS_URL the events of a turn are a Redis stream (`aap:ev:<turn>`) written by the
worker and read by any web process: entries keep the event's sequence number as their id
(`0-<seq>`), so a reader that starts late still gets every event from the first, in order,
once each, and `Last-Event-ID` re-attaches exactly. Without REDIS_URL (embedded mode) the
same interface is served from memory inside the web process.

Redis carries only what can be lost: a lost stream breaks a live view of a turn, never the
session or its history, which live in PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import cache

from infra import redis_connections

from .base import MIN_COUNT, StreamEnded, Watcher, next_count
from .memory import MemoryEvents
from .redis import RedisEvents

__all__ = ["QUIET", "StreamEnded", "Watcher", "backend", "follow", "last_seq_sync", "unreachable"]


@cache
def backend() -> RedisEvents | MemoryEvents:
    connections = redis_connections.connections()
    return RedisEvents(connections) if connections is not None else MemoryEvents()


def unreachable(exc: BaseException) -> bool:
    """The event source cannot be reached now (Redis restarting, the network), as opposed
    to a Redis that answers and refuses (full, read-only)."""
    try:
        from redis.exceptions import ConnectionError, TimeoutError
    except ImportError:  # the embedded mode runs without redis-py
        return False
    return isinstance(exc, (ConnectionError, TimeoutError, OSError))


def last_seq_sync(turn_id: str) -> int:
    last = backend().last_sync(turn_id)
    return last[0] if last else 0


QUIET = None  # what follow() yields when nothing happened for a while


async def follow(
    turn_id: str, after: int = 0, *, quiet_seconds: float = 5.0, watching: Watcher | None = None
) -> AsyncIterator[tuple[int, dict] | None]:
    """Every event of the turn after `after`, live, until its `turn_stop`.

    Yields QUIET when `quiet_seconds` pass with no event, so the caller can ping the client
    and check that the turn is still alive. `watching`: the turn's watcher, opened (by the
    caller, who closes it) before its first event was published: the events come from it
    alone, with no read of the stream to start.
    """
    events = backend()

    async def reader_has_the_stop() -> bool:
        # e.g. an EventSource reconnecting after the end: nothing will ever come after `after`
        last = await events.last(turn_id)
        return last is not None and last[0] <= after and last[1].get("event") == "turn_stop"

    async with contextlib.AsyncExitStack() as stack:
        watcher: Watcher = watching if watching is not None else await stack.enter_async_context(events.watch(turn_id))
        if after and await reader_has_the_stop():
            return
        # The stream is read to replay, to fill a gap, and when woken without events.
        read = watching is None
        count = MIN_COUNT  # entries per read, grown while they are small (base.next_count)
        while True:
            woken = watcher.wake.is_set()
            watcher.wake.clear()  # before reading: a publication during the read is not lost
            # A wake-up without events: the hub reconnected. (With
            # events all read already, by the read that ran while they were published, it
            # is not: nothing is missing then.)
            delivered = bool(watcher.pushed)
            items = [] if read else watcher.take(after)
            read_more = False
            if read or (items and items[0][0] != after + 1) or (woken and not delivered):
                asked = count
                items = await events.read_now(turn_id, after, asked)
                count = next_count(asked, items)
                read_more = len(items) >= asked  # a full round: the stream may hold more already
            read = read_more
            if not items:
                try:
                    async with asyncio.timeout(quiet_seconds):  # no task per wait, unlike wait_for
                        await watcher.wake.wait()
                except TimeoutError:
                    if after and await reader_has_the_stop():
                        return
                    read = True  # a missed publication is found here at the latest
                    yield QUIET
                continue
            for seq, event in items:
                if seq <= after:
                    continue  # published twice (a write retried after Redis failed): sent once
                after = seq
                yield seq, event
                if event.get("event") == "turn_stop":
                    return
