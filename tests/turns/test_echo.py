"""Every echo command in the three stream modes, the fold invariant, SSE details and the
compacted history window; in process, turns run by the embedded engine."""

from __future__ import annotations

import hashlib

import pytest

from ..turn_checks import (
    assert_deltas,
    assert_sse_shape,
    checked_turn,
    deltas,
    new_session,
    same_turn_in_every_mode,
    text_reply,
    user,
)

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_plain_message_is_echoed_word_by_word(demo):
    session = demo.create_session("echo")
    results = same_turn_in_every_mode(demo, session, user("hello  there world"))
    assert results["none"].messages == text_reply("echo: hello  there world")
    assert results["none"].stop_reason == "end_turn"
    # one text_delta per word, each keeping its following whitespace
    assert_deltas(results["delta"], ["echo: ", "hello  ", "there ", "world"])
    assert results["message"].names == ["turn_start", "text", "turn_stop"]


def test_style_upper_uppercases_the_text(demo):
    session = new_session(demo, "echo", options={"style": "upper"})
    results = same_turn_in_every_mode(demo, session, user("Hello there"))
    assert results["none"].messages == text_reply("echo: HELLO THERE")
    assert_deltas(results["delta"], ["echo: ", "HELLO ", "THERE"])


def test_signature_is_appended(demo):
    session = new_session(demo, "echo", options={"signature": "Ada L."})
    results = same_turn_in_every_mode(demo, session, user("hi"))
    assert results["none"].messages == text_reply("echo: hi -- Ada L.")
    assert "".join(deltas(results["delta"])) == "echo: hi -- Ada L."


def test_image_blocks_are_counted_for_https_and_data_urls(demo):
    session = new_session(demo, "echo", options={"style": "upper", "signature": "S"})
    content = [
        {"type": "text", "text": "look"},
        {"type": "image", "url": "https://example.com/cat.png"},
        {"type": "text", "text": "here"},
        {"type": "image", "url": PNG},
    ]
    results = same_turn_in_every_mode(demo, session, user(content))
    # text blocks join with a newline; the incoming blocks are stored byte-for-byte
    assert results["none"].messages == text_reply("echo: LOOK\nHERE [images: 2] -- S")
    assert demo.history(session)[0] == {"role": "user", "content": content}


def test_think_streams_a_thinking_part_then_the_reply(demo):
    session = demo.create_session("echo")
    results = same_turn_in_every_mode(demo, session, user("/think about cats"))
    assert results["none"].messages == [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "thinking about: about cats"},
                {"type": "text", "text": "echo: about cats"},
            ],
        }
    ]
    assert_deltas(results["delta"], ["thinking ", "about: ", "about ", "cats"], "thinking")
    assert results["delta"].names[1:4] == ["thinking_delta"] * 3
    assert results["message"].names == ["turn_start", "thinking", "text", "turn_stop"]


def test_refuse_stops_with_refusal_and_no_content(demo):
    session = demo.create_session("echo")
    results = same_turn_in_every_mode(demo, session, user("/refuse"))
    for result in results.values():
        assert result.stop_reason == "refusal"
        assert result.messages == []
    assert results["delta"].names == results["message"].names == ["turn_start", "turn_stop"]


def test_max_stops_with_max_tokens_after_truncated_text(demo):
    session = demo.create_session("echo")
    results = same_turn_in_every_mode(demo, session, user("/max"))
    assert results["none"].stop_reason == "max_tokens"
    assert results["none"].messages == text_reply("echo: truncated")
    assert_deltas(results["delta"], ["echo: ", "truncated"])


def test_slow_ticks_are_one_delta_each_and_one_text_in_message_mode(demo):
    session = demo.create_session("echo")
    results = same_turn_in_every_mode(demo, session, user("/slow 4 50"))
    assert results["none"].messages == text_reply("tick 1 tick 2 tick 3 tick 4 ")
    assert_deltas(results["delta"], ["tick 1 ", "tick 2 ", "tick 3 ", "tick 4 "])
    assert results["message"].names == ["turn_start", "text", "turn_stop"]


