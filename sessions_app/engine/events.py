"""A turn's live events, its liveness lease and its cancel signal.

With REDIS_URL the events of a turn are a Redis stream (`aap:ev:<turn>`) written by the
worker and read by any web process: entries keep the event's sequence number as their id
(`0-<seq>`), so a reader that starts late still gets every event from the first, in order,
once each, and `Last-Event-ID` re-attaches exactly. Without REDIS_URL (embedded mode) the
same interface is served from memory inside the web process.

Redis carries only what can be lost: a lost stream breaks a live view of a turn, never the
session or its history, which live in PostgreSQL.

With Redis, every write to a turn's stream goes through one Lua script (`_APPEND`), so it is
refused, as a whole, once the stream has ended: the `turn_stop` that ends it sets the turn's
end fence in the same script. A worker that was frozen past its lease and declared lost
cannot write after the ending its turn's clients were told (docs/api.md, "Guarantees").
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
from typing import TYPE_CHECKING

from django.conf import settings

from infra import redis_connections
from infra.redis_connections import RedisConnections

if TYPE_CHECKING:
    from redis.typing import StreamEntry

__all__ = ["QUIET", "StreamEnded", "Watcher", "backend", "follow", "last_seq_sync", "unreachable"]

logger = logging.getLogger(__name__)


# --- what both backends (memory and Redis, below) are built from: a read of a turn's stream
# (its (seq, event) pairs and how many bytes they came as), what a follower waits on, and the
# end of a stream ---


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


# --- the embedded mode's backend: the same interface as RedisEvents, inside one process ---


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


# --- the production backend: Redis streams, pub/sub notifications, leases, cancel flags; the
# keys and channels of a turn's live events, end fence, lease and cancel flag ---

CANCEL_CHANNEL = "aap:cancel"


def live_stream_ttl() -> int:
    """How long a running turn's stream (and its cancel flag) is kept: longer than any turn."""
    return settings.AAP_LIVE_EVENTS_TTL_SECONDS


def stream_key(turn_id: str) -> str:
    return f"aap:ev:{turn_id}"


def ended_key(turn_id: str) -> str:
    """Set with a turn's `turn_stop`: its stream takes no event after that (the fence)."""
    return f"aap:end:{turn_id}"


def lease_key(turn_id: str) -> str:
    return f"aap:lease:{turn_id}"


def cancel_key(turn_id: str) -> str:
    return f"aap:cancel:{turn_id}"


def notify_channel(turn_id: str) -> str:
    return f"aap:evn:{turn_id}"


# KEYS: the stream, its end fence, the turn's lease. ARGV: the notify channel, the stream's
# expiry in seconds (0: leave it), 1 if this write ends the stream, the publication, then
# (entry id, event) pairs. An entry there already (a write retried after its connection
# failed may have been applied) is skipped. Returns 0, writing nothing, if the stream ended.
# The ending (one event) is never skipped: when its id is taken (a worker's event written
# between the caller reading the last id and this write), it goes after the last entry, and
# its publication says so.
_APPEND = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local publication = ARGV[4]
local first_id = ARGV[5]
if ARGV[3] == '1' then
  local seq = tonumber(string.sub(ARGV[5], 3))
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #last > 0 then
    local n = tonumber(string.match(last[1][1], '%-(%d+)$'))
    if n >= seq then seq = n + 1 end
  end
  first_id = '0-' .. seq
  publication = '[[' .. seq .. ',' .. ARGV[6] .. ']]'
end
for i = 5, #ARGV, 2 do
  local id = ARGV[i]
  if i == 5 then id = first_id end
  local added = redis.pcall('XADD', KEYS[1], id, 'e', ARGV[i + 1])
  if type(added) == 'table' and added.err and not string.find(added.err, 'equal or smaller', 1, true) then
    return added
  end
end
redis.call('PUBLISH', ARGV[1], publication)
if ARGV[2] ~= '0' then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
if ARGV[3] == '1' then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
  redis.call('DEL', KEYS[3])
