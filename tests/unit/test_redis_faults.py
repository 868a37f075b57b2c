"""Redis faults the API and the event writer handle instead of surfacing: a full or
unreachable Redis is a 503 with Retry-After, a stale pooled connection is retried once, and a
retried pipeline's entries that were written the first time count as written."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError, OutOfMemoryError, ReadOnlyError, ResponseError

from infra.errors import exception_handler
from infra.redis_connections import RedisConnections


@pytest.mark.parametrize(
    "error",
    [
        OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        ReadOnlyError("You can't write against a read only replica."),
        ConnectionError("Connection refused"),
    ],
)
def test_a_redis_that_cannot_take_a_write_is_a_503_with_retry_after(error):
    response = exception_handler(error, {"view": None})
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert "nothing was stored" in response.data["error"]


def test_other_redis_errors_stay_500():
    assert exception_handler(ResponseError("WRONGTYPE"), {"view": None}).status_code == 500


def test_pooled_connections_retry_once_on_a_connection_error(settings):
    import asyncio

    settings.REDIS_POOL_MAX = 4
    connections = RedisConnections("redis://127.0.0.1:1/0")
    sync = connections.sync.connection_pool.make_connection()
    assert sync.retry.get_retries() == 1
    assert ConnectionError in sync.retry._supported_errors

    async def async_connection():
        return connections.aclient().connection_pool.make_connection()

    connection = asyncio.run(async_connection())
    assert connection.retry.get_retries() == 1
    assert ConnectionError in connection.retry._supported_errors


def test_a_follower_sends_an_event_published_twice_once(monkeypatch):
    """A batch written again after Redis failed is published again: its follower may find
    both copies waiting and sends each event once, in order."""
    import asyncio
    import contextlib

    from sessions_app.engine import events
    from sessions_app.engine.events import Entries, Watcher

    start, a, b, stop = (
        {"event": "turn_start"},
        {"event": "text_delta", "delta": "a"},
        {"event": "text_delta", "delta": "b"},
        {"event": "turn_stop", "stopReason": "end_turn"},
    )

    class Republished:
        @contextlib.asynccontextmanager
        async def watch(self, turn_id):
            watcher = Watcher()
            watcher.deliver([(2, a), (3, b)])
            watcher.deliver([(2, a), (3, b), (4, stop)])  # the retried write's publication
            yield watcher

        async def read_now(self, turn_id, after, count):
            return Entries([(1, start)] if after == 0 else [])

        async def last(self, turn_id):
            return None

    monkeypatch.setattr(events, "backend", lambda: Republished())

    async def followed():
        return [item async for item in events.follow("turn_unit")]

    assert asyncio.run(followed()) == [(1, start), (2, a), (3, b), (4, stop)]


def test_a_follower_reads_a_long_stream_in_rounds_sized_by_bytes():
    """A follower replaying a stream asks for few entries at first, more while they are
    small, and few again once they are large: it holds about one round, never the turn."""
    from sessions_app.engine.events import MAX_COUNT, MIN_COUNT, ROUND_BYTES, Entries, next_count

    def read(n: int, size: int) -> Entries:
        entries = Entries([(i, {}) for i in range(n)])
        entries.size = size
        return entries

    count = MIN_COUNT
    for _ in range(10):
        count = next_count(count, read(count, count * 20))  # small entries: the rounds grow
    assert count == MAX_COUNT
    assert next_count(count, read(count, ROUND_BYTES + 1)) == MIN_COUNT  # large ones: back to few
    assert next_count(64, read(10, 1000)) == 64  # the stream's end: nothing to learn


def test_a_follower_goes_on_reading_after_a_full_round(monkeypatch):
    """A round that came back full is followed by another at once (the stream may hold more
    already, with nothing more to be published): a finished turn replays without waiting."""
    import asyncio
    import contextlib

    from sessions_app.engine import events
    from sessions_app.engine.events import Entries, Watcher

    stream = [(1, {"event": "turn_start"})]
    stream += [(i, {"event": "text_delta", "delta": "x" * 100_000}) for i in range(2, 40)]
    stream += [(40, {"event": "turn_stop", "stopReason": "end_turn"})]
    asked: list[int] = []

    class Finished:
        @contextlib.asynccontextmanager
        async def watch(self, turn_id):
            yield Watcher()  # nothing will be published: the turn is over

        async def read_now(self, turn_id, after, count):
            asked.append(count)
            entries = Entries([item for item in stream if item[0] > after][:count])
            entries.size = sum(len(e.get("delta", "")) for _, e in entries)
            return entries

        async def last(self, turn_id):
            return stream[-1]

    monkeypatch.setattr(events, "backend", lambda: Finished())

    async def followed():
        return [item async for item in events.follow("turn_unit", quiet_seconds=30)]

    assert asyncio.run(asyncio.wait_for(followed(), 5)) == stream
    assert max(asked) <= 16, asked  # large entries: small rounds


def test_a_follower_does_not_read_again_for_events_its_read_already_gave(monkeypatch):
    """Events published while the first read runs come in that read and in their
    publication: the wake-up they leave is no sign of anything missing (no second read). A
    wake-up that brings no event at all (the hub reconnected) is: the stream is read again."""
    import asyncio
    import contextlib

    from sessions_app.engine import events
    from sessions_app.engine.events import Entries, Watcher

    start, a, stop = (
        {"event": "turn_start"},
        {"event": "text_delta", "delta": "a"},
        {"event": "turn_stop", "stopReason": "end_turn"},
    )
    reads: list[int] = []

    class PublishedDuringTheRead:
        def __init__(self, reconnect: bool):
            self.reconnect = reconnect
            self.watcher = Watcher()

        @contextlib.asynccontextmanager
        async def watch(self, turn_id):
            yield self.watcher

        async def read_now(self, turn_id, after, count):
            reads.append(after)
            if after == 0:
                self.watcher.deliver([(2, a)])  # published while the read ran: the read has it too
                asyncio.get_running_loop().call_later(0.05, self.watcher.deliver, [(3, stop)])
                if self.reconnect:
                    self.watcher.wake.set()  # ... and the hub reconnected meanwhile
                    self.watcher.pushed.clear()
                return Entries([(1, start), (2, a)])
            return Entries([])

        async def last(self, turn_id):
            return None

    async def followed(backend):
        monkeypatch.setattr(events, "backend", lambda: backend)
        return [item async for item in events.follow("turn_unit", quiet_seconds=30)]

    assert asyncio.run(asyncio.wait_for(followed(PublishedDuringTheRead(False)), 5)) == [(1, start), (2, a), (3, stop)]
    assert reads == [0]
    reads.clear()
    assert asyncio.run(asyncio.wait_for(followed(PublishedDuringTheRead(True)), 5)) == [(1, start), (2, a), (3, stop)]
    assert reads == [0, 2]  # positive control: a wake-up without events reads again


# --- a stream whose Redis stays down: past the retry window PostgreSQL says how it ends ---


@pytest.fixture
def redis_down(monkeypatch, settings):
    """The event source fails as an unreachable Redis does, for good; the retry window and
    the liveness interval are zero, so PostgreSQL is asked at once and on every retry.
    Returns what the turn's checks answer, in order (True: over; an exception: raised)."""
    from sessions_app.engine import stream

    async def unreachable(*args, **kwargs):
        raise ConnectionError("Connection refused")
        yield  # an async generator, as events.follow is

    answers: list = []

    async def recover(turn_id):
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(stream.events, "follow", unreachable)
    monkeypatch.setattr(stream, "_recover", recover)
    monkeypatch.setattr(stream, "LIVENESS_CHECK_SECONDS", 0.0)
    settings.AAP_STREAM_RETRY_SECONDS = 0.0
    settings.AAP_SSE_PING_SECONDS = 0.0
    return answers


