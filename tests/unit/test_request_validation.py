"""Request bodies are validated through one serializer instance per class (protocol.validate):
what a request is told must be what DRF's own `is_valid()` on a new instance says, for valid
and invalid bodies alike, from any number of threads at once."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from rest_framework import serializers

from sessions_app import protocol
from sessions_app.api.v2 import shapes

TEXT = {"role": "user", "content": "hello"}
TOOL = {"name": "lookup", "description": "Looks up.", "parameters": {"type": "object"}}

CASES = [
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "stream": "delta"}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT]}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "tools": [TOOL], "agent": {"options": {"a": "b"}}}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "colour": "blue"}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "_meta": 3}),
    (protocol.TurnRequestSerializer, {"messages": []}),
    (protocol.TurnRequestSerializer, {"messages": [{"role": "system", "content": "x"}]}),
    (
        protocol.TurnRequestSerializer,
        {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": ""}]}]},
    ),
    (protocol.TurnRequestSerializer, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
    (protocol.TurnRequestSerializer, {"messages": [{"role": "user", "content": [{"type": "text"}, "x"]}]}),
    (protocol.TurnRequestSerializer, {"messages": [{"role": "user", "content": "x", "extra": 1}]}),
    (protocol.TurnRequestSerializer, {"messages": [{"role": "tool_permission", "toolCallId": "c", "granted": "yes"}]}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "tools": [{**TOOL, "name": "no spaces"}]}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "tools": [{**TOOL, "parameters": {"type": 5}}]}),
    (protocol.TurnRequestSerializer, {"messages": [TEXT], "stream": "sometimes"}),
    (protocol.TurnRequestSerializer, {"messages": "hello"}),
    (protocol.TurnRequestSerializer, None),
    (protocol.TurnRequestSerializer, [TEXT]),
    (protocol.TurnRequestSerializer, "hello"),
    (protocol.CreateSessionSerializer, {"agent": {"name": "echo"}, "messages": [{"role": "system", "content": "x"}]}),
    (protocol.CreateSessionSerializer, {"agent": {}}),
    (protocol.CreateSessionSerializer, {"agent": {"name": "echo", "tools": [{"name": "t", "trust": "no"}]}}),
    # The message and block serializers the fields validate each message and block with.
    (protocol.UserMessageSerializer, TEXT),
    (protocol.UserMessageSerializer, {"role": "user", "content": [{"type": "image", "url": "ftp://x"}]}),
    (protocol.UserMessageSerializer, {"role": "user", "content": 5}),
    (protocol.ToolPermissionMessageSerializer, {"role": "tool_permission", "toolCallId": "c", "granted": True}),
    (protocol.ToolPermissionMessageSerializer, {"role": "tool_permission", "granted": 1, "reason": 2}),
    (protocol.TextBlockSerializer, {"type": "text", "text": "hi"}),
    (protocol.TextBlockSerializer, {"type": "text", "text": None, "x": 1}),
    (protocol.ToolUseBlockSerializer, {"type": "tool_use", "toolCallId": "c", "name": "n", "input": []}),
    (shapes.V2TurnRequestSerializer, {"messages": [TEXT], "stream": "delta"}),
    (shapes.V2TurnRequestSerializer, {"messages": [TEXT], "stream": 7}),
]


def by_is_valid(serializer_class, data):
    """What DRF's own path says: ("valid", validated_data) or ("invalid", errors)."""
    serializer = serializer_class(data=data)
    if serializer.is_valid():
        return "valid", json.loads(json.dumps(serializer.validated_data))
    return "invalid", json.loads(json.dumps(serializer.errors))


def by_validate(serializer_class, data):
    try:
        return "valid", json.loads(json.dumps(protocol.validate(serializer_class, data)))
    except serializers.ValidationError as exc:
        return "invalid", json.loads(json.dumps(exc.detail))


@pytest.mark.parametrize(("serializer_class", "data"), CASES)
def test_a_body_is_told_what_a_new_serializer_would_say(serializer_class, data):
    expected = by_is_valid(serializer_class, data)
    assert by_validate(serializer_class, data) == expected
    assert by_validate(serializer_class, data) == expected, "the shared instance kept nothing from the first call"


def test_the_valid_and_invalid_cases_are_both_covered():
    outcomes = {by_is_valid(serializer_class, data)[0] for serializer_class, data in CASES}
    assert outcomes == {"valid", "invalid"}


def test_error_codes_survive(serializer_class=protocol.TurnRequestSerializer):
    with pytest.raises(serializers.ValidationError) as caught:
        protocol.validate(serializer_class, None)
    assert caught.value.detail["non_field_errors"][0].code == "null"
    with pytest.raises(serializers.ValidationError) as caught:
        protocol.validate(serializer_class, {"messages": [TEXT], "stream": "sometimes"})
    assert caught.value.detail["stream"][0].code == "invalid_choice"


def test_threads_validating_at_once_each_get_their_own_answer():
    expected = [by_is_valid(serializer_class, data) for serializer_class, data in CASES]
    protocol._validator.cache_clear()  # the instances are first built while threads race

    def run(round_number):
        order = list(range(len(CASES)))
        order = order[round_number % len(order) :] + order[: round_number % len(order)]
        return [(i, by_validate(*CASES[i])) for i in order]

    with ThreadPoolExecutor(max_workers=8) as pool:
        for answers in pool.map(run, range(400)):
            for i, answer in answers:
                assert answer == expected[i], CASES[i]
