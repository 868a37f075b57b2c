"""The request rules of sessions and turns, on an in-memory agent definition: no database."""

from __future__ import annotations

import pytest

from agents.selectors import AgentDefinition, OptionDefinition
from infra import crypto
from infra.service_errors import BadRequest
from sessions_app.api.services.validation import (
    answers_for_pending,
    check_images,
    check_stream,
    merge_options,
    redacted_options,
    validate_client_tools,
    validate_server_tools,
)
from sessions_app.engine.worker import effective_options

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
    with pytest.raises(BadRequest, match=r"Send exactly one user message per turn\."):
        answers_for_pending([], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("pending", [[], PENDING])
@pytest.mark.parametrize("role", ["system", "assistant"])
def test_a_history_message_in_a_turn_is_refused_saying_where_it_belongs(pending, role):
    """The v2-era surface lets any message role through its shapes; the rule stays one."""
    messages = [{"role": role, "content": "x"}, {"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match=f"'{role}' messages only seed the history a session is created with"):
        answers_for_pending(pending, messages)


def _answer(check, *args, **kwargs) -> str | None:
    try:
        check(*args, **kwargs)
    except BadRequest as exc:
        return exc.message
    return None


def _body(rng) -> bytes:
    """A JSON body over 64 KiB whose messages, content parts and tools straddle the limits,
    with the shapes the check must read alike: scalars, repeated keys, escaped key names."""

    def message():
        kind = rng.random()
        if kind < 0.1:
            return rng.choice(["1", "null", '"text"', "[]"])
        content = rng.choice(['"hi"', "[" + ", ".join(['{"type": "text", "text": "a"}'] * rng.choice([1, 3, 4])) + "]"])
        if kind < 0.15:  # repeated key: Python keeps the last
            return '{"role": "user", "content": [1, 2, 3, 4], "content": ' + content + "}"
        if kind < 0.2:
            return '{"role": "user", "cont\\u0065nt": ' + content + "}"
        return '{"role": "user", "content": ' + content + "}"

    parts = [f'"pad": "{"x" * 70_000}"']
    if rng.random() < 0.9:
        parts.append('"messages": [' + ", ".join(message() for _ in range(rng.choice([0, 1, 5, 6, 7]))) + "]")
    if rng.random() < 0.1:
        parts.append('"messages": "not a list"')
    if rng.random() < 0.5:
        parts.append('"tools": [' + ", ".join(["{}"] * rng.choice([0, 2, 3])) + "]")
    rng.shuffle(parts)
    return ("{" + ", ".join(parts) + "}").encode()


@pytest.mark.parametrize("seed", [True, False])
def test_the_count_before_the_parse_answers_as_the_parsed_body_does(settings, seed):
    import json
    import random

    from sessions_app.api.services.validation import check_body_size, check_request_size

    settings.AAP_MAX_TURN_MESSAGES = settings.AAP_MAX_SEED_MESSAGES = 5
    settings.AAP_MAX_CONTENT_PARTS = 3
    settings.AAP_MAX_REQUEST_TOOLS = 2
    rng, refused = random.Random(33), 0
    for _ in range(300):
        raw = _body(rng)
        parsed = _answer(check_request_size, json.loads(raw), seed=seed)
        early = _answer(check_body_size, raw, seed=seed)
        # The early count refuses only what the parsed body refuses, with the same sentence;
        # what it cannot judge (repeated keys), it leaves to the parsed body.
        assert early in (None, parsed), raw[-300:]
        refused += early is not None
    assert refused > 50  # the positive control: most refusals happen before the parse


def test_the_count_before_the_parse_leaves_small_bodies_and_non_objects_alone(settings):
    from sessions_app.api.services.validation import check_body_size

    settings.AAP_MAX_TURN_MESSAGES = 1
    small = b'{"messages": [1, 2]}'
    with pytest.raises(BadRequest):
        check_body_size(small + b" " * 70_000, seed=False)  # the positive control
    assert _answer(check_body_size, small, seed=False) is None
    assert _answer(check_body_size, b"\xef\xbb\xbf" + small + b" " * 70_000, seed=False) is None
    assert _answer(check_body_size, b"[" + small + b"]" + b" " * 70_000, seed=False) is None
    assert _answer(check_body_size, small[:-1] + b" " * 70_000, seed=False) is None  # not JSON