async def _collect(body) -> list:
    return [item async for item in body]


def test_a_none_answer_waits_for_the_turn_in_postgresql_while_redis_is_down(redis_down, monkeypatch):
    """Not blanks and a closed connection: the stored turn, once PostgreSQL has it."""
    import asyncio
    import json

    from sessions_app.engine import stream

    stored = {"stopReason": "end_turn", "messages": [], "_meta": {"turnId": "turn_unit"}}

    async def result(turn_id):  # turn_result: None until the turn is over
        return stored if redis_down == [True] else None

    monkeypatch.setattr(stream, "_stored_result", result)
    redis_down.extend([False, False, False, True])  # running for three checks, then over
    chunks = asyncio.run(_collect(stream.json_result("turn_unit")))
    assert json.loads(b"".join(chunks)) == stored
    assert redis_down == [True]  # it asked until the turn was over


def test_a_stream_ends_from_history_once_its_turn_is_over_while_redis_is_down(redis_down):
    import asyncio

    from sessions_app.engine import stream

    redis_down.extend([False, True])
    items = asyncio.run(_collect(stream._follow("turn_unit", 0)))
    assert items[-1] is stream.ENDED
    assert all(item is stream.events.QUIET for item in items[:-1])  # pings meanwhile


def test_a_stream_closes_when_postgresql_is_unreachable_too(redis_down):
    import asyncio

    import psycopg

    from sessions_app.engine import stream

    redis_down.append(psycopg.OperationalError("connection refused"))
    with pytest.raises(stream.StreamInterrupted):
        asyncio.run(_collect(stream._follow("turn_unit", 0)))
