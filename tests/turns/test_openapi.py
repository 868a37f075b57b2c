"""The OpenAPI document and the browsable docs. The docs page rendered by a browser and the
health endpoint with Redis are tests/e2e/test_docs_browser.py and tests/e2e/test_configuration.py."""

from __future__ import annotations

import re
from urllib.parse import urljoin

import pytest

AAP_PATHS = {
    "/v1/meta": {"get"},
    "/v1/sessions": {"get", "post"},
    "/v1/sessions/{session_id}": {"get", "delete"},
    "/v1/sessions/{session_id}/history": {"get"},
    "/v1/sessions/{session_id}/turns": {"post"},
    "/v2/meta": {"get"},
    "/v2/session": {"put"},
    "/v2/session/{session_id}": {"post", "get", "delete"},
    "/v2/sessions": {"get"},
}


@pytest.fixture(scope="module")
def document(engine) -> dict:
    response = engine.request("GET", "/v1/openapi.json")
    assert response.status_code == 200, response.text[:500]
    assert "json" in response.headers["content-type"]
    return response.json()


def test_openapi_document_is_valid_openapi_3_with_the_aap_paths(document):
    from openapi_spec_validator import validate

    assert document["openapi"].startswith("3.")
    validate(document)
    for path, methods in AAP_PATHS.items():
        assert path in document["paths"], path
        assert methods <= set(document["paths"][path]), path
    assert document["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def _schema(document: dict, ref_or_schema: dict) -> dict:
    while "$ref" in ref_or_schema:
        ref_or_schema = document["components"]["schemas"][ref_or_schema["$ref"].rsplit("/", 1)[1]]
    return ref_or_schema


def test_openapi_document_describes_the_real_shapes(document):
    create = document["paths"]["/v1/sessions"]["post"]
    request = _schema(document, create["requestBody"]["content"]["application/json"]["schema"])
    assert request["required"] == ["agent"]
    variants = request["properties"]["messages"]["items"]["oneOf"]
    assert all(_schema(document, v)["type"] == "object" for v in variants), "messages are objects"
    tool = _schema(document, request["properties"]["tools"]["items"])
    assert tool["properties"]["parameters"]["type"] == "object", "parameters is a JSON Schema object"
    created = _schema(document, create["responses"]["201"]["content"]["application/json"]["schema"])
    assert set(created["properties"]) == {"sessionId"}
    for status in ("400", "401"):
        error = _schema(document, create["responses"][status]["content"]["application/json"]["schema"])
        assert "error" in error["required"]
    history = document["paths"]["/v1/sessions/{session_id}/history"]["get"]
    type_param = next(p for p in history["parameters"] if p["name"] == "type")
    assert type_param["required"] is True and set(type_param["schema"]["enum"]) == {"compacted", "full"}
    listing = document["paths"]["/v1/sessions"]["get"]
    assert {"after", "limit"} <= {p["name"] for p in listing["parameters"]}


def test_docs_page_loads_with_its_static_assets(engine):
    response = engine.request("GET", "/v1/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    # The start-up script is a file of its own (no inline script, for the CSP); it loads this server's document.
    [script] = re.findall(r"""<script src=["']([^"']*/v1/docs\?script=[^"']*)["']""", html)
    assert "/v1/openapi.json" in engine.request("GET", urljoin(engine.base_url + "/v1/docs", script)).text
    assets = set(re.findall(r"""(?:src|href)=["']([^"']*/static/[^"']+)["']""", html))
    assert any(a.endswith(".js") for a in assets), assets
    for asset in assets:
        answer = engine.request("GET", urljoin(engine.base_url + "/v1/docs", asset))
        assert answer.status_code == 200, asset
        assert len(answer.content) > 100, asset


# --- the document says what the server enforces ---------------------------------------------------


def _operation(document: dict, path: str, method: str) -> dict:
    return document["paths"][path][method]


def _parameter(operation: dict, name: str) -> dict:
    return next(p for p in operation["parameters"] if p["name"] == name)


def test_operation_ids_are_unique_and_named_after_what_they_do(document):
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)), ids
    assert {"createSession", "listSessions", "getSession", "sendTurn", "reattachTurn", "cancelTurn"} <= set(ids)


