"""The request rules of sessions and turns, on an in-memory agent definition: no database."""

from __future__ import annotations

import pytest

from agents.selectors import AgentDefinition, OptionDefinition
from hosting import crypto
from hosting.service_errors import BadRequest
from sessions_app.services.validation import (
    answers_for_pending,
    check_images,
    check_stream,
    effective_options,
    merge_options,
    redacted_options,
    validate_client_tools,
    validate_server_tools,
)

CLOCK = {"name": "clock", "description": "Current UTC time.", "parameters": {"type": "object"}}


def definition(**capabilities) -> AgentDefinition:
    return AgentDefinition(
        pk=1,
        name="probe",
        enabled=True,
        runtime_kind="echo",
        runtime_config={},
        capability_map={"stream": {"delta": {}, "none": {}}, **capabilities},
        options=(
            OptionDefinition("style", "select", ("plain", "loud"), "plain"),
            OptionDefinition("apiKey", "secret", (), crypto.encrypt("sk-default")),
            OptionDefinition("signature", "text", (), ""),
        ),
        server_tools=(),
        tool_specs=(CLOCK,),
        updated_at=None,
    )


# --- options ----------------------------------------------------------------------------------


def test_options_merge_over_the_stored_ones_and_secrets_are_encrypted():
    merged = merge_options(definition(), {"signature": "old"}, {"style": "loud", "apiKey": "sk-mine"})
    assert merged["style"] == "loud" and merged["signature"] == "old"
    assert merged["apiKey"] != "sk-mine" and crypto.decrypt(merged["apiKey"]) == "sk-mine"
    assert effective_options(definition(), merged) == {"style": "loud", "apiKey": "sk-mine", "signature": "old"}
    assert redacted_options(definition(), merged)["apiKey"] == crypto.REDACTED


def test_the_advertised_default_and_the_redacted_placeholder_keep_the_default():
    assert merge_options(definition(), {"style": "loud"}, {"style": "plain"}) == {}
    assert merge_options(definition(), {}, {"apiKey": crypto.REDACTED}) == {}
    assert effective_options(definition(), {})["apiKey"] == "sk-default"


@pytest.mark.parametrize(
    "incoming,sentence",
    [
        ({"colour": "red"}, "Unknown option 'colour' for agent 'probe'; its options are: style, apiKey, signature."),
        ({"style": "quiet"}, "Option 'style' must be one of: plain, loud (got 'quiet')."),
    ],
)
def test_bad_options_are_refused_with_a_sentence(incoming, sentence):
    with pytest.raises(BadRequest) as refused:
        merge_options(definition(), {}, incoming)
    assert refused.value.message == sentence


# --- tools, images, stream ----------------------------------------------------------------------


def test_server_tools_must_be_exposed_and_listed_once():
    assert validate_server_tools(definition(), [{"name": "clock", "trust": True}]) == [{"name": "clock", "trust": True}]
    with pytest.raises(BadRequest, match="exposes no server tool named 'nope'"):
        validate_server_tools(definition(), [{"name": "nope"}])
    with pytest.raises(BadRequest, match="listed twice"):
        validate_server_tools(definition(), [{"name": "clock"}, {"name": "clock"}])


def test_client_tools_need_the_capability_unique_names_and_no_collision():
    tool = {"name": "lookup", "description": "d", "parameters": {"type": "object"}}
    with pytest.raises(BadRequest, match="does not accept client tools"):
        validate_client_tools(definition(), [tool], None)
    able = definition(application={"tools": {}})
    validate_client_tools(able, [tool], None)
    with pytest.raises(BadRequest, match="repeated: lookup"):
        validate_client_tools(able, [tool, tool], None)
    with pytest.raises(BadRequest, match="Tool name collision: clock"):
        validate_client_tools(able, [{**tool, "name": "clock"}], [{"name": "clock"}])


def test_images_and_stream_modes_follow_the_capabilities():
    message = {"role": "user", "content": [{"type": "image", "url": "https://example.org/a.png"}]}
    with pytest.raises(BadRequest, match="does not accept https:// image URLs"):
        check_images(definition(), [message])
    check_images(definition(image={"http": {}}), [message])
    check_stream(definition(), "delta")
    with pytest.raises(BadRequest, match="does not support stream 'message'; it supports: delta, none"):
        check_stream(definition(), "message")


# --- answers to pending tool calls ----------------------------------------------------------------

PENDING = [
    {"toolCallId": "c1", "name": "lookup", "input": {"q": 1}, "kind": "client"},
    {"toolCallId": "c2", "name": "clock", "input": {}, "kind": "permission"},
]


def test_every_pending_call_answered_once_gives_tool_messages_and_permissions():
    tool_messages, permissions = answers_for_pending(
        PENDING,
        [
            {"role": "tool", "toolCallId": "c1", "content": "42"},
            {"role": "tool_permission", "toolCallId": "c2", "granted": False, "reason": "no"},
        ],
    )
    assert tool_messages == [{"role": "tool", "toolCallId": "c1", "content": "42"}]
    assert permissions == [{"toolCallId": "c2", "name": "clock", "input": {}, "granted": False, "reason": "no"}]


@pytest.mark.parametrize(
    "messages,problem",
    [
        ([{"role": "user", "content": "hi"}], "Tool calls are pending (c1, c2)"),
        ([{"role": "tool", "toolCallId": "c1", "content": "x"}], "not answered: c2"),
        (
            [
                {"role": "tool", "toolCallId": "c1", "content": "x"},
                {"role": "tool", "toolCallId": "c2", "content": "x"},
            ],
            "wrong answer kind for c2",
        ),
        (
            [
                {"role": "tool", "toolCallId": "c1", "content": "x"},
                {"role": "tool", "toolCallId": "c1", "content": "y"},
                {"role": "tool_permission", "toolCallId": "c2", "granted": True},
            ],
            "answered more than once: c1",
        ),
        (
            [
                {"role": "tool", "toolCallId": "c9", "content": "x"},
                {"role": "tool", "toolCallId": "c1", "content": "x"},
                {"role": "tool_permission", "toolCallId": "c2", "granted": True},
            ],
            "unknown toolCallId c9",
        ),
    ],
)
def test_answers_that_do_not_match_the_pending_calls_are_refused(messages, problem):
    with pytest.raises(BadRequest) as refused:
        answers_for_pending(PENDING, messages)
    assert problem in refused.value.message


def test_without_pending_calls_a_turn_is_one_user_message():
    assert answers_for_pending([], [{"role": "user", "content": "hi"}]) == ([], [])
    with pytest.raises(BadRequest, match="Send exactly one user message per turn."):
        answers_for_pending([], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("pending", [[], PENDING])
@pytest.mark.parametrize("role", ["system", "assistant"])
def test_a_history_message_in_a_turn_is_refused_saying_where_it_belongs(pending, role):
    """The v2-era surface lets any message role through its shapes; the rule stays one."""
    messages = [{"role": role, "content": "x"}, {"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match=f"'{role}' messages only seed the history a session is created with"):
        answers_for_pending(pending, messages)
