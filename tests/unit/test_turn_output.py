"""Per-turn output bounds and the joining of tiny deltas (no Redis: the in-memory events)."""

from __future__ import annotations

import asyncio

import pytest

from sessions_app import events, host
from sessions_app.protocol import fold
from sessions_app.turn_output import DeltaRuns, OutputBudget, TurnOutputExceeded


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
