"""A turn's stream starts from events watched since before the turn existed: the hand-off
chooses the id of the turn a request starts and watches it before the view runs, so the
stream never reads back what was published (stream.TurnStreamHandoff, events.follow)."""

from __future__ import annotations

import pytest

from sessions_app.engine import events

from ..support import parse_sse
from ..turn_checks import text_reply


@pytest.fixture
def reads(monkeypatch):
    """The turns whose streams were read back (the in-memory backend the service uses here)."""
    backend = events.backend()
    read_turns: list[str] = []
    original = backend.read_now

    async def counted(turn_id, after, count=500):
        read_turns.append(turn_id)
        return await original(turn_id, after, count)

    monkeypatch.setattr(backend, "read_now", counted)
    return read_turns


@pytest.mark.parametrize("mode", ["delta", "message", "none"])
def test_a_turn_started_on_v1_is_streamed_with_no_read(demo, reads, mode):
    session = demo.create_session("echo")
    result = demo.turn(session, text="hello there", stream=mode)
    assert result.status == 200, result.raw
    assert result.messages == text_reply("echo: hello there")
    assert result.turn_id not in reads
    # Positive control: re-attaching to the same turn reads its stream back.
    again = demo.reattach(session, result.turn_id)
    assert again.messages == result.messages
    assert result.turn_id in reads


def test_turns_started_on_v2_are_streamed_with_no_read(engine, reads):
    v2 = engine.client("demo")
    headers = {"Accept": "text/event-stream"}
    created = v2.http.put(
        "/v2/session",
        json={"agent": {"name": "echo"}, "stream": "delta", "messages": [{"role": "user", "content": "one"}]},
        headers=headers,
    )
    assert created.status_code == 200, created.text
    first = created.headers["AAP-Turn-Id"]
    started, _ = parse_sse(created.content)
    session = started[0].data["sessionId"]  # session_start
    sent = v2.http.post(
        f"/v2/session/{session}",
        json={"stream": "delta", "messages": [{"role": "user", "content": "two"}]},
        headers=headers,
    )
    assert sent.status_code == 200, sent.text
    assert "echo: " in created.text and "two" in sent.text
    assert first not in reads and sent.headers["AAP-Turn-Id"] not in reads


def test_a_replayed_request_streams_the_turn_it_started_before(demo, reads):
    session = demo.create_session("echo")
    key = {"Idempotency-Key": "stream-start-replay"}
    payload = {"messages": [{"role": "user", "content": "once"}], "stream": "delta"}
    first = demo.http.post(f"/v1/sessions/{session}/turns", json=payload, headers=key)
    again = demo.http.post(f"/v1/sessions/{session}/turns", json=payload, headers=key)
    assert first.status_code == again.status_code == 200, again.text
    assert again.headers["AAP-Turn-Id"] == first.headers["AAP-Turn-Id"]
    assert again.text == first.text  # the replay's stream is the turn it started: read back whole
    assert reads == [first.headers["AAP-Turn-Id"]]
