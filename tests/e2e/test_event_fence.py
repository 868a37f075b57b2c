"""The end fence of a turn's stream, against the suite's Redis: once `turn_stop` is written the
stream takes nothing more, from the batched writer or the one-event writer; a write retried
after its connection failed is taken as written; the memory backend behaves the same."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from infra.redis_connections import RedisConnections
from sessions_app.engine.events import MemoryEvents, RedisEvents, StreamEnded

START = {"event": "turn_start"}
DELTA = {"event": "text_delta", "delta": "a"}
STOP = {"event": "turn_stop", "stopReason": "error"}


@pytest.fixture
def redis_events(settings):
    settings.REDIS_POOL_MAX = 4
    connections = RedisConnections(os.environ["REDIS_URL"])
    yield RedisEvents(connections)
    connections.sync.close()


def test_nothing_is_written_after_turn_stop(redis_events):
    turn = f"fence-{uuid.uuid4().hex}"
    redis_events.publish_sync(turn, 1, START)
    asyncio.run(redis_events.publish_many(turn, [(2, DELTA)]))
    redis_events.take_lease_sync(turn)
    redis_events.publish_sync(turn, 3, STOP, final=True)
    assert not redis_events.lease_alive_sync(turn)  # the ending clears the lease

    # A frozen worker wakes: its batch and its own ending are both refused.
    with pytest.raises(StreamEnded):
        asyncio.run(redis_events.publish_many(turn, [(4, DELTA), (5, DELTA)]))
    with pytest.raises(StreamEnded):
        redis_events.publish_sync(turn, 4, {"event": "turn_stop", "stopReason": "end_turn"}, final=True)
    assert redis_events.read_all_sync(turn) == [(1, START), (2, DELTA), (3, STOP)]

    # Control: another turn's stream, not ended, takes the same writes.
    other = f"fence-{uuid.uuid4().hex}"
    asyncio.run(redis_events.publish_many(other, [(4, DELTA), (5, DELTA)]))
    assert [seq for seq, _ in redis_events.read_all_sync(other)] == [4, 5]


def test_a_batch_written_twice_is_kept_once(redis_events):
    turn = f"fence-{uuid.uuid4().hex}"
    asyncio.run(redis_events.publish_many(turn, [(1, START), (2, DELTA)]))
    asyncio.run(redis_events.publish_many(turn, [(1, START), (2, DELTA), (3, DELTA)]))  # a retry, and more
    assert redis_events.read_all_sync(turn) == [(1, START), (2, DELTA), (3, DELTA)]


def test_a_refused_write_is_an_error_not_a_silent_drop(redis_events):
    turn = f"fence-{uuid.uuid4().hex}"
    redis_events.sync.set(f"aap:ev:{turn}", "not a stream")
    with pytest.raises(Exception, match="WRONGTYPE"):
        asyncio.run(redis_events.publish_many(turn, [(1, START)]))
    redis_events.sync.delete(f"aap:ev:{turn}")


def test_the_memory_backend_fences_the_same_way(settings):
    memory = MemoryEvents()
    memory.publish_sync("t", 1, START)
    memory.publish_sync("t", 2, STOP, final=True)
    with pytest.raises(StreamEnded):
        asyncio.run(memory.publish_many("t", [(3, DELTA)]))
    assert memory.read_all_sync("t") == [(1, START), (2, STOP)]


def test_an_ending_whose_id_was_taken_meanwhile_goes_last(redis_events):
    """Another process ends a turn (a delete, a cancel) from the last id it read, while the
    worker writes its next event: the ending is written after that event, never dropped, and
    followers are told its real id."""
    turn = f"fence-{uuid.uuid4().hex}"
    asyncio.run(redis_events.publish_many(turn, [(1, START), (2, DELTA)]))
    told: list = []

    async def follow():
        async with redis_events.watch(turn) as watcher:
            redis_events.publish_sync(turn, 2, STOP, final=True)  # id 2 was taken meanwhile
            await asyncio.wait_for(watcher.wake.wait(), 5)
            told.extend(watcher.take(0))

    asyncio.run(follow())
    assert redis_events.read_all_sync(turn) == [(1, START), (2, DELTA), (3, STOP)]
    assert told == [(3, STOP)]
    with pytest.raises(StreamEnded):
        asyncio.run(redis_events.publish_many(turn, [(3, DELTA)]))

    # Control: an ending at a free id is written there.
    other = f"fence-{uuid.uuid4().hex}"
    redis_events.publish_sync(other, 1, START)
    redis_events.publish_sync(other, 2, STOP, final=True)
    assert redis_events.read_all_sync(other) == [(1, START), (2, STOP)]


def test_the_memory_backend_puts_a_late_ending_last(settings):
    memory = MemoryEvents()
    memory.publish_sync("t", 1, START)
    memory.publish_sync("t", 2, DELTA)
    memory.publish_sync("t", 2, STOP, final=True)
    assert memory.read_all_sync("t") == [(1, START), (2, DELTA), (3, STOP)]
    with pytest.raises(StreamEnded):
        memory.publish_sync("t", 4, DELTA)
    # Control: an event that is not an ending still needs an id of its own.
    memory.publish_sync("u", 1, START)
    with pytest.raises(ValueError):
        memory.publish_sync("u", 1, DELTA)