end
return 1
"""


def _append_args(turn_id: str, encoded: list[tuple[int, str]], expire: int, final: bool) -> list:
    """EVAL's arguments for `_APPEND`: `encoded` holds (seq, event as JSON) pairs; an ending
    (`final`) is one event."""
    if final and len(encoded) != 1:
        raise ValueError("an ending is written alone")
    publication = "[" + ",".join(f"[{seq},{text}]" for seq, text in encoded) + "]"
    args: list = [_APPEND, 3, stream_key(turn_id), ended_key(turn_id), lease_key(turn_id)]
    args += [notify_channel(turn_id), expire, int(final), publication]
    for seq, text in encoded:
        args += [f"0-{seq}", text]
    return args


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
        # (two coroutines reading one connection break each other's reads). `ready` is set
        # with the reader.
        if self.reader is None or self.reader.done() or self.ready is None:
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
            except Exception:  # the listener's boundary: redis-py reconnects and resubscribes on the next call
                logger.warning("event notifications lost Redis; reconnecting", exc_info=True)
                for followers in self.wakers.values():
                    for wake in followers:
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
    Redis round trip, whatever the number of turns publishing, so a worker's round trips do
    not multiply with the turns it streams. A caller waits until
    its events are written, so each turn's events stay in order."""

    def __init__(self, client):
        self.client = client
        self.pending: list[tuple[str, list[tuple[int, dict]], bool, asyncio.Future]] = []
        self.writer: asyncio.Task | None = None

    async def publish(self, turn_id: str, batch: list[tuple[int, dict]], expire: bool) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.pending.append((turn_id, batch, expire, done))
        if self.writer is None or self.writer.done():
            self.writer = loop.create_task(self._write())
        await done

    async def _write(self) -> None:
        while self.pending:  # what arrives during a round trip goes in the next pipeline
            work, self.pending = self.pending, []
            pipe = self.client.pipeline(transaction=False)
            for turn_id, batch, expire, _ in work:
                encoded = [(seq, json.dumps(event)) for seq, event in batch]
                # EVAL, not EVALSHA: Redis caches the script, and no round trip checks for it.
                pipe.execute_command("EVAL", *_append_args(turn_id, encoded, live_stream_ttl() if expire else 0, False))
            try:
                results = await pipe.execute(raise_on_error=False)
            except Exception as exc:  # the connection failed: every caller of this round learns it
                for *_, done in work:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for (turn_id, *_, done), result in zip(work, results):
                if done.done():
                    continue  # its caller was cancelled meanwhile
                if isinstance(result, Exception):
                    done.set_exception(result)
                elif not result:
                    done.set_exception(StreamEnded(turn_id))
                else:
                    done.set_result(None)


def _stored(entry: StreamEntry) -> tuple[int, dict]:
    """A stream entry as (seq, event). Both clients decode responses
    (infra/redis_connections.py), and an XRANGE entry always has its fields."""
    entry_id, fields = entry
    if not isinstance(entry_id, str) or fields is None:
        raise TypeError(f"unexpected stream entry {entry!r}: the client must decode responses")
    return int(entry_id.split("-")[1]), json.loads(fields["e"])


