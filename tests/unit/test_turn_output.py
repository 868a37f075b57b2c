"""Per-turn output bounds and the joining of tiny deltas (no Redis: the in-memory events)."""

from __future__ import annotations

import asyncio

import pytest

from sessions_app.engine import events, host
from sessions_app.engine.host import DeltaRuns, OutputBudget, TurnOutputExceeded
from sessions_app.protocol import fold


def test_joined_deltas_fold_to_the_same_messages():
    originals = [{"event": "text_delta", "delta": f"w{i} "} for i in range(3000)]
    originals += [{"event": "thinking_delta", "delta": "hm "}] * 5
    originals += [{"event": "text_delta", "delta": "tail", "_meta": {"emittedAt": 1.0}}]
    runs = DeltaRuns()
    for event in originals:
        if not runs.join(event):
            runs.append(0, event)
    joined = runs.events()
    assert len(joined) == 3  # one text run, one thinking run, and the delta with _meta alone
    assert fold(joined) == fold(originals)


def test_a_joined_run_is_cut_at_its_size_limit():
    runs = DeltaRuns()
    for _ in range(100):
        if not runs.join({"event": "text_delta", "delta": "x" * 10}, limit=100):
            runs.append(0, {"event": "text_delta", "delta": "x" * 10})
    assert [len(e["delta"]) for e in runs.events()] == [100] * 10


def test_budget_refuses_past_bytes_and_entries(settings):
    settings.AAP_TURN_MAX_OUTPUT_BYTES = 10
    settings.AAP_TURN_MAX_EVENTS = 2
    budget = OutputBudget()
    budget.add_output({"event": "text_delta", "delta": "é" * 5})  # 10 bytes: at the bound
    with pytest.raises(TurnOutputExceeded, match="limit of 10 bytes per turn"):
        budget.add_output({"event": "text_delta", "delta": "x"})
    budget = OutputBudget()
    budget.add_entry()
    budget.add_entry()
    with pytest.raises(TurnOutputExceeded, match="limit of 2 events per turn"):
        budget.add_entry()


def _plan(text: str, stream: str = "delta") -> host.TurnPlan:
    return host.TurnPlan(
        turn_id="turn_unit",
        session_id="sess_unit",
        tenant="t",
        agent_name="echo",
        runtime_kind="echo",
        config={},
        options={},
        server_tools={},
        client_tools={},
        history=[],
        incoming=[{"role": "user", "content": text}],
        permissions=[],
        stream=stream,
        capabilities={},
    )


@pytest.fixture
def memory_events(monkeypatch):
    backend = events.MemoryEvents()
    monkeypatch.setattr(events, "backend", lambda: backend)
    return backend


@pytest.mark.parametrize("stream", ["delta", "message"])
def test_a_turn_over_its_byte_bound_ends_max_tokens_with_a_sentence(settings, memory_events, stream):
    settings.AAP_TURN_MAX_OUTPUT_BYTES = 1000
    outcome = asyncio.run(host.execute(_plan("word " * 1000, stream)))
    assert outcome.stop_reason == "max_tokens"
    assert "limit of 1000 bytes per turn" in outcome.stop_meta["outputLimit"]
    assert "error" not in outcome.stop_meta
    stored = outcome.messages[0]["content"][0]["text"]
    assert stored == ("echo: " + "word " * 1000)[: len(stored)] and 990 <= len(stored) <= 1000
    # What a listener saw is what history keeps.
    published = [e for _, e in memory_events.read_all_sync("turn_unit")]
    if stream == "delta":
        assert fold(published) == outcome.messages
    else:
        assert published == [{"event": "text", "text": stored}]


def test_a_turn_over_its_event_bound_ends_max_tokens(settings, memory_events):
    settings.AAP_TURN_MAX_EVENTS = 50
    outcome = asyncio.run(
        host.execute(_plan("/tools " + str([{"name": f"t{i}"} for i in range(60)]).replace("'", '"')))
    )
    assert outcome.stop_reason == "max_tokens"
    assert "limit of 50 events per turn" in outcome.stop_meta["outputLimit"]
    assert len(memory_events.read_all_sync("turn_unit")) == 50


