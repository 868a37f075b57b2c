"""Tool calls: client tools, trusted server tools run inline, unknown tools, and parallel calls
of every kind; in process, turns run by the embedded engine."""

from __future__ import annotations

import pytest

from ..turn_checks import (
    CLIENT_TOOL,
    MODES,
    assert_iso_utc_now,
    checked_turn,
    new_session,
    numbered_calls,
    permission,
    text_reply,
    tool_answer,
    tool_command,
    tool_use_message,
    tools_command,
    user,
)


@pytest.mark.parametrize("mode", MODES)
def test_client_tool_round_trip(demo, mode):
    session = new_session(demo, tools=[CLIENT_TOOL])
    call = checked_turn(demo, session, tool_command("mytool", {"x": 1}), stream=mode)
    assert call.stop_reason == "tool_use"
    [use] = call.tool_calls()
    assert use["name"] == "mytool" and use["input"] == {"x": 1} and use["toolCallId"].startswith("call_")
    if mode != "none":
        assert call.names == ["turn_start", "tool_call", "turn_stop"]
    assert call.messages == [tool_use_message((use["toolCallId"], "mytool", {"x": 1}))]
    # full history ends with the unresolved call, so an application can resume from it
    assert demo.history(session)[-1] == call.messages[0]

    reply = checked_turn(demo, session, [tool_answer(use["toolCallId"], "forty-two")], stream=mode)
    assert reply.stop_reason == "end_turn"
    assert reply.messages == text_reply("tool mytool returned: forty-two")
    assert "tool_result" not in reply.names  # client results are the application's own, not streamed back
    # the session is free again: the next user message is an ordinary turn
    assert checked_turn(demo, session, user("done")).messages == text_reply("echo: done")


def test_client_tool_result_in_blocks_is_reported_as_text(demo):
    session = new_session(demo, tools=[CLIENT_TOOL])
    [use] = checked_turn(demo, session, tool_command("mytool", {})).tool_calls()
    content = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    reply = checked_turn(demo, session, [tool_answer(use["toolCallId"], content)], stream="delta")
    assert reply.messages == text_reply("tool mytool returned: line one\nline two")


@pytest.mark.parametrize("mode", MODES)
def test_trusted_server_tool_runs_inline_in_one_turn(demo, mode):
    session = new_session(demo, server_tools=[{"name": "add", "trust": True}])
    result = checked_turn(demo, session, tool_command("add", {"a": 2, "b": 3}), stream=mode)
    assert result.stop_reason == "end_turn"
    [use] = result.tool_calls()
    assert result.messages == [
        tool_use_message((use["toolCallId"], "add", {"a": 2, "b": 3})),
        {"role": "tool", "toolCallId": use["toolCallId"], "content": "5"},
        *text_reply("tool add returned: 5"),
    ]
    if mode == "message":
        assert result.names == ["turn_start", "tool_call", "tool_result", "text", "turn_stop"]
    if mode == "delta":
        assert result.names[:3] == ["turn_start", "tool_call", "tool_result"]
        assert set(result.names[3:-1]) == {"text_delta"}


def test_trusted_clock_returns_iso_8601_utc(demo):
    session = new_session(demo, server_tools=[{"name": "clock", "trust": True}])
    result = checked_turn(demo, session, tool_command("clock", {}), stream="message")
    [tool_result] = [e.data for e in result.events if e.event == "tool_result"]
    assert_iso_utc_now(tool_result["content"])
    assert result.messages[-1] == text_reply(f"tool clock returned: {tool_result['content']}")[0]


def test_trusted_tool_with_bad_input_reports_the_problem_to_the_agent(demo):
    session = new_session(demo, server_tools=[{"name": "add", "trust": True}])
    result = checked_turn(demo, session, tool_command("add", {"a": "two", "b": 3}))
    assert result.stop_reason == "end_turn"
    content = result.messages[1]["content"]
    assert result.messages[1]["role"] == "tool" and "two" in content
    assert result.messages[2] == text_reply(f"tool add returned: {content}")[0]


@pytest.mark.parametrize("name", ["nosuch", "add"])  # add: exposed by the agent, but not enabled on this session
def test_unknown_tool_is_answered_and_the_agent_continues(demo, name):
    session = new_session(demo, tools=[CLIENT_TOOL])
    result = checked_turn(demo, session, tool_command(name, {"a": 1, "b": 1}), stream="delta")
    assert result.stop_reason == "end_turn"
    [use] = result.tool_calls()
    assert result.names[:3] == ["turn_start", "tool_call", "tool_result"]
    assert result.messages[1:] == [
        {"role": "tool", "toolCallId": use["toolCallId"], "content": f"Unknown tool: {name}"},
        *text_reply(f"tool {name} returned: Unknown tool: {name}"),
    ]


@pytest.mark.parametrize("mode", MODES)
def test_parallel_calls_of_every_kind_are_answered_in_one_turn(demo, mode):
    session = new_session(demo, tools=[CLIENT_TOOL], server_tools=[{"name": "add", "trust": True}, {"name": "clock"}])
    calls = [
        ("mytool", {"x": 1}),
        ("add", {"a": 1, "b": 2}),
        ("clock", {}),
        ("mytool", {"x": 2}),
        ("add", {"a": 5, "b": 5}),
    ]
    ask = checked_turn(demo, session, tools_command(*calls), stream=mode)
    assert ask.stop_reason == "tool_use"
    uses = ask.tool_calls()
    assert [(u["name"], u["input"]) for u in uses] == calls
    ids = [u["toolCallId"] for u in uses]
    assert len(set(ids)) == 5
    # the trusted calls ran inline; the client and untrusted calls wait for the application
    assert ask.messages == [
        tool_use_message(*[(i, name, arguments) for i, (name, arguments) in zip(ids, calls)]),
        {"role": "tool", "toolCallId": ids[1], "content": "3"},
        {"role": "tool", "toolCallId": ids[4], "content": "10"},
    ]
    if mode != "none":
        assert ask.names == ["turn_start"] + ["tool_call"] * 5 + ["tool_result"] * 2 + ["turn_stop"]

    answers = [tool_answer(ids[3], "second"), permission(ids[2], True), tool_answer(ids[0], "first")]
    reply = checked_turn(demo, session, answers, stream=mode, stored=[answers[0], answers[2]])
    assert reply.stop_reason == "end_turn"
    clock = reply.messages[0]
    assert clock["role"] == "tool" and clock["toolCallId"] == ids[2]
    assert_iso_utc_now(clock["content"])
    assert reply.messages[1:] == text_reply(
        "tool mytool returned: first\n"
        "tool add returned: 3\n"
        f"tool clock returned: {clock['content']}\n"
        "tool mytool returned: second\n"
        "tool add returned: 10"
    )


def test_tool_turns_fold_alike_in_every_mode(demo):
    """fold(delta) == fold(message) == none for a turn that calls, runs and asks for tools."""
    folded = {}
    for mode in MODES:
        session = new_session(
            demo, tools=[CLIENT_TOOL], server_tools=[{"name": "add", "trust": True}, {"name": "clock"}]
        )
        ask = checked_turn(
            demo, session, tools_command(("add", {"a": 2, "b": 2}), ("mytool", {}), ("nosuch", {})), stream=mode
        )
        ids = [u["toolCallId"] for u in ask.tool_calls()]
        reply = checked_turn(demo, session, [tool_answer(ids[1], "ok")], stream=mode)
        folded[mode] = numbered_calls(ask.messages + reply.messages)
    assert folded["delta"] == folded["message"] == folded["none"]
