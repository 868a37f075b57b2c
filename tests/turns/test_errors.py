"""Every non-2xx answer is JSON with a sentence a person can act on, whatever the request looks
like: malformed JSON, other content types, huge bodies, wrong methods, unknown paths, and any
shape of body on the two endpoints that take one. Never a 500."""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

LIMIT = 10 * 1024 * 1024  # the stack's AAP_MAX_BODY_BYTES (the default)
USER_HI = [{"role": "user", "content": "hi"}]


def assert_json_error(response: httpx.Response, status: int | None = None) -> str:
    what = f"{response.request.method} {response.request.url.path}: {response.status_code} {response.text[:300]}"
    if status is None:
        assert 400 <= response.status_code < 500, what
    else:
        assert response.status_code == status, what
    assert response.headers.get("content-type", "").startswith("application/json"), what
    error = response.json()["error"]
    assert isinstance(error, str) and len(error.strip()) > 10, what
    assert "Traceback" not in response.text
    return error


@pytest.fixture(scope="module")
def session(engine) -> str:
    client = engine.client("demo")
    session = client.create_session("echo")
    client.close()
    return session


def post_raw(
    client, path: str, content: bytes | str, content_type: str | None = "application/json", **kw
) -> httpx.Response:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    return client.http.post(path, content=content, headers=headers, **kw)


def body_paths(session: str) -> list[str]:
    return ["/v1/sessions", f"/v1/sessions/{session}/turns"]


# --- malformed JSON, content types, size --------------------------------------------------------

