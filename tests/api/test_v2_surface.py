"""The v2-era surface (seed 001) under /v2/, in process: its shapes, its refusals, and the
sessions it shares with /v1/. Turns that run are covered end to end in
tests/e2e/test_v2_surface.py (this tier has no worker)."""

from __future__ import annotations

import pytest

from sessions_app.models import Session, Turn

from .conftest import assert_refusal, own_sessions, own_turns

MISSING_SESSION = "sess_" + "0" * 24
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
V2_TOOL = {
    "name": "lookup",
    "description": "Looks a word up.",
    "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}},
}
JSON_ONLY_AGENT = {
    "name": "echo-json",
    "title": "JSON answers only",
    "version": "1.0.0",
    "runtime": {"kind": "echo", "config": {}},
    "capabilities": {"history": {"full": {}}, "stream": {"none": {}}},
}


def user(content="hi") -> dict:
    return {"role": "user", "content": content}


# --- /meta ---------------------------------------------------------------------------------------


def test_meta_says_version_2_with_tool_input_schemas(api, anonymous):
    for caller in (api, anonymous):
        response = caller.get("/v2/meta")
        assert response.status_code == 200
        body = response.json()
        assert body["version"] == 2
        [echo] = [agent for agent in body["agents"] if agent["name"] == "echo"]
        v3 = next(agent for agent in caller.get("/v1/meta").json()["agents"] if agent["name"] == "echo")
        assert [tool["name"] for tool in echo["tools"]] == [tool["name"] for tool in v3["tools"]]
        for v2_tool, v3_tool in zip(echo["tools"], v3["tools"]):
            assert v2_tool["inputSchema"] == v3_tool["parameters"]
            assert "parameters" not in v2_tool
        assert "image" not in echo["capabilities"]
        assert echo["capabilities"]["stream"] == v3["capabilities"]["stream"]


# --- GET /session/:id: the session with its history, whichever surface made it ------------------


def test_a_v1_session_reads_through_v2_with_images_as_mime_type_and_data(api):
    session = api.create_session(
        {
            "agent": {"name": "echo", "tools": [{"name": "add", "trust": True}], "options": {"style": "upper"}},
            "tools": [
                {**{k: v for k, v in V2_TOOL.items() if k != "inputSchema"}, "parameters": V2_TOOL["inputSchema"]}
            ],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image", "url": f"data:image/png;base64,{PNG}", "_meta": {"k": 1}},
                        {"type": "image", "url": "https://example.com/cat.png"},
                    ],
                },
                {"role": "assistant", "content": "seen"},
            ],
        }
    )
    response = api.get(f"/v2/session/{session}")
    assert response.status_code == 200
    body = response.json()
    assert body["sessionId"] == session
    assert body["agent"] == {"name": "echo", "tools": [{"name": "add", "trust": True}], "options": {"style": "upper"}}
    assert body["tools"] == [V2_TOOL]
    expected = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "mimeType": "image/png", "data": PNG, "_meta": {"k": 1}},
                # An https:// image has no v2-era form: its URL as text, and in _meta.
                {
                    "type": "text",
                    "text": "https://example.com/cat.png",
                    "_meta": {"imageUrl": "https://example.com/cat.png"},
                },
            ],
        },
        {"role": "assistant", "content": "seen"},
    ]
    assert body["history"] == {"compacted": expected, "full": expected}


def test_a_session_shows_only_the_history_types_its_agent_keeps(api):
    from agents.services import agents_apply

    agents_apply([JSON_ONLY_AGENT])
    session = api.create_session({"agent": {"name": "echo-json"}, "messages": [user()]})
    assert api.get(f"/v2/session/{session}").json() == {
        "sessionId": session,
        "agent": {"name": "echo-json"},
        "history": {"full": [user()]},
    }


def test_a_secret_option_reads_back_redacted(api):
    session = api.create_session({"agent": {"name": "echo", "options": {"apiKey": "sk-very-secret"}}})
    response = api.get(f"/v2/session/{session}")
    assert response.json()["agent"]["options"] == {"apiKey": "***"}
    assert b"sk-very-secret" not in response.content


# --- GET /sessions: ids, paged by nextCursor / after ----------------------------------------------