def test_generating_the_document_gives_no_warning_or_error(tmp_path):
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    env = {**os.environ, "HOSTING_VAR_DIR": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "spectacular",
            "--validate",
            "--fail-on-warn",
            "--file",
            str(tmp_path / "schema.yaml"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stderr and "Error" not in result.stderr, result.stderr


def test_the_document_states_the_limits_the_server_enforces(document):
    limit = _parameter(_operation(document, "/v1/sessions", "get"), "limit")["schema"]
    assert (limit["minimum"], limit["maximum"]) == (1, 100)
    events = _operation(document, "/v1/sessions/{session_id}/turns/{turn_id}/events", "get")
    assert _parameter(events, "Last-Event-ID")["schema"]["minimum"] == 0
    turn = _schema(
        document,
        _operation(document, "/v1/sessions/{session_id}/turns", "post")["requestBody"]["content"]["application/json"][
            "schema"
        ],
    )
    assert turn["properties"]["messages"]["minItems"] == 1
    for name, schema in document["components"]["schemas"].items():
        if name.endswith("Request") or (name.endswith("Message") and "properties" in schema):
            assert schema.get("additionalProperties") is False, name
            assert "_meta" in schema["properties"], name


def test_messages_blocks_and_events_are_schemas_not_prose(document):
    schemas = document["components"]["schemas"]
    for name in (
        "UserMessage",
        "AssistantMessage",
        "ToolMessage",
        "ToolPermissionMessage",
        "SystemMessage",
        "TextBlock",
        "ToolUseBlock",
        "ImageBlock",
        "TurnStartEvent",
        "TextDeltaEvent",
        "ToolCallEvent",
        "TurnStopEvent",
    ):
        assert schemas[name]["type"] == "object" and schemas[name]["additionalProperties"] is False, name
        assert name == "TurnStartEvent" or schemas[name]["required"], name
    stream = _operation(document, "/v1/sessions/{session_id}/turns", "post")["responses"]["200"]["content"]
    assert set(stream) == {"application/json", "text/event-stream"}
    event = _schema(document, stream["text/event-stream"]["schema"])
    names = {variant["properties"]["event"]["enum"][0] for variant in event["oneOf"]}
    assert names == {
        "turn_start",
        "text_delta",
        "thinking_delta",
        "text",
        "thinking",
        "tool_call",
        "tool_result",
        "turn_stop",
    }


def test_the_v2_era_surface_is_documented_in_its_own_shapes(document):
    schemas = document["components"]["schemas"]
    create = _operation(document, "/v2/session", "put")
    request = _schema(document, create["requestBody"]["content"]["application/json"]["schema"])
    assert request["required"] == ["agent", "messages"]
    tool = _schema(document, request["properties"]["tools"]["items"])
    assert "inputSchema" in tool["properties"] and "parameters" not in tool["properties"]
    trust = _schema(document, _schema(document, request["properties"]["agent"])["properties"]["tools"]["items"])
    assert "trust" in trust["required"]
    assert set(schemas["V2ImageBlock"]["required"]) == {"type", "mimeType", "data"}
    assert set(create["responses"]["201"]["content"]) == {"application/json"}
    stream = create["responses"]["200"]["content"]["text/event-stream"]["schema"]["oneOf"]
    assert stream[0]["properties"]["event"]["enum"] == ["session_start"]
    listing = _operation(document, "/v2/sessions", "get")["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(_schema(document, listing)["properties"]) == {"sessions", "nextCursor"}


def _validator(document: dict, schema: dict):
    import jsonschema

    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


def test_every_request_example_is_valid_and_works_when_sent_unchanged(document, demo):
    sent = 0
    for path, item in document["paths"].items():
        for method, operation in item.items():
            content = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            for name, example in content.get("examples", {}).items():
                _validator(document, content["schema"]).validate(example["value"])
                url = path.replace("{session_id}", demo.create_session("echo"))
                response = demo.http.request(method.upper(), url, json=example["value"])
                assert response.status_code in (200, 201), (path, name, response.text)
                sent += 1
    assert sent >= 4


def test_responses_match_the_documented_shapes(document, demo):
    session = demo.create_session("echo", agent={"options": {"apiKey": "sk-doc"}})
    checks = [
        ("/v1/meta", "get", demo.get("/v1/meta")),
        ("/v1/sessions", "get", demo.get("/v1/sessions")),
        ("/v1/sessions/{session_id}", "get", demo.get(f"/v1/sessions/{session}")),
        (
            "/v1/sessions/{session_id}/turns",
            "post",
            demo.post(f"/v1/sessions/{session}/turns", {"messages": [{"role": "user", "content": "/think hi"}]}),
        ),
        (
            "/v1/sessions/{session_id}/history",
            "get",
            demo.get(f"/v1/sessions/{session}/history", params={"type": "full"}),
        ),
        ("/v1/sessions", "post", demo.post("/v1/sessions", {"agent": {"name": "nope"}})),
        ("/v2/meta", "get", demo.get("/v2/meta")),
        ("/v2/sessions", "get", demo.get("/v2/sessions", params={"limit": 1})),
        ("/v2/session/{session_id}", "get", demo.get(f"/v2/session/{session}")),
        (
            "/v2/session",
            "put",
            demo.http.put(
                "/v2/session", json={"agent": {"name": "echo"}, "messages": [{"role": "user", "content": "hi"}]}
            ),
        ),
        (
            "/v2/session/{session_id}",
            "post",
            demo.post(f"/v2/session/{session}", {"messages": [{"role": "user", "content": "/think hi"}]}),
        ),
        ("/v2/session", "put", demo.http.put("/v2/session", json={"agent": {"name": "nope"}, "messages": []})),
    ]
    for path, method, response in checks:
        answer = _operation(document, path, method)["responses"][str(response.status_code)]
        _validator(document, answer["content"]["application/json"]["schema"]).validate(response.json())