def test_a_turn_within_its_bounds_is_untouched(memory_events):
    outcome = asyncio.run(host.execute(_plan("hello there")))
    assert outcome.stop_reason == "end_turn" and "outputLimit" not in outcome.stop_meta
    assert [e["delta"] for _, e in memory_events.read_all_sync("turn_unit")] == ["echo: ", "hello ", "there"]


class _SlowRedis:
    """Records each write of a turn's events; a write stays in flight until `gate` is set."""

    def __init__(self):
        self.writes: list[tuple[list[tuple[int, dict]], bool]] = []
        self.gate = asyncio.Event()

    async def publish_many(self, turn_id, batch, *, expire=True):
        self.writes.append((batch, expire))
        await self.gate.wait()


def test_deltas_that_wait_behind_a_slow_write_join_and_fold_the_same(settings, monkeypatch):
    settings.AAP_TURN_COALESCE_SECONDS = 0.05
    redis = _SlowRedis()
    monkeypatch.setattr(events, "backend", lambda: redis)

    async def go():
        publisher = host._Publisher("turn_unit", "delta")
        delta = lambda text: {"event": "text_delta", "delta": text}
        await publisher.emit(delta("a"))
        await asyncio.sleep(0)  # the first write starts and hangs
        await publisher.emit(delta("b"))
        await publisher.emit(delta("c"))  # waiting, but not long yet: its own entry
        await asyncio.sleep(0.06)
        await publisher.emit(delta("d"))  # behind: joins the delta waiting last
        await publisher.emit(delta("e"))
        redis.gate.set()
        await publisher.close()
        return publisher

    publisher = asyncio.run(go())
    assert [(batch, expire) for batch, expire in redis.writes] == [
        ([(2, {"event": "text_delta", "delta": "a"})], True),
        (
            [(3, {"event": "text_delta", "delta": "b"}), (4, {"event": "text_delta", "delta": "cde"})],
            False,  # the stream's expiry is set again only every EXPIRE_EVERY_SECONDS
        ),
    ]
    assert publisher.seq == 4
    assert fold([e for batch, _ in redis.writes for _, e in batch]) == fold(publisher.produced.events())


def test_deltas_of_a_turn_whose_writes_keep_up_go_one_by_one(settings, monkeypatch):
    redis = _SlowRedis()
    redis.gate.set()
    monkeypatch.setattr(events, "backend", lambda: redis)

    async def go():
        publisher = host._Publisher("turn_unit", "delta")
        for text in "abcde":
            await publisher.emit({"event": "text_delta", "delta": text})
            await asyncio.sleep(0.01)
        await publisher.close()

    asyncio.run(go())
    assert [e["delta"] for batch, _ in redis.writes for _, e in batch] == list("abcde")