def test_sessions_are_listed_as_ids_newest_first_and_paged_by_next_cursor(api):
    created = [api.create_session() for _ in range(5)]
    seen, after = [], None
    while True:
        query = "?limit=2" + (f"&after={after}" if after else "")
        body = api.get("/v2/sessions" + query).json()
        assert set(body) <= {"sessions", "nextCursor"}
        assert all(isinstance(item, str) for item in body["sessions"])
        seen += body["sessions"]
        after = body.get("nextCursor")
        if after is None:
            break
    assert seen == created[::-1]


def test_a_cursor_the_server_did_not_issue_is_a_400_naming_next_cursor(api):
    error = assert_refusal(api.get("/v2/sessions?after=bm9wZQ"), 400)
    assert "nextCursor" in error


@pytest.mark.parametrize("limit", ["0", "101", "x"])
def test_a_limit_outside_1_to_100_is_a_400(api, limit):
    assert_refusal(api.get(f"/v2/sessions?limit={limit}"), 400)


# --- DELETE /session/:id ---------------------------------------------------------------------------


def test_delete_is_a_204_and_the_session_is_gone_from_both_surfaces(api):
    session = api.create_session()
    response = api.delete(f"/v2/session/{session}")
    assert response.status_code == 204
    assert response.content == b""
    assert_refusal(api.get(f"/v2/session/{session}"), 404)
    assert_refusal(api.get(f"/v1/sessions/{session}"), 404)


# --- refusals: JSON, with a sentence, nothing stored ------------------------------------------------

BAD_CREATES = [
    ({"messages": [user()]}, "agent"),
    ({"agent": {"name": "echo"}, "messages": []}, "messages"),
    ({"agent": {}, "messages": [user()]}, "agent.name"),
    ({"agent": {"name": "echo"}, "messages": [user(), {"role": "assistant", "content": "x"}]}, "last message"),
    ({"agent": {"name": "echo", "tools": [{"name": "add"}]}, "messages": [user()]}, "trust"),
    ({"agent": {"name": "echo"}, "messages": [user()], "tools": [{**V2_TOOL, "parameters": {}}]}, "parameters"),
    (
        {
            "agent": {"name": "echo"},
            "messages": [user()],
            "tools": [{k: v for k, v in V2_TOOL.items() if k != "inputSchema"}],
        },
        "inputSchema",
    ),
    ({"agent": {"name": "echo"}, "messages": [user([{"type": "image", "url": "https://example.com/a.png"}])]}, "url"),
    ({"agent": {"name": "echo"}, "messages": [user([{"type": "image", "mimeType": "png", "data": PNG}])]}, "mimeType"),
    (
        {"agent": {"name": "echo"}, "messages": [user([{"type": "image", "mimeType": "image/png", "data": "%%"}])]},
        "base64",
    ),
    ({"agent": {"name": "echo"}, "stream": "fast", "messages": [user()]}, "stream"),
    ({"agent": {"name": "nope"}, "messages": [user()]}, "Unknown agent 'nope'"),
    ({"agent": {"name": "echo", "tools": [{"name": "nope", "trust": True}]}, "messages": [user()]}, "nope"),
    ({"agent": {"name": "echo", "options": {"colour": "red"}}, "messages": [user()]}, "colour"),
    (
        {
            "agent": {"name": "echo", "tools": [{"name": "add", "trust": False}]},
            "messages": [user()],
            "tools": [{**V2_TOOL, "name": "add"}],
        },
        "collision",
    ),
]


@pytest.mark.parametrize("body,fragment", BAD_CREATES)
def test_a_bad_create_is_a_400_and_stores_nothing(api, body, fragment):
    error = assert_refusal(api.put("/v2/session", body), 400)
    assert fragment in error, error
    assert not own_sessions().exists()


def test_a_first_turn_the_agent_refuses_leaves_no_session_behind(api):
    from agents.services import agents_apply

    agents_apply([JSON_ONLY_AGENT])
    body = {"agent": {"name": "echo-json"}, "stream": "delta", "messages": [user()]}
    error = assert_refusal(api.put("/v2/session", body), 400)
    assert "does not support stream 'delta'" in error
    assert not own_sessions().exists() and not own_turns().exists()


