"""Requests too large in items are refused by count before per-message validation runs:
a 10 MiB body of tiny messages costs a `len`, not seconds of serializers (check_request_size).
The same limits hold on /v1/ and /v2/."""

from __future__ import annotations

import json

import pytest

from sessions_app import protocol

from .conftest import assert_refusal

TINY = {"role": "user", "content": "hi"}


@pytest.fixture
def no_serializer(monkeypatch):
    """Counts per-message validations (v1's MessageField, which v2's inherits)."""
    calls = []
    original = protocol.MessageField.to_internal_value

    def counted(self, data):
        calls.append(1)
        return original(self, data)

    monkeypatch.setattr(protocol.MessageField, "to_internal_value", counted)
    return calls


def body_of(count: int, **extra) -> bytes:
    return json.dumps({"messages": [TINY] * count, **extra}).encode()


def test_200000_messages_in_one_turn_are_refused_before_any_is_validated(api, no_serializer, settings):
    session = api.create_session()
    raw = body_of(200_000)
    assert 6_000_000 < len(raw) < settings.AAP_MAX_BODY_BYTES
    error = assert_refusal(api.post(f"/v1/sessions/{session}/turns", raw=raw), 400)
    assert "at most 256 messages" in error and "AAP_MAX_TURN_MESSAGES" in error and "200000" in error
    assert no_serializer == []

    error = assert_refusal(api.post(f"/v2/session/{session}", raw=raw), 400)
    assert "AAP_MAX_TURN_MESSAGES" in error
    assert no_serializer == []


def test_a_seed_over_the_limit_is_refused_on_both_surfaces_and_stores_nothing(api, no_serializer, settings):
    from sessions_app.models import Session

    settings.AAP_MAX_SEED_MESSAGES = 10
    before = Session.objects.count()
    error = assert_refusal(api.post("/v1/sessions", raw=body_of(11, agent={"name": "echo"})), 400)
    assert "seed history may hold at most 10 messages (AAP_MAX_SEED_MESSAGES)" in error
    error = assert_refusal(api.put("/v2/session", {"agent": {"name": "echo"}, "messages": [TINY] * 11}), 400)
    assert "AAP_MAX_SEED_MESSAGES" in error
    assert no_serializer == [] and Session.objects.count() == before

    # At the limit, the serializers run as before.
    assert api.post("/v1/sessions", raw=body_of(10, agent={"name": "echo"})).status_code == 201
    assert len(no_serializer) == 10


def test_content_parts_and_tools_are_counted_too(api, no_serializer, settings):
    session = api.create_session()
    settings.AAP_MAX_CONTENT_PARTS = 3
    parts = [{"type": "text", "text": "a"}] * 4
    error = assert_refusal(
        api.post(f"/v1/sessions/{session}/turns", {"messages": [{"role": "user", "content": parts}]}), 400
    )
    assert "messages[0] has 4 content parts; at most 3" in error
    settings.AAP_MAX_REQUEST_TOOLS = 2
    tool = {"name": "t", "description": "d", "parameters": {"type": "object"}}
    error = assert_refusal(api.post(f"/v1/sessions/{session}/turns", {"messages": [TINY], "tools": [tool] * 3}), 400)
    assert "at most 2 client tools" in error
    assert no_serializer == []


@pytest.mark.parametrize(
    ("content", "said"),
    [(b'"a\\ud800b"', "surrogate"), (b'"a\\uDC00b"', "surrogate"), (b'"a\xed\xa0\x80b"', "not valid JSON")],
    ids=["lone escape", "lone low escape, upper case", "surrogate bytes"],
)
def test_a_lone_surrogate_is_still_refused(api, content, said):
    """The parser skips re-encoding a body with no surrogate in it; one with any still gets it."""
    raw = b'{"agent": {"name": "echo"}, "messages": [{"role": "user", "content": ' + content + b"}]}"
    error = assert_refusal(api.post("/v1/sessions", raw=raw), 400)
    assert said in error


def test_a_paired_surrogate_escape_is_kept(api):
    raw = b'{"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    assert api.post("/v1/sessions", raw=raw).status_code == 201