def test_whoami_reports_options_without_revealing_the_secret(demo):
    session = new_session(demo, "echo", options={"signature": "me", "apiKey": "sk-whoami-1"})
    results = same_turn_in_every_mode(demo, session, user("/whoami"))
    digest = hashlib.sha256(b"sk-whoami-1").hexdigest()[:8]
    assert results["none"].messages == text_reply(f"style=plain signature=me apiKey={digest}")
    for result in results.values():
        assert b"sk-whoami-1" not in result.raw
    unset = demo.create_session("echo")
    assert demo.turn(unset, text="/whoami").messages == text_reply("style=plain signature= apiKey=unset")


def test_error_ends_the_turn_and_leaves_the_session_usable(demo):
    session = demo.create_session("echo")
    results = same_turn_in_every_mode(demo, session, user("/error"))
    for result in results.values():
        assert result.stop_reason == "error"
        assert result.messages == []
    assert results["delta"].names == ["turn_start", "turn_stop"]
    # the incoming messages stayed (checked_turn), and the session takes the next turn
    after = checked_turn(demo, session, user("still here"))
    assert after.messages == text_reply("echo: still here")
    assert [m["content"] for m in demo.history(session) if m["role"] == "user"] == ["/error"] * 3 + ["still here"]


def test_sse_events_carry_increasing_ids_and_the_turn_id(demo):
    session = demo.create_session("echo")
    for mode in ("delta", "message"):
        result = demo.turn(session, text="/think ids please", stream=mode)
        assert result.status == 200
        assert result.headers["content-type"].startswith("text/event-stream")
        assert_sse_shape(result.events, result.turn_id)
        assert result.events[-1].data == {"stopReason": "end_turn"}


@pytest.mark.parametrize("mode", ["delta", "message"])
def test_quiet_turn_keeps_the_stream_alive_with_pings(demo, mode):
    session = demo.create_session("echo")
    # Two seconds without an event, twice the tier's AAP_SSE_PING_SECONDS.
    result = demo.turn(session, text="/slow 2 2000", stream=mode)
    assert result.status == 200
    assert result.pings >= 1, result.raw
    assert b": ping\n\n" in result.raw
    assert_sse_shape(result.events, result.turn_id)
    assert result.messages == text_reply("tick 1 tick 2 ")


def test_compacted_history_keeps_the_last_window_messages(demo):
    session = demo.create_session("echo-small")
    checked_turn(demo, session, user("one"))
    assert demo.history(session, "compacted") == demo.history(session)
    checked_turn(demo, session, user("two"))
    checked_turn(demo, session, user("three"), stream="delta")
    full = demo.history(session)
    assert [m["role"] for m in full] == ["user", "assistant"] * 3
    assert [m["content"] for m in full if m["role"] == "user"] == ["one", "two", "three"]
    assert demo.history(session, "compacted") == full[-3:]


def test_compacted_history_never_opens_on_a_cut_off_tool_result(demo):
    session = new_session(demo, "echo-small", server_tools=[{"name": "clock", "trust": True}])
    checked_turn(demo, session, user("first"))
    result = checked_turn(
        demo,
        session,
        user('/tools [{"name": "clock", "input": {}}, {"name": "clock", "input": {}}]'),
        stream="message",
    )
    full = demo.history(session)
    # user, assistant; user, assistant(2 tool_use), tool, tool, assistant(reply)
    assert [m["role"] for m in full] == ["user", "assistant", "user", "assistant", "tool", "tool", "assistant"]
    assert full[2:] == user('/tools [{"name": "clock", "input": {}}, {"name": "clock", "input": {}}]') + result.messages
    # the last 3 are tool, tool, reply: both tool results lost their call, so only the reply stays
    assert demo.history(session, "compacted") == full[-1:]
    checked_turn(demo, session, user("after"))
    assert demo.history(session, "compacted") == demo.history(session)[-3:]