MALFORMED = {
    "truncated": b'{"agent": {"name": "echo"',
    "single quotes": b"{'agent': {'name': 'echo'}}",
    "trailing garbage": b'{"agent": {"name": "echo"}} trailing',
    "trailing comma": b'{"agent": {"name": "echo"},}',
    "NaN": b'{"agent": {"name": "echo", "options": {"signature": NaN}}}',
    "Infinity": b'{"messages": [{"role": "user", "content": Infinity}]}',
    "invalid UTF-8": b'{"agent": {"name": "\xff\xfe"}}',
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "lone surrogate escape": b'{"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "whitespace only": b"   \n ",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_json_is_a_400_saying_so(demo, session, case):
    for path in body_paths(session):
        error = assert_json_error(post_raw(demo, path, MALFORMED[case]), 400)
        if case != "whitespace only":
            assert "JSON" in error, error


def test_a_paired_surrogate_escape_is_fine(demo):
    body = b'{"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    response = post_raw(demo, "/v1/sessions", body)
    assert response.status_code == 201, response.text
    assert demo.history(response.json()["sessionId"]) == [{"role": "user", "content": "smile \U0001f600"}]


JSON_TEXT = json.dumps({"agent": {"name": "echo"}, "messages": USER_HI}).encode()
NOT_JSON = {
    "text/plain": {"content": JSON_TEXT, "headers": {"Content-Type": "text/plain"}},
    "xml": {"content": b"<agent name='echo'/>", "headers": {"Content-Type": "application/xml"}},
    "no content type": {"content": JSON_TEXT},
    "form": {"data": {"agent": "echo"}},
    "multipart": {"files": {"agent": ("agent.json", JSON_TEXT, "application/json")}},
    # Twisted's own form parsing is off, so a broken multipart body reaches the API's JSON errors.
    "malformed multipart": {"content": b"garbage", "headers": {"Content-Type": "multipart/form-data"}},
}


@pytest.mark.parametrize("case", list(NOT_JSON))
def test_a_body_that_is_not_json_is_a_415(demo, session, case):
    for path in body_paths(session):
        error = assert_json_error(demo.http.post(path, **NOT_JSON[case]), 415)
        assert "application/json" in error


def test_json_content_type_with_charset_is_accepted(demo):
    body = json.dumps({"agent": {"name": "echo"}})
    assert post_raw(demo, "/v1/sessions", body, "application/json; charset=utf-8").status_code == 201


def _oversized() -> bytes:
    body = json.dumps(
        {"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "x" * (LIMIT + 1024 * 1024)}]}
    )
    return body.encode()


def test_a_body_over_the_limit_is_a_413(demo, session):
    big = _oversized()
    for path in body_paths(session):
        error = assert_json_error(post_raw(demo, path, big), 413)
        assert str(LIMIT) in error


def test_a_chunked_body_over_the_limit_is_a_413(demo, session):
    big = _oversized()

    def chunks():
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    for path in body_paths(session):
        assert_json_error(post_raw(demo, path, chunks()), 413)


def test_a_chunked_body_under_the_limit_is_read(demo):
    body = json.dumps({"agent": {"name": "echo"}, "messages": USER_HI}).encode()
    response = post_raw(demo, "/v1/sessions", iter([body[:10], body[10:]]))
    assert response.status_code == 201, response.text
    assert demo.history(response.json()["sessionId"]) == USER_HI


def test_a_large_body_under_the_limit_is_accepted(demo):
    text = "y" * (1024 * 1024)
    session = demo.create_session("echo", messages=[{"role": "user", "content": text}])
    assert demo.history(session)[0]["content"] == text


# --- methods and paths --------------------------------------------------------------------------


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(demo, session):
    cases = [
        ("PUT", "/v1/sessions", {"GET", "POST"}),
        ("PATCH", "/v1/meta", {"GET"}),
        ("DELETE", "/v1/meta", {"GET"}),
        ("POST", f"/v1/sessions/{session}", {"GET", "DELETE"}),
        ("PUT", f"/v1/sessions/{session}/history", {"GET"}),
        ("GET", f"/v1/sessions/{session}/turns", {"POST"}),
        ("GET", f"/v1/sessions/{session}/turns/turn_x/cancel", {"POST"}),
        ("POST", f"/v1/sessions/{session}/turns/turn_x/events", {"GET"}),
    ]
    for method, path, allowed in cases:
        response = demo.http.request(method, path, json={})
        error = assert_json_error(response, 405)
        assert method in error
        assert allowed <= {m.strip() for m in response.headers["Allow"].split(",")}, response.headers["Allow"]


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/nope",
        "/v1",
        "/v1/",
        "/v1/nope",
        "/v1/session",
        "/v3/meta",
        "/v2/nope",
        "/v1/sessions/x/y/z",
        "/v1/sessions/%00",
        "/v1/sessions/%00/history?type=full",
        "/v1/sessions/a.b",
        "/v1/sessions/%ED%A0%80",
        "/v1/sessions/sess_x/turns/%00/events",
    ],
)
def test_an_unknown_path_is_a_json_404(demo, path):
    assert_json_error(demo.get(path), 404)
    assert_json_error(demo.post(path, {}), 404)


def test_an_unknown_path_is_a_json_404_without_a_token_too(engine):
    assert_json_error(engine.request("GET", "/v1/nope"), 404)


# --- any shape of body ---------------------------------------------------------------------------

NOT_OBJECTS = ["[]", "[{}]", '"agent"', "42", "-1.5", "true", "null", '""']


@pytest.mark.parametrize("body", NOT_OBJECTS)
def test_a_top_level_body_that_is_not_an_object_is_a_400(demo, session, body):
    for path in body_paths(session):
        assert_json_error(post_raw(demo, path, body), 400)


