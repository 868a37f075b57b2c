"""Pure rules of durable turns: what a lost turn's history keeps, and when two requests
are the same for an Idempotency-Key."""

from __future__ import annotations

import json

from sessions_app.api.admission import fingerprint as request_fingerprint
from sessions_app.engine.recovery import _produced_before_loss
from sessions_app.models import Turn


def _streamed(*events):
    return list(enumerate([{"event": "turn_start"}, *events], start=1))


def test_checkpoint_beyond_the_stream_is_kept_and_its_unsent_part_published():
    # message mode: the stream has the first whole block; the worker's checkpoint also has
    # the tool call after it and the text block it was in the middle of
    checkpoint = [
        {"event": "text", "text": "looking it up"},
        {"event": "tool_call", "toolCallId": "c1", "name": "lookup", "input": {}},
        {"event": "tool_result", "toolCallId": "c1", "content": "42"},
        {"event": "text", "text": "the answer is"},
    ]
    turn = Turn(stream="message", partial=json.dumps(checkpoint))
    produced, unsent = _produced_before_loss(turn, _streamed(checkpoint[0]))
    assert unsent == checkpoint[1:]
    assert produced == [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "looking it up"},
                {"type": "tool_use", "toolCallId": "c1", "name": "lookup", "input": {}},
            ],
        },
        {"role": "tool", "toolCallId": "c1", "content": "42"},
        {"role": "assistant", "content": [{"type": "text", "text": "the answer is"}]},
    ]


def test_stream_ahead_of_the_checkpoint_wins():
    # blocks published after the last checkpoint: the stream is the later view
    checkpoint = [{"event": "text", "text": "one"}]
    streamed = _streamed({"event": "text", "text": "one"}, {"event": "text", "text": "two"})
    produced, unsent = _produced_before_loss(Turn(stream="none", partial=json.dumps(checkpoint)), streamed)
    assert unsent == []
    assert produced == [
        {"role": "assistant", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    ]


def test_delta_mode_history_is_what_was_streamed():
    streamed = _streamed({"event": "text_delta", "delta": "tick 1 "}, {"event": "text_delta", "delta": "tick 2 "})
    produced, unsent = _produced_before_loss(Turn(stream="delta", partial=""), streamed)
    assert unsent == []
    assert produced == [{"role": "assistant", "content": [{"type": "text", "text": "tick 1 tick 2 "}]}]


def test_a_checkpoint_that_disagrees_with_the_stream_is_not_used():
    checkpoint = [{"event": "text", "text": "other"}, {"event": "text", "text": "more"}]
    streamed = _streamed({"event": "text", "text": "one"})
    produced, unsent = _produced_before_loss(Turn(stream="message", partial=json.dumps(checkpoint)), streamed)
    assert unsent == []
    assert produced == [{"role": "assistant", "content": [{"type": "text", "text": "one"}]}]


def test_fingerprint_compares_requests_as_json():
    a = request_fingerprint("POST", "/v1/sessions", {"agent": {"name": "echo", "options": {"a": "1", "b": "2"}}})
    b = request_fingerprint("POST", "/v1/sessions", {"agent": {"options": {"b": "2", "a": "1"}, "name": "echo"}})
    assert a == b
    assert a != request_fingerprint("POST", "/v1/sessions", {"agent": {"name": "echo"}})
    assert a != request_fingerprint(
        "POST", "/v1/sessions/x/turns", {"agent": {"name": "echo", "options": {"a": "1", "b": "2"}}}
    )
