"""The OpenAPI document, the browsable docs and the health endpoint."""

from __future__ import annotations

import re
from urllib.parse import urljoin

import httpx
import pytest

AAP_PATHS = {
    "/v1/meta": {"get"},
    "/v1/sessions": {"get", "post"},
    "/v1/sessions/{session_id}": {"get", "delete"},
    "/v1/sessions/{session_id}/history": {"get"},
    "/v1/sessions/{session_id}/turns": {"post"},
}


@pytest.fixture(scope="module")
def document(pg_stack) -> dict:
    response = httpx.get(pg_stack.base_url + "/v1/openapi.json", timeout=60)
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
    assert document["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}


def _schema(document: dict, ref_or_schema: dict) -> dict:
    while "$ref" in ref_or_schema:
        ref_or_schema = document["components"]["schemas"][ref_or_schema["$ref"].rsplit("/", 1)[1]]
    return ref_or_schema


def test_openapi_document_describes_the_real_shapes(document):
    create = document["paths"]["/v1/sessions"]["post"]
    request = _schema(document, create["requestBody"]["content"]["application/json"]["schema"])
    assert request["required"] == ["agent"]
    assert _schema(document, request["properties"]["messages"]["items"])["type"] == "object", "messages are objects"
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


def test_docs_page_loads_with_its_static_assets(pg_stack):
    response = httpx.get(pg_stack.base_url + "/v1/docs", timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "/v1/openapi.json" in html, "the UI loads the document of this server"
    assets = set(re.findall(r"""(?:src|href)=["']([^"']*/static/[^"']+)["']""", html))
    assert any(a.endswith(".js") for a in assets), assets
    for asset in assets:
        answer = httpx.get(urljoin(pg_stack.base_url + "/v1/docs", asset), timeout=60)
        assert answer.status_code == 200, asset
        assert len(answer.content) > 100, asset


def test_health_is_ok_when_database_and_redis_answer(pg_stack):
    response = httpx.get(pg_stack.base_url + "/healthz", timeout=30)
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}
