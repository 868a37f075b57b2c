"""`GET /v1/sessions/:id/history?type=`: the type rules and what each history holds."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def session(engine):
    client = engine.client("demo")
    session = client.create_session("echo", messages=[{"role": "system", "content": "be brief"}])
    client.close()
    return session


@pytest.mark.parametrize(
    "query",
    [
        {},
        {"type": ""},
        {"type": "bogus"},
        {"type": "FULL"},
        {"type": "full,compacted"},
        {"type": "\x00"},
        {"kind": "full"},
    ],
)
def test_history_type_must_be_compacted_or_full(demo, session, query):
    response = demo.get(f"/v1/sessions/{session}/history", params=query)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "type=compacted or type=full" in response.json()["error"]


@pytest.mark.parametrize("kind", ["full", "compacted"])
def test_history_answers_the_requested_type_only(demo, session, kind):
    response = demo.get(f"/v1/sessions/{session}/history", params={"type": kind})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == {"history": {kind: [{"role": "system", "content": "be brief"}]}}


def test_new_session_without_seed_has_empty_histories(demo):
    session = demo.create_session("echo-bare")
    assert demo.history(session, "full") == []
    assert demo.history(session, "compacted") == []


def test_history_keeps_text_exactly_as_accepted(demo):
    tricky = 'quotes " and \\ backslash, tab\t, newline\n, NUL \u0000, line sep \u2028, emoji \U0001f600, ascii ~'
    messages = [
        {"role": "user", "content": tricky},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "toolCallId": "c1",
                    "name": "add",
                    "input": {"a": 1.5, "b": -0.0, "big": 12345678901234567890, "list": [True, None]},
                }
            ],
        },
        {"role": "tool", "toolCallId": "c1", "content": [{"type": "text", "text": "  padded  "}]},
    ]
    session = demo.create_session("echo", messages=messages)
    raw = demo.get(f"/v1/sessions/{session}/history", params={"type": "full"}).text
    assert json.loads(raw)["history"]["full"] == messages
    assert "12345678901234567890" in raw, "large integers are not rounded through floats"


def test_full_history_keeps_everything_while_compacted_is_what_the_agent_sees(demo):
    # echo-small keeps a compacted window of 3 messages (tests/agents.yaml).
    session = demo.create_session(
        "echo-small", messages=[{"role": "user", "content": "seed"}, {"role": "assistant", "content": "ok"}]
    )
    for text in ("one", "two", "three"):
        assert demo.turn(session, text=text).stop_reason == "end_turn"
    full = demo.history(session, "full")
    assert [m["role"] for m in full] == ["user", "assistant"] + ["user", "assistant"] * 3
    assert [m["content"] for m in full if m["role"] == "user"] == ["seed", "one", "two", "three"]
    assert full[-1] == {"role": "assistant", "content": [{"type": "text", "text": "echo: three"}]}
    compacted = demo.history(session, "compacted")
    assert compacted == full[-len(compacted) :] and len(compacted) <= 3


def test_a_long_seed_starts_compacted_history_at_the_agents_window(demo):
    """echo-small keeps 3 messages: a 12-message seed is whole in full history and its last
    3 (never opening on a cut-off tool result) in compacted history, before any turn."""
    seed = []
    for i in range(4):
        seed.append({"role": "user", "content": f"question {i}"})
        seed.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "toolCallId": f"c{i}", "name": "clock", "input": {}}],
            }
        )
        seed.append({"role": "tool", "toolCallId": f"c{i}", "content": f"t{i}"})
    session = demo.create_session("echo-small", messages=seed)
    assert demo.history(session, "full") == seed
    # the last 3 are [user q3, assistant c3, tool c3]: kept as they are
    assert demo.history(session, "compacted") == seed[-3:]
    # ending [..., tool c2, user q3, assistant c3]: the window would open on "tool c2",
    # whose call is cut off, so compacted history starts at "user q3"
    seed_orphan = seed[:-1]
    session = demo.create_session("echo-small", messages=seed_orphan)
    assert demo.history(session, "compacted") == seed_orphan[-2:]
