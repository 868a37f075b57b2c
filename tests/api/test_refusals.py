"""Refusals, in process: every wrong request is a JSON 4xx with a sentence to act on, and
nothing is stored. The sentences that services raise are pinned: moving the services or
their errors must not change what a client reads."""

from __future__ import annotations

import pytest

from sessions_app.models import Session

from .conftest import assert_refusal, own_sessions, own_turns

MISSING_SESSION = "ses_" + "0" * 24
MISSING_TURN = "turn_" + "0" * 24


# --- 401: who is asking -----------------------------------------------------------------------

PROTECTED = [
    ("get", "/v1/sessions"),
    ("post", "/v1/sessions"),
    ("get", f"/v1/sessions/{MISSING_SESSION}"),
    ("delete", f"/v1/sessions/{MISSING_SESSION}"),
    ("get", f"/v1/sessions/{MISSING_SESSION}/history"),
    ("post", f"/v1/sessions/{MISSING_SESSION}/turns"),
    ("post", f"/v1/sessions/{MISSING_SESSION}/turns/{MISSING_TURN}/cancel"),
    ("get", "/v1/usage"),
]


@pytest.mark.parametrize("method,path", PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer not-a-token", "Basic dXNlcjpwYXNz", "Bearer "])
def test_a_request_without_a_valid_token_is_a_401(anonymous, method, path, authorization):
    headers = {"HTTP_AUTHORIZATION": authorization} if authorization is not None else {}
    response = getattr(anonymous, method)(path, **headers)
    assert_refusal(response, 401)
    assert response["WWW-Authenticate"] == 'Bearer realm="aap"'


def test_a_revoked_token_is_a_401(api):
    from tenancy.models import ApiToken
    from tenancy.services import token_revoke

    assert api.get("/v1/sessions").status_code == 200
    token_revoke(prefix=ApiToken.objects.get(tenant__name="api-tier").prefix)
    assert_refusal(api.get("/v1/sessions"), 401)


# --- 404: what the request names ---------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path",
    [
        ("get", f"/v1/sessions/{MISSING_SESSION}"),
        ("delete", f"/v1/sessions/{MISSING_SESSION}"),
        ("get", f"/v1/sessions/{MISSING_SESSION}/history"),
        ("post", f"/v1/sessions/{MISSING_SESSION}/turns"),
    ],
)
def test_an_unknown_session_is_a_404_naming_it(api, method, path):
    kwargs = {"body": {"messages": [{"role": "user", "content": "hi"}]}} if method == "post" else {}
    error = assert_refusal(getattr(api, method)(path, **kwargs), 404)
    assert error == f"No session '{MISSING_SESSION}' exists for this token's tenant."


def test_an_unknown_turn_is_a_404_naming_it(api):
    session = api.create_session()
    error = assert_refusal(api.post(f"/v1/sessions/{session}/turns/{MISSING_TURN}/cancel"), 404)
    assert error == f"No turn '{MISSING_TURN}' exists on session '{session}' for this token's tenant."


@pytest.mark.parametrize("path", ["/v1/nothing", "/nothing", "/v1/sessions/x/y/z"])
def test_an_unknown_path_is_a_json_404(api, path):
    assert_refusal(api.get(path), 404)


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(api):
    error = assert_refusal(api.put("/v1/sessions", {}), 405)
    assert "GET" in error and "POST" in error


# --- 400: session creation --------------------------------------------------------------------

SESSION_REFUSALS = {
    "unknown agent": (
        {"agent": {"name": "nobody"}},
        "Unknown agent 'nobody'; GET /v1/meta lists the agents you can use.",
    ),
    "unknown option": ({"agent": {"name": "echo", "options": {"colour": "red"}}}, None),
    "unknown server tool": ({"agent": {"name": "echo", "tools": [{"name": "no_such_tool"}]}}, None),
    "duplicate client tools": (
        {
            "agent": {"name": "echo"},
            "tools": [
                {"name": "t", "description": "d", "parameters": {"type": "object"}},
                {"name": "t", "description": "d", "parameters": {"type": "object"}},
            ],
        },
        None,
    ),
    "no agent": ({}, None),
    "agent not an object": ({"agent": "echo"}, None),
    "messages not a list": ({"agent": {"name": "echo"}, "messages": "hi"}, None),
}


@pytest.mark.parametrize("case", SESSION_REFUSALS, ids=list(SESSION_REFUSALS))
def test_a_bad_session_is_a_400_and_nothing_is_stored(api, case):
    body, sentence = SESSION_REFUSALS[case]
    error = assert_refusal(api.post("/v1/sessions", body), 400)
    if sentence is not None:
        assert error == sentence
    assert not own_sessions().exists()


def test_a_body_that_is_not_an_object_is_a_400(api):
    assert_refusal(api.post("/v1/sessions", raw=b"[1, 2]"), 400)
    assert_refusal(api.post("/v1/sessions", raw=b'{"agent": '), 400)


# --- 400: turns ------------------------------------------------------------------------------------

TURN_REFUSALS = {
    "two user messages": (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        "Send exactly one user message per turn.",
    ),
    "an answer with nothing pending": (
        {"messages": [{"role": "tool", "toolCallId": "call_1", "content": "x"}]},
        "No tool calls are pending, so these answers match nothing: call_1; send one user message.",
    ),
    "unknown stream mode": ({"messages": [{"role": "user", "content": "a"}], "stream": "sometimes"}, None),
    "no messages": ({}, None),
    "another agent": (
        {"messages": [{"role": "user", "content": "a"}], "agent": {"name": "someone"}},
        "This session runs agent 'echo'; agent.name cannot change.",
    ),
}


@pytest.mark.parametrize("case", TURN_REFUSALS, ids=list(TURN_REFUSALS))
def test_a_bad_turn_is_a_400_and_nothing_is_stored(api, case):
    session = api.create_session()
    body, sentence = TURN_REFUSALS[case]
    error = assert_refusal(api.post(f"/v1/sessions/{session}/turns", body), 400)
    if sentence is not None:
        assert error == sentence
    assert not own_turns().exists()
    assert Session.objects.get(public_id=session).message_seq == 0


# --- 422: an Idempotency-Key reused for another request ----------------------------------------


def test_an_idempotency_key_reused_with_another_request_is_a_422(api):
    first = api.post("/v1/sessions", {"agent": {"name": "echo"}}, HTTP_IDEMPOTENCY_KEY="key-1")
    assert first.status_code == 201, first.content
    again = api.post("/v1/sessions", {"agent": {"name": "echo"}}, HTTP_IDEMPOTENCY_KEY="key-1")
    assert again.json()["sessionId"] == first.json()["sessionId"]
    error = assert_refusal(
        api.post("/v1/sessions", {"agent": {"name": "echo"}, "messages": []}, HTTP_IDEMPOTENCY_KEY="key-1"), 422
    )
    assert error == (
        "This Idempotency-Key was already used with a different request; send a new key for a new request."
    )
    assert own_sessions().count() == 1


def test_a_database_failure_while_authenticating_answers_503_not_500(api, monkeypatch):
    """PostgreSQL restarting under the token lookup: the error handler must not authenticate
    again (another query) to name the tenant in its log line, which made it a 500."""
    from django.db import OperationalError

    from tenancy import authentication

    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise OperationalError("the connection is closed")

    monkeypatch.setattr(authentication, "_active_row", broken)
    response = api.post("/v1/sessions", {"agent": {"name": "echo"}})
    assert_refusal(response, 503)
    assert response["Retry-After"]
    assert len(calls) == 1