class RedisEvents:
    def __init__(self, connections: RedisConnections):
        self.connections = connections
        self.sync = connections.sync
        self._hubs: dict[asyncio.AbstractEventLoop, _NotifyHub] = {}
        self._batchers: dict[asyncio.AbstractEventLoop, _PublishBatcher] = {}

    def _per_loop(self, registry: dict, make):
        return self.connections.per_loop(registry, make)

    def aclient(self):
        """The asyncio client of the running loop (redis-py asyncio clients are per loop)."""
        return self.connections.aclient()

    # events
    async def publish_many(self, turn_id: str, batch: list[tuple[int, dict]], *, expire: bool = True) -> None:
        """`expire`: set the stream's expiry again with these events (a stream recreated after
        a Redis restart has none; the publisher asks for it now and then, not every batch)."""
        batcher = self._per_loop(self._batchers, lambda: _PublishBatcher(self.aclient()))
        await batcher.publish(turn_id, batch, expire)

    def publish_sync(self, turn_id: str, seq: int, event: dict, *, final: bool = False) -> None:
        """Write one event; `final` (a `turn_stop`) ends the stream: it keeps the events for
        AAP_EVENT_RETENTION_SECONDS and takes no more, and goes after the last event if `seq`
        is taken (it is never dropped). Raises StreamEnded if it had ended."""
        expire = settings.AAP_EVENT_RETENTION_SECONDS if final else live_stream_ttl()
        if not self.sync.execute_command("EVAL", *_append_args(turn_id, [(seq, json.dumps(event))], expire, final)):
            raise StreamEnded(turn_id)

    async def read_now(self, turn_id: str, after: int, count: int = 500) -> Entries:
        entries = await self.aclient().xrange(stream_key(turn_id), min=f"(0-{after}", max="+", count=count)
        read = Entries((int(entry_id.split("-")[1]), json.loads(fields["e"])) for entry_id, fields in entries)
        read.size = sum(len(fields["e"]) for _, fields in entries)
        return read

    def watch(self, turn_id: str):
        """An async context giving a Watcher that is handed the turn's new events as published."""
        hub = self._per_loop(self._hubs, lambda: _NotifyHub(self.aclient()))
        return hub.watch(notify_channel(turn_id))

    def read_all_sync(self, turn_id: str) -> list[tuple[int, dict]]:
        return [_stored(entry) for entry in self.sync.xrange(stream_key(turn_id)) or ()]

    async def last(self, turn_id: str) -> tuple[int, dict] | None:
        entries = await self.aclient().xrevrange(stream_key(turn_id), count=1)
        return _stored(entries[0]) if entries else None

    def last_sync(self, turn_id: str) -> tuple[int, dict] | None:
        entries = self.sync.xrevrange(stream_key(turn_id), count=1)
        return _stored(entries[0]) if entries else None

    # liveness
    def take_lease_sync(self, turn_id: str) -> bool:
        """A claimed turn's lease, set in the round trip that reads whether a cancel was
        requested while it waited (then it must not run)."""
        pipe = self.sync.pipeline(transaction=False)
        pipe.set(lease_key(turn_id), "1", px=int(settings.AAP_TURN_LEASE_SECONDS * 1000))
        pipe.exists(cancel_key(turn_id))
        return bool(pipe.execute()[1])

    def refresh_leases_sync(self, turn_ids: list[str]) -> None:
        pipe = self.sync.pipeline(transaction=False)
        for turn_id in turn_ids:
            pipe.set(lease_key(turn_id), "1", px=int(settings.AAP_TURN_LEASE_SECONDS * 1000))
        pipe.execute()

    def clear_lease_sync(self, turn_id: str) -> None:
        self.sync.delete(lease_key(turn_id))

    def lease_alive_sync(self, turn_id: str) -> bool:
        return bool(self.sync.exists(lease_key(turn_id)))

    # cancel
    def request_cancel_sync(self, turn_id: str) -> None:
        pipe = self.sync.pipeline(transaction=False)
        pipe.set(cancel_key(turn_id), "1", ex=live_stream_ttl())
        pipe.publish(CANCEL_CHANNEL, turn_id)
        pipe.execute()

    async def listen_cancels(self, on_cancel: Callable[[str], None]) -> None:
        """Until cancelled, on the runtime loop: dispatch cancel signals to `on_cancel` (a
        worker's running turns)."""
        while True:
            pubsub = self.aclient().pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    if message and message.get("type") == "message":
                        on_cancel(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception:  # the listener's boundary: Redis restarts must not kill it
                logger.warning("cancel listener lost Redis; reconnecting", exc_info=True)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):  # its connection goes back, or is discarded
                    await pubsub.aclose()


# --- what the web and the engine call ---


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
        count = MIN_COUNT  # entries per read, grown while they are small (next_count)
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