CREATE_BAD = {
    "empty object": {},
    "agent is a string": {"agent": "echo"},
    "agent is a list": {"agent": ["echo"]},
    "agent is null": {"agent": None},
    "agent name is a list": {"agent": {"name": ["echo"]}},
    "agent name is an object": {"agent": {"name": {"n": "echo"}}},
    "agent name is empty": {"agent": {"name": ""}},
    "agent name is huge": {"agent": {"name": "e" * 100_000}},
    "agent name has a NUL": {"agent": {"name": "echo\u0000"}},
    "options is a string": {"agent": {"name": "echo", "options": "style=upper"}},
    "options is null": {"agent": {"name": "echo", "options": None}},
    "option key is empty": {"agent": {"name": "echo", "options": {"": "x"}}},
    "option value has a NUL": {"agent": {"name": "echo", "options": {"signature": "a\u0000b"}}},
    "agent tools is an object": {"agent": {"name": "echo", "tools": {"name": "clock"}}},
    "agent tools holds strings": {"agent": {"name": "echo", "tools": ["clock"]}},
    "agent tools holds null": {"agent": {"name": "echo", "tools": [None]}},
    "messages is a string": {"agent": {"name": "echo"}, "messages": "hi"},
    "messages holds null": {"agent": {"name": "echo"}, "messages": [None]},
    "messages holds lists": {"agent": {"name": "echo"}, "messages": [["user", "hi"]]},
    "message role is a list": {"agent": {"name": "echo"}, "messages": [{"role": ["user"], "content": "hi"}]},
    "content blocks hold strings": {"agent": {"name": "echo"}, "messages": [{"role": "user", "content": ["hi"]}]},
    "content block type is an object": {
        "agent": {"name": "echo"},
        "messages": [{"role": "user", "content": [{"type": {}}]}],
    },
    "image url is a number": {
        "agent": {"name": "echo"},
        "messages": [{"role": "user", "content": [{"type": "image", "url": 5}]}],
    },
    "image url is a bad data URI": {
        "agent": {"name": "echo"},
        "messages": [{"role": "user", "content": [{"type": "image", "url": "data:image/png,notbase64"}]}],
    },
    "tools holds null": {"agent": {"name": "echo"}, "tools": [None]},
    "tool parameters is null": {
        "agent": {"name": "echo"},
        "tools": [{"name": "t", "description": "d", "parameters": None}],
    },
    "tool description is a number": {
        "agent": {"name": "echo"},
        "tools": [{"name": "t", "description": 1, "parameters": {}}],
    },
    "tool description is huge": {
        "agent": {"name": "echo"},
        "tools": [{"name": "t", "description": "d" * 20_000, "parameters": {}}],
    },
}

TURN_BAD = {
    "empty object": {},
    "messages is null": {"messages": None},
    "messages is empty": {"messages": []},
    "messages is an object": {"messages": {"role": "user", "content": "hi"}},
    "messages holds null": {"messages": [None]},
    "two user messages": {"messages": USER_HI * 2},
    "system message": {"messages": [{"role": "system", "content": "x"}]},
    "assistant message": {"messages": [{"role": "assistant", "content": "x"}]},
    "user content is an object": {"messages": [{"role": "user", "content": {"text": "hi"}}]},
    "tool answer with nothing pending": {"messages": [{"role": "tool", "toolCallId": "call_x", "content": "r"}]},
    "permission with nothing pending": {
        "messages": [{"role": "tool_permission", "toolCallId": "call_x", "granted": True}]
    },
    "permission granted is a string": {"messages": [{"role": "tool_permission", "toolCallId": "c", "granted": "yes"}]},
    "permission without granted": {"messages": [{"role": "tool_permission", "toolCallId": "c"}]},
    "stream is unknown": {"messages": USER_HI, "stream": "fast"},
    "stream is a number": {"messages": USER_HI, "stream": 1},
    "stream is null": {"messages": USER_HI, "stream": None},
    "agent is a string": {"messages": USER_HI, "agent": "echo"},
    "agent name differs": {"messages": USER_HI, "agent": {"name": "echo-small"}},
    "unknown option": {"messages": USER_HI, "agent": {"options": {"colour": "red"}}},
    "option value is a number": {"messages": USER_HI, "agent": {"options": {"signature": 1}}},
    "select value not a choice": {"messages": USER_HI, "agent": {"options": {"style": "bold"}}},
    "server tool not exposed": {"messages": USER_HI, "agent": {"tools": [{"name": "weather"}]}},
    "client tool invalid": {"messages": USER_HI, "tools": [{"name": "bad name", "description": "d", "parameters": {}}]},
    "client tool collides": {
        "messages": USER_HI,
        "agent": {"tools": [{"name": "clock"}]},
        "tools": [{"name": "clock", "description": "d", "parameters": {}}],
    },
    "tools is a string": {"messages": USER_HI, "tools": "none"},
}


