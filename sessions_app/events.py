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
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import cache

from django.conf import settings

logger = logging.getLogger(__name__)

CANCEL_CHANNEL = "aap:cancel"


def live_stream_ttl() -> int:
    """How long a running turn's stream (and its cancel flag) is kept: longer than any turn."""
    return settings.AAP_LIVE_EVENTS_TTL_SECONDS


def _stream_key(turn_id: str) -> str:
    return f"aap:ev:{turn_id}"


def _lease_key(turn_id: str) -> str:
    return f"aap:lease:{turn_id}"


def _cancel_key(turn_id: str) -> str:
    return f"aap:cancel:{turn_id}"


def _notify_channel(turn_id: str) -> str:
    return f"aap:evn:{turn_id}"


def _dispatch_key(turn_id: str) -> str:
    return f"aap:disp:{turn_id}"


class Watcher:
    """A follower's inbox: events pushed as they are published, and a wake-up signal."""

    __slots__ = ("wake", "pushed")

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


class _NotifyHub:
    """One Redis pub/sub connection per event loop feeds every follower of this process.

    Followers do not hold a connection each: a follower subscribes its turn's channel here
    and waits for the subscription to be confirmed (so nothing published afterwards is
    missed). Each publication carries its events, so a follower that is caught up writes
    them at once; it reads the stream (XRANGE) only to replay or to fill a gap.
    """

    IDLE_CHANNEL = "aap:evn:-"  # keeps the pub/sub connection open with no follower

    def __init__(self, client):
        self.pubsub = client.pubsub()
        self.wakers: dict[str, set[Watcher]] = {}
        self.confirmed: dict[str, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None
        self.ready: asyncio.Future | None = None

    @contextlib.asynccontextmanager
    async def watch(self, channel: str):
        wake = Watcher()
        first = channel not in self.wakers
        self.wakers.setdefault(channel, set()).add(wake)
        try:
            if first:
                self.confirmed[channel] = asyncio.get_running_loop().create_future()
                await self._ensure_reader()
                await self.pubsub.subscribe(channel)
            await asyncio.wait_for(asyncio.shield(self.confirmed[channel]), 10)
            yield wake
        finally:
            waiters = self.wakers.get(channel)
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self.wakers[channel]
                    self.confirmed.pop(channel, None)
                    with contextlib.suppress(Exception):
                        await self.pubsub.unsubscribe(channel)

    async def _ensure_reader(self) -> None:
        # Set before any await: two followers arriving together must not start two readers
        # (two coroutines reading one connection break each other's reads).
        if self.reader is None or self.reader.done():
            loop = asyncio.get_running_loop()
            self.ready = loop.create_future()
            self.reader = loop.create_task(self._read(self.ready))
        await asyncio.shield(self.ready)

    async def _read(self, ready: asyncio.Future) -> None:
        try:
            await self.pubsub.subscribe(self.IDLE_CHANNEL)  # get_message needs a subscription
        except asyncio.CancelledError:
            ready.cancel()
            raise
        except Exception as exc:
            ready.set_exception(exc)
            raise
        ready.set_result(None)
        while True:
            try:
                message = await self.pubsub.get_message(timeout=30.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # redis-py reconnects and resubscribes on the next call
                logger.warning("event notifications lost Redis (%s); reconnecting", type(exc).__name__)
                for waiters in self.wakers.values():
                    for wake in waiters:
                        wake.wake.set()  # followers re-read the stream: nothing is lost meanwhile
                await asyncio.sleep(0.5)
                continue
            if not message:
                continue
            channel = message["channel"]
            if message["type"] == "subscribe":
                future = self.confirmed.get(channel)
                if future is not None and not future.done():
                    future.set_result(None)
            elif message["type"] == "message":
                waiters = self.wakers.get(channel)
                if waiters:
                    items = [(seq, event) for seq, event in json.loads(message["data"])]
                    for wake in waiters:
                        wake.deliver(items)


class _PublishBatcher:
    """Writes the publications of every turn on one event loop together: one pipeline per
    Redis round trip, whatever the number of turns publishing (one pipeline per event and
    turn was most of a worker's CPU with hundreds of streaming turns). A caller waits until
    its events are written, so each turn's events stay in order."""

    def __init__(self, client):
        self.client = client
        self.pending: list[tuple[str, list[tuple[int, dict]], asyncio.Future]] = []
        self.writer: asyncio.Task | None = None

    async def publish(self, turn_id: str, batch: list[tuple[int, dict]]) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.pending.append((turn_id, batch, done))
        if self.writer is None or self.writer.done():
            self.writer = loop.create_task(self._write())
        await done

    async def _write(self) -> None:
        while self.pending:  # what arrives during a round trip goes in the next pipeline
            work, self.pending = self.pending, []
            pipe = self.client.pipeline(transaction=False)
            for turn_id, batch, _ in work:
                for seq, event in batch:
                    pipe.xadd(_stream_key(turn_id), {"e": json.dumps(event)}, id=f"0-{seq}")
                pipe.publish(_notify_channel(turn_id), json.dumps(batch))
            # A stream recreated after a Redis restart gets an expiry too (its turn_start had it).
            for turn_id in {turn_id for turn_id, _, _ in work}:
                pipe.expire(_stream_key(turn_id), live_stream_ttl())
            try:
                results = await pipe.execute(raise_on_error=False)
            except Exception as exc:  # the connection failed: every caller of this round learns it
                for _, _, done in work:
                    if not done.done():
                        done.set_exception(exc)
                continue
            position = 0
            for _, batch, done in work:
                mine = results[position : position + len(batch) + 1]
                position += len(batch) + 1
                failed = next((r for r in mine if isinstance(r, Exception)), None)
                if done.done():
                    continue  # its caller was cancelled meanwhile
                if failed is not None:
                    done.set_exception(failed)
                else:
                    done.set_result(None)


class RedisEvents:
    def __init__(self, url: str):
        import redis

        self.url = url
        # Blocking pools: a burst of turns waits for a free connection instead of failing.
        self.sync = redis.Redis(
            connection_pool=redis.BlockingConnectionPool.from_url(
                url, max_connections=settings.REDIS_POOL_MAX, timeout=30,
                decode_responses=True, socket_timeout=30, socket_connect_timeout=5, health_check_interval=5,
            )
        )
        self._async: dict[asyncio.AbstractEventLoop, object] = {}
        self._hubs: dict[asyncio.AbstractEventLoop, _NotifyHub] = {}
        self._batchers: dict[asyncio.AbstractEventLoop, _PublishBatcher] = {}
        self._lock = threading.Lock()

    def _per_loop(self, registry: dict, make):
        """This loop's entry of `registry`, made once (asyncio objects belong to one loop)."""
        loop = asyncio.get_running_loop()
        item = registry.get(loop)
        if item is None:
            made = make()  # outside the lock: making a hub or batcher takes aclient()
            with self._lock:
                item = registry.setdefault(loop, made)
        return item

    def aclient(self):
        """The asyncio client of the running loop (redis-py asyncio clients are per loop)."""
        import redis.asyncio as aredis

        # No read timeout: redis-py 8 would otherwise give up on a read after 5 s.
        return self._per_loop(self._async, lambda: aredis.Redis(
            connection_pool=aredis.BlockingConnectionPool.from_url(
                self.url, max_connections=settings.REDIS_POOL_MAX, timeout=30,
                decode_responses=True, socket_timeout=None, socket_connect_timeout=5, health_check_interval=5,
            )
        ))

    # events
    async def publish_many(self, turn_id: str, batch: list[tuple[int, dict]]) -> None:
        batcher = self._per_loop(self._batchers, lambda: _PublishBatcher(self.aclient()))
        await batcher.publish(turn_id, batch)

    def publish_sync(self, turn_id: str, seq: int, event: dict, *, final: bool = False) -> None:
        pipe = self.sync.pipeline(transaction=False)
        pipe.xadd(_stream_key(turn_id), {"e": json.dumps(event)}, id=f"0-{seq}")
        pipe.expire(_stream_key(turn_id), settings.AAP_EVENT_RETENTION_SECONDS if final else live_stream_ttl())
        pipe.publish(_notify_channel(turn_id), json.dumps([(seq, event)]))
        pipe.execute()

    async def read_now(self, turn_id: str, after: int) -> list[tuple[int, dict]]:
        entries = await self.aclient().xrange(_stream_key(turn_id), min=f"(0-{after}", max="+", count=500)
        return [(int(entry_id.split("-")[1]), json.loads(fields["e"])) for entry_id, fields in entries]

    def watch(self, turn_id: str):
        """An async context giving a Watcher that is handed the turn's new events as published."""
        hub = self._per_loop(self._hubs, lambda: _NotifyHub(self.aclient()))
        return hub.watch(_notify_channel(turn_id))

    def read_all_sync(self, turn_id: str) -> list[tuple[int, dict]]:
        entries = self.sync.xrange(_stream_key(turn_id))
        return [(int(entry_id.split("-")[1]), json.loads(fields["e"])) for entry_id, fields in entries]

    async def last(self, turn_id: str) -> tuple[int, dict] | None:
        entries = await self.aclient().xrevrange(_stream_key(turn_id), count=1)
        return (int(entries[0][0].split("-")[1]), json.loads(entries[0][1]["e"])) if entries else None

    def last_sync(self, turn_id: str) -> tuple[int, dict] | None:
        entries = self.sync.xrevrange(_stream_key(turn_id), count=1)
        return (int(entries[0][0].split("-")[1]), json.loads(entries[0][1]["e"])) if entries else None

    # liveness
    def set_lease_sync(self, turn_id: str) -> None:
        self.sync.set(_lease_key(turn_id), "1", px=int(settings.AAP_TURN_LEASE_SECONDS * 1000))

    async def refresh_lease(self, turn_id: str) -> None:
        await self.aclient().set(_lease_key(turn_id), "1", px=int(settings.AAP_TURN_LEASE_SECONDS * 1000))

    def clear_lease_sync(self, turn_id: str) -> None:
        self.sync.delete(_lease_key(turn_id))

    def lease_alive_sync(self, turn_id: str) -> bool:
        return bool(self.sync.exists(_lease_key(turn_id)))

    # dispatch marks: a turn handed to the broker, in the broker's own Redis (they vanish together)
    def mark_dispatched_sync(self, turn_id: str, ttl: float) -> None:
        self.sync.set(_dispatch_key(turn_id), "1", px=int(ttl * 1000))

    def dispatched_sync(self, turn_id: str) -> bool:
        return bool(self.sync.exists(_dispatch_key(turn_id)))

    def clear_dispatched_sync(self, turn_id: str) -> None:
        self.sync.delete(_dispatch_key(turn_id))

    # cancel
    def request_cancel_sync(self, turn_id: str) -> None:
        pipe = self.sync.pipeline(transaction=False)
        pipe.set(_cancel_key(turn_id), "1", ex=live_stream_ttl())
        pipe.publish(CANCEL_CHANNEL, turn_id)
        pipe.execute()

    async def cancel_requested(self, turn_id: str) -> bool:
        return bool(await self.aclient().exists(_cancel_key(turn_id)))

    async def listen_cancels(self, on_cancel: Callable[[str], None]) -> None:
        """Run forever on the runtime loop: dispatch cancel signals to running turns."""
        while True:
            try:
                pubsub = self.aclient().pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    if message and message.get("type") == "message":
                        on_cancel(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarts must not kill the listener
                logger.warning("cancel listener lost Redis (%s); reconnecting", type(exc).__name__)
                await asyncio.sleep(1)

    def ping_sync(self) -> None:
        self.sync.ping()


class _MemoryLog:
    __slots__ = ("events", "waiters", "expires_at")

    def __init__(self):
        self.events: list[tuple[int, dict]] = []
        self.waiters: list[tuple[asyncio.AbstractEventLoop, Watcher]] = []
        self.expires_at: float | None = None


class MemoryEvents:
    """The embedded mode's event stream: one process, any threads, any event loops."""

    def __init__(self):
        self._logs: dict[str, _MemoryLog] = {}
        self._leases: dict[str, float] = {}
        self._dispatched: dict[str, float] = {}
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
            if log.events and log.events[-1][0] >= seq:
                raise ValueError("event ids must increase")
            log.events.append((seq, event))
            if final:
                log.expires_at = time.monotonic() + settings.AAP_EVENT_RETENTION_SECONDS
                self._prune()
            waiters = list(log.waiters)
        for loop, watcher in waiters:
            loop.call_soon_threadsafe(watcher.wake.set)

    async def publish_many(self, turn_id: str, batch: list[tuple[int, dict]]) -> None:
        for seq, event in batch:
            self.publish_sync(turn_id, seq, event)

    async def read_now(self, turn_id: str, after: int) -> list[tuple[int, dict]]:
        with self._lock:
            log = self._logs.get(turn_id)
            return [item for item in log.events if item[0] > after] if log else []

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

    async def refresh_lease(self, turn_id: str) -> None:
        self.set_lease_sync(turn_id)

    def clear_lease_sync(self, turn_id: str) -> None:
        self._leases.pop(turn_id, None)

    def lease_alive_sync(self, turn_id: str) -> bool:
        return self._leases.get(turn_id, 0) > time.monotonic()

    def mark_dispatched_sync(self, turn_id: str, ttl: float) -> None:
        self._dispatched[turn_id] = time.monotonic() + ttl

    def dispatched_sync(self, turn_id: str) -> bool:
        return self._dispatched.get(turn_id, 0) > time.monotonic()

    def clear_dispatched_sync(self, turn_id: str) -> None:
        self._dispatched.pop(turn_id, None)

    def request_cancel_sync(self, turn_id: str) -> None:
        self._cancelled.add(turn_id)
        for handler in list(self._cancel_handlers):
            handler(turn_id)

    async def cancel_requested(self, turn_id: str) -> bool:
        return turn_id in self._cancelled

    async def listen_cancels(self, on_cancel: Callable[[str], None]) -> None:
        self._cancel_handlers.append(on_cancel)
        await asyncio.Event().wait()

    def ping_sync(self) -> None:
        return None


@cache
def backend() -> RedisEvents | MemoryEvents:
    return RedisEvents(settings.REDIS_URL) if settings.REDIS_URL else MemoryEvents()


def last_seq_sync(turn_id: str) -> int:
    last = backend().last_sync(turn_id)
    return last[0] if last else 0


QUIET = None  # what follow() yields when nothing happened for a while


async def follow(turn_id: str, after: int = 0, *, quiet_seconds: float = 5.0) -> AsyncIterator[tuple[int, dict] | None]:
    """Every event of the turn after `after`, live, until its `turn_stop`.

    Yields QUIET when `quiet_seconds` pass with no event, so the caller can ping the client
    and check that the turn is still alive.
    """
    events = backend()

    async def reader_has_the_stop() -> bool:
        # e.g. an EventSource reconnecting after the end: nothing will ever come after `after`
        last = await events.last(turn_id)
        return last is not None and last[0] <= after and last[1].get("event") == "turn_stop"

    async with events.watch(turn_id) as watcher:
        if after and await reader_has_the_stop():
            return
        read = True  # the stream is read to replay, to fill a gap, and when woken without events
        while True:
            woken = watcher.wake.is_set()
            watcher.wake.clear()  # before reading: a publication during the read is not lost
            items = [] if read else watcher.take(after)
            # A wake-up without events: the hub reconnected, or the in-memory backend.
            if read or (items and items[0][0] != after + 1) or (woken and not items):
                items = await events.read_now(turn_id, after)
            read = False
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
                after = seq
                yield seq, event
                if event.get("event") == "turn_stop":
                    return
