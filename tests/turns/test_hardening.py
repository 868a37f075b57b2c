"""Hand-made inputs at the edges of the API: host names, NUL bytes and other JSON PostgreSQL
refuses, Unicode digits, unknown properties, access taken away mid-session,
what a tenant may learn of the operator's key, and the production settings check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.core.management import CommandError

from tests.support import ROOT

from .test_auth import manage
from .test_errors import assert_json_error

USER_HI = [{"role": "user", "content": "hi"}]
DB_ERROR_WORDS = ("DataError", "CONTEXT:", "unsupported Unicode escape", "\\u0000 cannot be converted")


# --- 2. ALLOWED_HOSTS applies to the API too ---------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/meta", "/v1/sessions", "/v1/docs", "/v1/openapi.json", "/admin/login/", "/nowhere"]
)
def test_a_host_outside_allowed_hosts_gets_a_json_400_everywhere(engine, path):
    token = engine.tokens["demo"]
    response = engine.request("GET", path, headers={"Host": "evil.example", "Authorization": f"Bearer {token}"})
    error = assert_json_error(response, 400)
    assert "Host" in error
    assert "agents" not in response.text and "sess_" not in response.text


def test_a_dns_rebinding_page_cannot_read_the_public_catalogue(engine):
    assert engine.request("GET", "/v1/meta").status_code == 200, "the right host still answers"
    response = engine.request("GET", "/v1/meta", headers={"Host": "attacker.example:8000"})
    assert_json_error(response, 400)


def test_healthz_answers_whatever_the_host(engine):
    for host in ("evil.example", "10.0.0.7:8000", "aap-web"):
        response = engine.request("GET", "/healthz", headers={"Host": host})
        assert response.status_code == 200, (host, response.text)
        assert response.json()["status"] == "ok"


# --- 4. NUL and other JSON PostgreSQL refuses --------------------------------------------------

NUL_TOOL = {"name": "lookup", "description": "Looks up.", "parameters": {"type": "object", "description": "a\u0000b"}}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"agent": {"name": "echo"}, "tools": [NUL_TOOL]}, "tools.0.parameters"),
        (
            {
                "agent": {"name": "echo"},
                "tools": [{**NUL_TOOL, "parameters": {"type": "object", "properties": {"x\u0000": {}}}}],
            },
            "tools.0.parameters",
        ),
        (
            {
                "agent": {"name": "echo"},
                "messages": [
                    {"role": "user", "content": "go"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "toolCallId": "call_1", "name": "mytool", "input": {"q": "\u0000"}}
                        ],
                    },
                ],
            },
            "messages.1.content.0.input",
        ),
    ],
    ids=["nul in parameters", "nul in a key", "nul in a seeded tool_use input"],
)
def test_json_postgresql_refuses_is_a_400_naming_the_field_at_creation(demo, engine, body, field):
    response = demo.http.post("/v1/sessions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    error = assert_json_error(response, 400)
    assert field in error, error
    assert "NUL" in error


def test_nul_in_tools_on_a_turn_is_a_400_and_nothing_is_stored(demo):
    session = demo.create_session("echo")
    response = demo.post(f"/v1/sessions/{session}/turns", {"messages": USER_HI, "tools": [NUL_TOOL]})
    assert "tools.0.parameters" in assert_json_error(response, 400)
    assert demo.history(session) == [], "the refused turn stored nothing"
    assert "tools" not in demo.get(f"/v1/sessions/{session}").json()
    assert demo.turn(session, text="still fine").stop_reason == "end_turn"


@pytest.mark.parametrize("suffix", ["", "/history", "/turns/turn_%00x", "/turns/turn_x%00/events"])
def test_a_nul_or_another_character_outside_ids_in_a_path_is_a_json_404(demo, suffix):
    session = demo.create_session("echo")
    for bad in (f"{session}%00", "sess_%C3%A9", "sess_x.y"):
        path = f"/v1/sessions/{bad}{suffix}" if "%00" not in suffix else f"/v1/sessions/{session}{suffix}"
        assert_json_error(demo.http.get(path), 404)
    assert demo.get(f"/v1/sessions/{session}").status_code == 200, "the same session by its id"


def test_an_agent_tool_call_with_nul_is_stored_faithfully_and_ends_with_a_clear_error(demo, captured):
    tool = {"name": "mytool", "description": "A client tool.", "parameters": {"type": "object"}}
    session = demo.create_session("echo", tools=[tool])
    # The user's text holds the six characters \u0000; echo decodes them into a real NUL.
    result = demo.turn(session, text='/tool mytool {"q": "a\\u0000b"}', stream="delta")
    assert result.status == 200
    stop = result.events[-1]
    assert stop.event == "turn_stop" and stop.data["stopReason"] == "error"
    assert "NUL" in stop.data["_meta"]["error"]
    [call] = result.tool_calls()
    assert call["input"] == {"q": "a\u0000b"}
    history = demo.history(session)
    assert history[-1]["content"][0]["input"] == {"q": "a\u0000b"}, "the call is in history as produced"
    # Nothing is left pending: the session takes a plain user message next.
    assert demo.turn(session, text="next").stop_reason == "end_turn"
    logs = json.dumps(captured())
    assert not [word for word in DB_ERROR_WORDS if word in logs], "no database error text in any log"


# --- 5. small 500s and slips -------------------------------------------------------------------


@pytest.mark.parametrize("value", ["²", "١٢", "-1", "1.0", "9" * 40])
def test_a_last_event_id_that_is_not_ascii_digits_is_a_400(demo, value):
    session = demo.create_session("echo")
    turn = demo.turn(session, text="hi", stream="delta")
    path = f"/v1/sessions/{session}/turns/{turn.turn_id}/events"
    assert "Last-Event-ID" in assert_json_error(demo.get(path, params={"after": value}), 400)
    try:
        header = value.encode("latin-1")  # "²" goes as the single byte 0xB2
    except UnicodeEncodeError:
        header = value.encode()  # other digits as their UTF-8 bytes
    assert_json_error(demo.http.get(path, headers={"Last-Event-ID": header}), 400)


def test_a_sessions_cursor_of_unicode_digits_is_a_400(demo):
    import base64

    for cursor in ["²", base64.urlsafe_b64encode("s1:²".encode()).decode().rstrip("=")]:
        assert "cursor" in assert_json_error(demo.get("/v1/sessions", params={"after": cursor}), 400)


def test_create_token_refuses_zero_days(engine):
    with pytest.raises(CommandError, match="1 or more"):
        manage("create_token", "demo", "--expires-in-days", "0")
    out = manage("create_token", "demo", "--expires-in-days", "1")
    token = out.strip().splitlines()[-1]
    assert engine.request("GET", "/v1/sessions", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def _apply(tmp_path, tenants: list[str]) -> None:
    import yaml

    agent = {
        "name": "echo-restricted-later",
        "title": "Open, then restricted",
        "version": "1.0.0",
        "runtime": {"kind": "echo"},
        "tenants": tenants,
    }
    path = tmp_path / f"agents-{len(tenants)}.yaml"
    path.write_text(yaml.safe_dump({"agents": [agent]}))
    manage("apply_agents", str(path))


def test_restricting_an_agent_stops_turns_on_sessions_created_before(demo, tmp_path):
    _apply(tmp_path, [])
    session = demo.create_session("echo-restricted-later")
    assert demo.turn(session, text="hi").stop_reason == "end_turn"
    _apply(tmp_path, ["other"])
    try:
        refused = demo.post(f"/v1/sessions/{session}/turns", {"messages": USER_HI})
        assert "no longer available" in assert_json_error(refused, 400)
        history = demo.history(session)
        assert [m["role"] for m in history] == ["user", "assistant"], "the refused turn stored nothing"
    finally:
        _apply(tmp_path, [])
    assert demo.turn(session, text="open again").stop_reason == "end_turn"


# --- 7. the server refuses what the document refuses --------------------------------------------


@pytest.mark.parametrize(
    "body, unknown",
    [
        ({"agent": {"name": "echo"}, "colour": "red"}, "colour"),
        ({"agent": {"name": "echo", "model": "x"}}, "agent.model"),
        ({"agent": {"name": "echo", "tools": [{"name": "clock", "trusted": True}]}}, "agent.tools.0.trusted"),
        (
            {"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
            "messages.0.name",
        ),
        (
            {
                "agent": {"name": "echo"},
                "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "lang": "en"}]}],
            },
            "messages.0.content.0.lang",
        ),
    ],
)
def test_unknown_properties_are_refused_naming_them(demo, body, unknown):
    error = assert_json_error(demo.post("/v1/sessions", body), 400)
    assert unknown in error and "Unknown property" in error


def test_meta_objects_are_accepted_and_ignored(demo):
    body = {
        "agent": {"name": "echo", "_meta": {"ui": 1}},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "_meta": {}}], "_meta": {"id": 7}}],
        "_meta": {"trace": "abc"},
    }
    response = demo.post("/v1/sessions", body)
    assert response.status_code == 201, response.text
    assert demo.history(response.json()["sessionId"]) == body["messages"], "stored exactly as sent"
    assert_json_error(demo.post("/v1/sessions", {**body, "_meta": "not an object"}), 400)


# --- 6. HTTPS settings: manage.py check --deploy ------------------------------------------------

PRODUCTION_ENV = {
    "DEBUG": "false",
    "SECRET_KEY": "x" * 20 + "-production-like-secret-key-with-enough-variety-0123456789",
    "ALLOWED_HOSTS": "aap.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://aap.example.com",
    "AAP_HTTPS": "true",
    "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https",
}


def test_check_deploy_is_clean_with_the_documented_production_settings(tmp_path):
    env = {**os.environ, **PRODUCTION_ENV, "HOSTING_VAR_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_warns_without_them(tmp_path):
    env = {
        **os.environ,
        "DEBUG": "false",
        "HOSTING_VAR_DIR": str(tmp_path),
        "AAP_HTTPS": "false",
        "SECRET_KEY": PRODUCTION_ENV["SECRET_KEY"],
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr + result.stdout, warning


def test_admin_and_docs_pages_carry_a_content_security_policy_and_the_api_stays_json(engine):
    for path in ("/v1/docs", "/admin/login/"):
        response = engine.request("GET", path)
        assert response.status_code == 200, path
        policy = response.headers["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
        assert "<script>" not in response.text, f"{path} has an inline script the policy would block"
    assert "Content-Security-Policy" not in engine.request("GET", "/v1/meta").headers
