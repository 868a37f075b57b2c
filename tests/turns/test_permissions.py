"""Untrusted server tools wait for the application's permission; a turn answering pending
calls must answer each exactly once; in process, turns run by the embedded engine."""

from __future__ import annotations

import pytest

from ..turn_checks import (
    CLIENT_TOOL,
    MODES,
    checked_turn,
    new_session,
    permission,
    text_reply,
    tool_answer,
    tool_command,
    tool_use_message,
    tools_command,
    user,
)


@pytest.mark.parametrize("mode", MODES)
def test_granted_permission_runs_the_tool_and_streams_its_result(demo, mode):
    session = new_session(demo, server_tools=[{"name": "add"}])
    ask = checked_turn(demo, session, tool_command("add", {"a": 20, "b": 22}), stream=mode)
    assert ask.stop_reason == "tool_use"
    [use] = ask.tool_calls()
    assert ask.messages == [tool_use_message((use["toolCallId"], "add", {"a": 20, "b": 22}))]

    grant = [permission(use["toolCallId"], True)]
    reply = checked_turn(demo, session, grant, stream=mode, stored=[])  # a permission is never stored
    assert reply.stop_reason == "end_turn"
    assert reply.messages == [
        {"role": "tool", "toolCallId": use["toolCallId"], "content": "42"},
        *text_reply("tool add returned: 42"),
    ]
    if mode != "none":
        assert reply.names[:2] == ["turn_start", "tool_result"]
    assert "tool_permission" not in [m["role"] for m in demo.history(session)]


@pytest.mark.parametrize("reason", [None, "", "not on a Sunday"])
def test_denied_permission_is_stored_as_tool_message(demo, reason):
    session = new_session(demo, server_tools=[{"name": "clock"}])
    [use] = checked_turn(demo, session, tool_command("clock", {})).tool_calls()
    denial = "Tool call denied: not on a Sunday" if reason else "Tool call denied"
    reply = checked_turn(demo, session, [permission(use["toolCallId"], False, reason)], stream="message", stored=[])
    assert reply.names == ["turn_start", "tool_result", "text", "turn_stop"]
    assert reply.messages == [
        {"role": "tool", "toolCallId": use["toolCallId"], "content": denial},
        *text_reply(f"tool clock returned: {denial}"),
    ]
    full = demo.history(session)
    assert {"role": "tool", "toolCallId": use["toolCallId"], "content": denial} in full
    assert "tool_permission" not in [m["role"] for m in full]


def test_application_resumes_calls_left_open_in_a_seeded_history(demo):
    """A seed ending with unanswered calls is pending like a turn that stopped with tool_use."""
    seed = [
        {"role": "system", "content": "be brief"},
        *user("do both"),
        tool_use_message(("call_seed_client", "mytool", {"x": 5}), ("call_seed_server", "add", {"a": 4, "b": 4})),
    ]
    response = demo.post(
        "/v1/sessions",
        {"agent": {"name": "echo", "tools": [{"name": "add"}]}, "messages": seed, "tools": [CLIENT_TOOL]},
    )
    assert response.status_code == 201, response.text
    session = response.json()["sessionId"]
    assert demo.history(session) == seed
    refused = demo.turn(session, text="hello")
    assert refused.status == 400 and "call_seed_client" in refused.body["error"]
    answers = [tool_answer("call_seed_client", "five"), permission("call_seed_server", True)]
    reply = checked_turn(demo, session, answers, stream="delta", stored=answers[:1])
    assert reply.messages == [
        {"role": "tool", "toolCallId": "call_seed_server", "content": "8"},
        *text_reply("tool mytool returned: five\ntool add returned: 8"),
    ]


# --- answer sets a turn refuses ------------------------------------------------------------------


@pytest.fixture
def pending(demo):
    """A session waiting on one client tool call and one untrusted server tool call."""
    session = new_session(demo, tools=[CLIENT_TOOL], server_tools=[{"name": "add"}])

    def ask():
        result = checked_turn(demo, session, tools_command(("mytool", {"x": 7}), ("add", {"a": 1, "b": 1})))
        assert result.stop_reason == "tool_use"
        return [u["toolCallId"] for u in result.tool_calls()]

    return session, ask


def answer_sets(client_id: str, server_id: str) -> list[tuple[str, list[dict], list[str]]]:
    good_tool, good_permission = tool_answer(client_id, "r"), permission(server_id, True)
    return [
        ("unknown toolCallId", [good_tool, good_permission, tool_answer("call_not_issued", "x")], ["call_not_issued"]),
        ("duplicate", [good_tool, good_tool, good_permission], [client_id]),
        ("duplicate permission", [good_tool, good_permission, permission(server_id, False)], [server_id]),
        ("user message while calls are pending", user("hello?"), [client_id, server_id]),
        ("user message beside the answers", [good_tool, good_permission, *user("and also")], [client_id, server_id]),
        ("permission for a client tool", [permission(client_id, True), good_permission], [client_id]),
        ("tool message for a server tool", [good_tool, tool_answer(server_id, "2")], [server_id]),
        ("missing answer", [good_tool], [server_id]),
    ]


@pytest.mark.parametrize("case", range(8))
def test_invalid_answer_set_is_refused_naming_the_ids(demo, pending, case):
    session, ask = pending
    client_id, server_id = ask()
    label, messages, named = answer_sets(client_id, server_id)[case]
    before = demo.history(session)
    refused = demo.turn(session, messages, stream="delta")
    assert refused.status == 400, (label, refused.status, refused.raw)
    assert refused.headers["content-type"].startswith("application/json")
    for call_id in named:
        assert call_id in refused.body["error"], (label, refused.body)
    assert demo.history(session) == before, "a refused turn must not change history"
    # the session still takes the correct answer
    reply = checked_turn(
        demo,
        session,
        [tool_answer(client_id, "r"), permission(server_id, True)],
        stored=[tool_answer(client_id, "r")],
    )
    assert reply.messages == [
        {"role": "tool", "toolCallId": server_id, "content": "2"},
        *text_reply("tool mytool returned: r\ntool add returned: 2"),
    ]


def test_tool_answers_when_nothing_is_pending_are_refused(demo):
    session = new_session(demo, tools=[CLIENT_TOOL], server_tools=[{"name": "add"}])
    checked_turn(demo, session, user("nothing pending"))
    for messages, named in [
        ([tool_answer("call_stale", "x")], "call_stale"),
        ([permission("call_stale_permission", True)], "call_stale_permission"),
    ]:
        refused = demo.turn(session, messages)
        assert refused.status == 400, refused.raw
        assert named in refused.body["error"]
    # and once calls were answered, answering them again is refused the same way
    [use] = checked_turn(demo, session, tool_command("mytool", {})).tool_calls()
    checked_turn(demo, session, [tool_answer(use["toolCallId"], "once")])
    again = demo.turn(session, [tool_answer(use["toolCallId"], "twice")])
    assert again.status == 400 and use["toolCallId"] in again.body["error"]
    assert checked_turn(demo, session, user("fine")).messages == text_reply("echo: fine")


def test_two_user_messages_in_one_turn_are_refused(demo):
    session = new_session(demo)
    refused = demo.turn(session, user("one") + user("two"))
    assert refused.status == 400
    assert refused.body["error"]
    assert demo.history(session) == []
