"""`GET /v1/usage`: a tenant's own turns, model tokens and turn time, grouped by agent,
session or day — checked against the turns the test ran (the model is the fake server)."""

from __future__ import annotations

import html
from datetime import UTC, datetime, timedelta

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.support import llm_agent

from .observed import new_tenant

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def usage_llm(pg_stack):
    server = FakeOpenAI().start()
    pg_stack.apply_agents([llm_agent("usage-llm", server.url, api_key="sk-usage-operator-key")])
    yield server
    server.stop()


@pytest.fixture
def tenant_client(pg_stack):
    name = new_tenant(pg_stack)
    client = pg_stack.client(name)
    yield client
    client.close()


def usage(client, **params):
    response = client.get("/v1/usage", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_usage_matches_the_turns_a_tenant_ran(tenant_client, usage_llm, other):
    client = tenant_client
    assert usage(client)["total"] == {
        "turns": 0,
        "promptTokens": 0,
        "completionTokens": 0,
        "modelCalls": 0,
        "estimatedTurns": 0,
        "turnSeconds": 0.0,
    }
    echo_a = client.create_session("echo")
    echo_b = client.create_session("echo")
    for text in ("one", "/slow 3 100", "three"):
        assert client.turn(echo_a, text=text).stop_reason == "end_turn"
    assert client.turn(echo_b, text="/error").stop_reason == "error"
    usage_llm.enqueue(FakeOpenAI.text("first", usage=(100, 20)), FakeOpenAI.text("second", usage=(50, 7)))
    llm = client.create_session("usage-llm")
    assert client.turn(llm, text="hello", stream="delta").stop_reason == "end_turn"
    assert client.turn(llm, text="again").stop_reason == "end_turn"
    # Another tenant's turn never counts here.
    other_session = other.create_session("echo")
    assert other.turn(other_session, text="not yours").stop_reason == "end_turn"

    by_agent = usage(client, groupBy="agent")
    assert by_agent["groupBy"] == "agent"
    rows = {row["agent"]: row for row in by_agent["usage"]}
    assert set(rows) == {"echo", "usage-llm"}
    assert rows["echo"]["turns"] == 4
    assert (rows["echo"]["promptTokens"], rows["echo"]["completionTokens"], rows["echo"]["modelCalls"]) == (0, 0, 0)
    assert rows["echo"]["turnSeconds"] >= 0.2  # the /slow turn alone ran two 100 ms pauses
    assert rows["usage-llm"] | {"turnSeconds": 0} == {
        "agent": "usage-llm",
        "turns": 2,
        "promptTokens": 150,
        "completionTokens": 27,
        "modelCalls": 2,
        "estimatedTurns": 0,
        "turnSeconds": 0,
    }
    total = by_agent["total"]
    assert (total["turns"], total["promptTokens"], total["completionTokens"]) == (6, 150, 27)

    by_session = {row["sessionId"]: row["turns"] for row in usage(client, groupBy="session")["usage"]}
    assert by_session == {echo_a: 3, echo_b: 1, llm: 2}

    today = datetime.now(UTC).date()
    by_day = usage(client, groupBy="day", **{"from": today.isoformat(), "to": (today + timedelta(days=1)).isoformat()})
    assert by_day["usage"] == [{"day": today.isoformat(), **by_agent["total"]}]
    assert by_day["from"] == f"{today.isoformat()}T00:00:00Z"

    # A window that ends before these turns sees none of them.
    earlier = usage(client, to=(datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"))
    assert earlier["usage"] == [] and earlier["total"]["turns"] == 0


@pytest.mark.parametrize(
    "params, words",
    [
        ({"groupBy": "tenant"}, "groupBy must be one of"),
        ({"from": "yesterday"}, "'from' must be a date"),
        ({"to": "2026-13-45"}, "'to' must be a date"),
        ({"from": "2026-02-01", "to": "2026-01-01"}, "'from' must be before 'to'"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "at most 366 days"),
    ],
)
def test_bad_usage_queries_are_400_with_a_sentence(demo, params, words):
    response = demo.get("/v1/usage", params=params)
    assert response.status_code == 400
    assert words in response.json()["error"]


def test_usage_needs_a_token(pg_stack):
    anonymous = pg_stack.anonymous()
    try:
        response = anonymous.get("/v1/usage")
        assert response.status_code == 401
        assert "error" in response.json()
    finally:
        anonymous.close()


def test_operators_see_each_tenants_usage_in_the_admin(pg_stack, tenant_client, admin_client):
    session = tenant_client.create_session("echo")
    for text in ("a", "b"):
        assert tenant_client.turn(session, text=text).stop_reason == "end_turn"
    tenant = next(
        name for name, token in pg_stack.tokens.items() if tenant_client.http.headers["Authorization"].endswith(token)
    )
    today = datetime.now(UTC).date()

    page = admin_client.get("/admin/usage/", {"from": today.isoformat(), "to": (today + timedelta(days=1)).isoformat()})
    assert page.status_code == 200
    row = next(r for r in page.context["rows"] if r["tenant"] == tenant)
    assert (row["turns"], row["promptTokens"], row["completionTokens"]) == (2, 0, 0)
    assert f"<td>{tenant}</td><td>2</td>" in page.content.decode()
    # Before today: this tenant is not in the table.
    earlier = admin_client.get(
        "/admin/usage/", {"from": (today - timedelta(days=3)).isoformat(), "to": today.isoformat()}
    )
    assert tenant not in [r["tenant"] for r in earlier.context["rows"]]

    bad = admin_client.get("/admin/usage/", {"from": "soon"})
    assert bad.status_code == 400 and "'from' must be a date" in html.unescape(bad.content.decode())
    from django.test import Client

    assert Client().get("/admin/usage/").status_code == 302  # not signed in: to the admin login
