"""The production event backend: Redis streams, pub/sub notifications, leases, cancel flags.

Every write to a turn's stream goes through one Lua script (`_APPEND`), so it is refused, as a
whole, once the stream has ended: the `turn_stop` that ends it sets the turn's end fence in the
same script. A worker that was frozen past its lease and declared lost cannot write after the
ending its turn's clients were told (docs/api.md, "Guarantees")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.conf import settings

from infra.redis_connections import RedisConnections

from .base import Entries, StreamEnded, Watcher

if TYPE_CHECKING:
    from redis.typing import StreamEntry

logger = logging.getLogger(__name__)

# --- the Redis keys and channels of a turn's live events, end fence, lease, dispatch mark and
# cancel flag ---

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