class _FlakyRedis:
    """Refuses the first `failures` writes as an unreachable Redis does, then takes them."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error = failures, error
        self.writes: list[list[tuple[int, dict]]] = []

    async def publish_many(self, turn_id, batch, *, expire=True):
        if self.failures:
            self.failures -= 1
            raise self.error
        self.writes.append(batch)


def _publish_ticks() -> host._Publisher:
    async def go():
        publisher = host._Publisher("turn_unit", "delta")
        for text in "abc":
            await publisher.emit({"event": "text_delta", "delta": text})
            await asyncio.sleep(0.01)
        await publisher.close()
        return publisher

    return asyncio.run(go())


def test_a_batch_redis_did_not_take_is_written_again_in_order(settings, monkeypatch):
    from redis.exceptions import ConnectionError

    fake = _FlakyRedis(2, ConnectionError("Connection reset by peer"))
    monkeypatch.setattr(events, "backend", lambda: fake)
    publisher = _publish_ticks()
    seqs = [seq for batch in fake.writes for seq, _ in batch]
    assert seqs == sorted(seqs) and seqs[0] == 2 and seqs[-1] == publisher.seq  # nothing dropped, in order
    assert fold([e for batch in fake.writes for _, e in batch]) == fold(publisher.produced.events())


def test_a_batch_a_full_redis_keeps_refusing_is_given_up_and_the_turn_ends(settings, monkeypatch):
    from redis.exceptions import OutOfMemoryError

    monkeypatch.setattr(host, "PUBLISH_RETRY_SECONDS", 0.3)
    fake = _FlakyRedis(10**6, OutOfMemoryError("OOM command not allowed"))
    monkeypatch.setattr(events, "backend", lambda: fake)
    publisher = _publish_ticks()  # returns: the turn's end does not wait for Redis
    assert fake.writes == []
    assert fold(publisher.produced.events()) == [{"role": "assistant", "content": [{"type": "text", "text": "abc"}]}]


def test_while_redis_stays_unreachable_later_batches_are_tried_once(settings, monkeypatch):
    """The retry bound is per outage, not per batch: once a batch is given up while Redis is
    still unreachable, each later batch is tried once, so the turn's end (stored by the
    worker after its events) waits for Redis at most one bound, however many batches."""
    from redis.exceptions import ConnectionError

    settings.AAP_STREAM_RETRY_SECONDS = 0.3
    fake = _FlakyRedis(10**6, ConnectionError("Connection refused"))
    tries: list[int] = []
    refuse = fake.publish_many

    async def counted(turn_id, batch, *, expire=True):
        tries.append(batch[0][0])
        await refuse(turn_id, batch, expire=expire)

    monkeypatch.setattr(fake, "publish_many", counted)
    monkeypatch.setattr(events, "backend", lambda: fake)
    publisher = _publish_ticks()
    assert fake.writes == []
    firsts = sorted(set(tries))
    assert len(firsts) >= 2, tries  # the events came as more than one batch
    assert tries.count(firsts[0]) > 1, tries  # the first was retried through the bound
    assert [tries.count(seq) for seq in firsts[1:]] == [1] * (len(firsts) - 1), tries
    assert fold(publisher.produced.events()) == [{"role": "assistant", "content": [{"type": "text", "text": "abc"}]}]


def test_a_cancel_requested_while_a_turn_waited_stops_it_before_its_agent_runs(memory_events):
    memory_events.request_cancel_sync("turn_unit")
    running = host.RunningTurns()
    running.expect("turn_unit")
    if memory_events.take_lease_sync("turn_unit"):
        running.cancel("turn_unit")
    outcome = asyncio.run(host.execute(_plan("hello there"), running))
    assert (outcome.stop_reason, outcome.cancelled, outcome.messages) == ("end_turn", True, [])
    assert memory_events.lease_alive_sync("turn_unit")  # the claim took its lease in the same round trip


def test_a_cancel_heard_between_the_claim_and_the_run_is_kept_for_the_turn(memory_events):
    running = host.RunningTurns()
    running.expect("turn_unit")  # claimed; the lease's read found no cancel yet
    running.cancel("turn_unit")  # the cancel signal arrives before the turn's task exists
    running.expect("turn_unit")  # expecting it again does not undo it
    outcome = asyncio.run(host.execute(_plan("hello there"), running))
    assert (outcome.stop_reason, outcome.cancelled, outcome.messages) == ("end_turn", True, [])
    # Positive control: without a cancel the same turn runs, and nothing is kept for it after.
    running.expect("turn_unit")
    outcome = asyncio.run(host.execute(_plan("hello there"), running))
    assert (outcome.stop_reason, outcome.cancelled) == ("end_turn", False)
    running.cancel("turn_unit")  # after its end: nothing is kept for a turn no longer expected
    running.expect("turn_unit")
    outcome = asyncio.run(host.execute(_plan("hello there"), running))
    assert (outcome.stop_reason, outcome.cancelled) == ("end_turn", False)
