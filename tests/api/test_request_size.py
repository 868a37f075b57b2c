"""Requests too large in items are refused by count before per-message validation runs:
a 10 MiB body of tiny messages costs a `len`, not seconds of serializers (check_request_size).
A body of 64 KiB or more is counted before it is even parsed into Python objects
(check_body_size), with the same answer the parsed body gets. The same limits hold on /v1/
and /v2/."""

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


@pytest.fixture
def full_parses(monkeypatch):
    """Counts the bodies parsed into Python objects (DRF's JSONParser calls this json.load)."""
    from rest_framework.utils import json as drf_json

    calls = []
    original = drf_json.load

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(drf_json, "load", counted)
    return calls


@pytest.fixture
def parsed_only(monkeypatch):
    """Turns the count before the parse off: every body takes the path of the parsed body."""

    def off():
        monkeypatch.setattr("sessions_app.api.views.check_body_size", lambda raw, *, seed: None)

    return off


def body_of(count: int, **extra) -> bytes:
    return json.dumps({"messages": [TINY] * count, **extra}).encode()


def send(api, request: tuple[str, str], raw: bytes, content_type: str = "application/json"):
    method, path = request
    return getattr(api.client, method)(path, data=raw, content_type=content_type, **api.headers)


def surfaces(session: str) -> dict[str, tuple[str, str]]:
    return {
        "v1 turn": ("post", f"/v1/sessions/{session}/turns"),
        "v2 turn": ("post", f"/v2/session/{session}"),
        "v1 create": ("post", "/v1/sessions"),
        "v2 create": ("put", "/v2/session"),
    }


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


TURN_200K = {
    "error": "One turn may hold at most 256 messages (AAP_MAX_TURN_MESSAGES); this request has 200000. "
    "Send fewer messages per turn."
}
SEED_200K = {
    "error": "A session's seed history may hold at most 2000 messages (AAP_MAX_SEED_MESSAGES); this request "
    "has 200000. Start the session with fewer messages."
}


@pytest.mark.parametrize("surface", ["v1 turn", "v2 turn", "v1 create", "v2 create"])
def test_200000_messages_are_counted_before_the_parse_and_get_the_same_400(
    api, surface, full_parses, parsed_only, no_serializer
):
    request = surfaces(api.create_session())[surface]
    raw = body_of(200_000, agent={"name": "echo"})
    full_parses.clear()  # the session's creation

    early = send(api, request, raw)
    assert early.status_code == 400 and early.json() == (SEED_200K if "create" in surface else TURN_200K)
    assert full_parses == []  # refused from the raw body: no dict of it was built

    parsed_only()  # the positive control: the answer the parsed body gets, as before the early count
    parsed = send(api, request, raw)
    assert full_parses == [1]
    assert (parsed.status_code, parsed["Content-Type"], parsed.content) == (
        early.status_code,
        early["Content-Type"],
        early.content,
    )
    assert no_serializer == []


def test_content_parts_and_tools_are_counted_before_the_parse_too(api, full_parses, no_serializer):
    session = api.create_session()
    full_parses.clear()
    parts = [{"type": "text", "text": "a"}] * 20_000
    raw = json.dumps({"messages": [TINY, {"role": "user", "content": parts}]}).encode()
    error = assert_refusal(api.post(f"/v1/sessions/{session}/turns", raw=raw), 400)
    assert error == "messages[1] has 20000 content parts; at most 64 are allowed (AAP_MAX_CONTENT_PARTS)."
    tool = {"name": "t", "description": "d", "parameters": {"type": "object"}}
    raw = json.dumps({"messages": [TINY], "tools": [tool] * 2000}).encode()
    error = assert_refusal(api.post(f"/v1/sessions/{session}/turns", raw=raw), 400)
    assert error == "A request may declare at most 128 client tools (AAP_MAX_REQUEST_TOOLS); this one has 2000."
    assert full_parses == [] and no_serializer == []


def many(count: int) -> bytes:
    return b", ".join([json.dumps(TINY).encode()] * count)


# (before the messages, after them, how many, Content-Type, what the answer says: None for 201)
UNJUDGED = {
    # Python's decoder keeps the last of repeated keys: one message, and the session is created.
    "repeated key": (
        b'{"agent": {"name": "echo"}, "messages": [',
        b'], "messages": [{"role": "user", "content": "hi"}]}',
        200_000,
        "application/json",
        None,
    ),
    "byte order mark": (b'\xef\xbb\xbf{"messages": [', b"]}", 200_000, "application/json", "not valid JSON"),
    "lone surrogate": (
        b'{"messages": [',
        b', {"role": "user", "content": "\\ud800"}]}',
        200_000,
        "application/json",
        "surrogate",
    ),
    "truncated": (b'{"messages": [', b"]", 200_000, "application/json", "not valid JSON"),
    "integer past 64 bits": (
        b'{"n": 123456789012345678901234567890, "messages": [',
        b"]}",
        200_000,
        "application/json",
        "at most 2000",
    ),
    "latin-1": (b'{"messages": [', b"]}", 200_000, "application/json; charset=latin-1", "at most 2000"),
    # The test client sends it in UTF-16, twice as long: 100,000 stay under the body limit.
    "utf-16": (b'{"messages": [', b"]}", 100_000, "application/json; charset=utf-16", "at most 2000"),
}


@pytest.mark.parametrize("case", list(UNJUDGED))
def test_bodies_the_early_count_cannot_judge_get_the_answer_they_got_before(api, case, full_parses, parsed_only):
    """Each of these is refused, or taken, after the full parse, exactly as without the early count."""
    head, tail, count, content_type, said = UNJUDGED[case]
    raw = head + many(count) + tail
    first = send(api, ("post", "/v1/sessions"), raw, content_type)
    if said is None:
        assert first.status_code == 201, first.content[:300]
        assert full_parses == [1]
    else:
        assert said in assert_refusal(first, 400)
        parsed_only()
        again = send(api, ("post", "/v1/sessions"), raw, content_type)
        assert (again.status_code, again.content) == (first.status_code, first.content)


def test_a_large_valid_seed_at_the_limit_is_taken(api, no_serializer, full_parses):
    """The positive control: a body over 64 KiB within every limit is counted, parsed, validated."""
    message = {"role": "user", "content": [{"type": "text", "text": "hello " * 10}] * 8}
    raw = json.dumps({"agent": {"name": "echo"}, "messages": [message] * 2000}).encode()
    assert len(raw) > 64 * 1024
    assert api.post("/v1/sessions", raw=raw).status_code == 201
    assert full_parses == [1] and len(no_serializer) == 2000