def test_a_first_turn_behind_pending_seed_tool_calls_leaves_no_session_behind(api):
    call = {"type": "tool_use", "toolCallId": "call_1", "name": "add", "input": {"a": 1, "b": 2}}
    body = {
        "agent": {"name": "echo", "tools": [{"name": "add", "trust": False}]},
        "messages": [user("add"), {"role": "assistant", "content": [call]}, user("and?")],
    }
    error = assert_refusal(api.put("/v2/session", body), 400)
    assert "call_1" in error
    assert not own_sessions().exists()


def test_a_first_turn_over_a_tenant_limit_is_a_429_and_leaves_no_session_behind(api, settings):
    settings.AAP_TENANT_MAX_RUNNING_TURNS = 1
    settings.AAP_TENANT_MAX_QUEUED_TURNS = 0
    busy = Session.objects.get(public_id=api.create_session())
    Turn.objects.create(session=busy, status=Turn.RUNNING)  # the tenant's one running turn (no worker here)
    response = api.put("/v2/session", {"agent": {"name": "echo"}, "messages": [user()]})
    error = assert_refusal(response, 429)
    assert "limit of 1 concurrent running turns" in error
    assert response["Retry-After"]
    assert list(own_sessions()) == [busy] and own_turns().count() == 1


BAD_TURNS = [
    ({"agent": {"name": "echo"}, "messages": [user()]}, "agent.name"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "'assistant' messages only seed the history"),
    ({"messages": [{"role": "system", "content": "x"}, user()]}, "'system' messages only seed the history"),
    ({"messages": [{"role": "tool", "toolCallId": "call_x", "content": "1"}]}, "call_x"),
    ({"messages": [{"role": "tool_permission", "toolCallId": "call_y", "granted": True}]}, "call_y"),
    ({"messages": [user(), user()]}, "one user message"),
    ({"tools": [{**V2_TOOL, "parameters": {}}], "messages": [user()]}, "parameters"),
    ({"agent": {"tools": [{"name": "add"}]}, "messages": [user()]}, "trust"),
]


@pytest.mark.parametrize("body,fragment", BAD_TURNS)
def test_a_bad_turn_is_a_400_and_stores_nothing(api, body, fragment):
    session = api.create_session()
    error = assert_refusal(api.post(f"/v2/session/{session}", body), 400)
    assert fragment in error, error
    assert not own_turns().exists()


@pytest.mark.parametrize(
    "method,path",
    [
        ("get", f"/v2/session/{MISSING_SESSION}"),
        ("delete", f"/v2/session/{MISSING_SESSION}"),
        ("post", f"/v2/session/{MISSING_SESSION}"),
    ],
)
def test_an_unknown_session_is_a_404_naming_it(api, method, path):
    kwargs = {"body": {"messages": [user()]}} if method == "post" else {}
    error = assert_refusal(getattr(api, method)(path, **kwargs), 404)
    assert error == f"No session '{MISSING_SESSION}' exists for this token's tenant."


@pytest.mark.parametrize(
    "method,path",
    [
        ("put", "/v2/session"),
        ("get", "/v2/sessions"),
        ("get", f"/v2/session/{MISSING_SESSION}"),
        ("post", f"/v2/session/{MISSING_SESSION}"),
        ("delete", f"/v2/session/{MISSING_SESSION}"),
    ],
)
def test_every_session_call_needs_a_token(anonymous, method, path):
    response = getattr(anonymous, method)(path)
    assert_refusal(response, 401)
    assert response["WWW-Authenticate"] == 'Bearer realm="aap"'


def test_malformed_json_is_a_json_400(api):
    assert_refusal(api.client.put("/v2/session", data=b"{", content_type="application/json", **api.headers), 400)


def test_a_wrong_method_is_a_405_naming_the_allowed_one(api):
    error = assert_refusal(api.post("/v2/session", {}), 405)
    assert "PUT" in error


@pytest.mark.parametrize(
    "method,path",
    [
        ("put", "/v1/session"),
        ("post", "/v1/session/sess_abc"),
        ("get", "/v1/session/sess_abc"),
        ("delete", "/v1/session/x"),
    ],
)
def test_a_v2_era_path_under_v1_is_a_404_that_points_to_v2(api, method, path):
    error = assert_refusal(getattr(api, method)(path), 404)
    assert "AAP v3 under /v1/" in error and "under /v2/" in error


def test_an_unknown_v2_path_is_a_json_404(api):
    assert_refusal(api.get("/v2/nothing"), 404)