@pytest.mark.parametrize("case", list(CREATE_BAD))
def test_create_session_with_a_bad_body_is_a_json_4xx(demo, case):
    assert_json_error(demo.post("/v1/sessions", CREATE_BAD[case]), 400)


@pytest.mark.parametrize("case", list(TURN_BAD))
def test_turn_with_a_bad_body_is_a_json_4xx(demo, session, case):
    assert_json_error(demo.post(f"/v1/sessions/{session}/turns", TURN_BAD[case]), 400)


def test_the_session_is_intact_after_refused_turns(demo, session):
    assert demo.history(session) == []
    assert demo.get(f"/v1/sessions/{session}").json() == {"sessionId": session, "agent": {"name": "echo"}}
    result = demo.turn(session, text="still works")
    assert result.status == 200 and result.stop_reason == "end_turn"
    assert demo.history(session) == [{"role": "user", "content": "still works"}, *result.messages]


# A value of every JSON type (and a NUL string, and an integer no machine type holds) put in
# place of each value of a valid body.
WEIRD_VALUES = [None, 10**30, "\u0000", [{}], {"": []}]

VALID_CREATE = {
    "agent": {
        "name": "echo",
        "options": {"style": "plain", "signature": "s", "apiKey": "k"},
        "tools": [{"name": "clock", "trust": True}],
    },
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image", "url": "https://example.com/a.png"}],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "toolCallId": "c1", "name": "lookup", "input": {"q": "x"}}],
        },
        {"role": "tool", "toolCallId": "c1", "content": "ok"},
    ],
    "tools": [{"name": "lookup", "title": "Lookup", "description": "d", "parameters": {"type": "object"}}],
}
VALID_TURN = {
    "agent": {"options": {"style": "plain"}, "tools": [{"name": "add", "trust": False}]},
    "stream": "none",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "tools": [{"name": "lookup", "description": "d", "parameters": {"type": "object"}}],
}


def value_paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from value_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from value_paths(item, (*prefix, index))


def replaced(body, path, value):
    body = copy.deepcopy(body)
    if not path:
        return value
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


def sweep(client, make_path, valid: dict, ok_status: int) -> list[str]:
    """Post every variant (a few at a time, each thread on a path of its own); return the problems."""
    local = threading.local()

    def check(case) -> str | None:
        where, value = case
        if not hasattr(local, "path"):
            local.path = make_path()
        response = client.post(local.path, replaced(valid, where, value))
        label = f"{'.'.join(map(str, where))} = {json.dumps(value)[:40]} -> {response.status_code}"
        if response.status_code == ok_status:
            return None
        if not 400 <= response.status_code < 500:
            return f"{label} {response.text[:200]}"
        try:
            error = response.json()["error"]
            assert isinstance(error, str) and error.strip()
        except Exception:
            return f"{label} has no JSON error: {response.text[:200]}"
        return None

    cases = [(where, value) for where in list(value_paths(valid))[1:] for value in WEIRD_VALUES]
    with ThreadPoolExecutor(2) as pool:
        return [problem for problem in pool.map(check, cases) if problem]


def test_any_value_of_any_type_anywhere_in_a_create_body_is_never_a_5xx(other):
    assert other.post("/v1/sessions", VALID_CREATE).status_code == 201
    problems = sweep(other, lambda: "/v1/sessions", VALID_CREATE, 201)
    assert not problems, "\n".join(problems)


def test_any_value_of_any_type_anywhere_in_a_turn_body_is_never_a_5xx(other):
    def new_session_turns() -> str:
        return f"/v1/sessions/{other.create_session('echo')}/turns"

    assert other.post(new_session_turns(), VALID_TURN).status_code == 200
    problems = sweep(other, new_session_turns, VALID_TURN, 200)
    assert not problems, "\n".join(problems)
