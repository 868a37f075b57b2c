"""`GET /v1/meta`: capability discovery, public or per tenant, never revealing a secret default."""

from __future__ import annotations

import pytest

SMALL_SECRET_DEFAULT = "sk-small-window-default"  # tests/agents.yaml


def by_name(meta: dict) -> dict[str, dict]:
    names = [agent["name"] for agent in meta["agents"]]
    assert len(names) == len(set(names)), f"an agent is listed twice: {names}"
    return {agent["name"]: agent for agent in meta["agents"]}


@pytest.fixture(scope="module")
def public_meta(engine) -> dict:
    client = engine.anonymous()
    meta = client.meta()
    client.close()
    return meta


def test_public_meta_lists_only_enabled_agents_open_to_every_tenant(public_meta, db_access):
    from agents.models import Agent

    agents = by_name(public_meta)
    assert public_meta["version"] == 3
    assert {"echo", "echo-small", "echo-bare"} <= set(agents)
    assert "echo-private" not in agents, "an agent restricted to a tenant is not public"
    assert "echo-off" not in agents, "a disabled agent is not listed"
    open_to_all = set(Agent.objects.filter(enabled=True, tenants__isnull=True).values_list("name", flat=True))
    assert set(agents) == open_to_all


def test_meta_with_a_token_lists_what_that_tenant_may_use(demo, other, db_access):
    from agents.models import Agent
    from tenancy.models import Tenant

    for client, tenant in ((demo, "demo"), (other, "other")):
        agents = by_name(client.meta())
        allowed = set(Agent.objects.for_tenant(Tenant.objects.get(name=tenant)).values_list("name", flat=True))
        assert set(agents) == allowed, tenant
        assert "echo-off" not in agents
    assert "echo-private" in by_name(other.meta())
    assert "echo-private" not in by_name(demo.meta())


def test_echo_is_described_as_seeded(public_meta):
    echo = by_name(public_meta)["echo"]
    assert echo["version"] == "1.0.0"
    assert echo["title"] == "Echo"
    options = {option["name"]: option for option in echo["options"]}
    assert options["style"] == {
        "type": "select",
        "name": "style",
        "title": "Style",
        "options": ["plain", "upper"],
        "default": "plain",
    }
    assert options["signature"]["type"] == "text" and options["signature"]["default"] == ""
    assert options["apiKey"]["type"] == "secret"
    tools = {tool["name"]: tool for tool in echo["tools"]}
    assert set(tools) == {"clock", "add"}
    assert tools["add"]["parameters"]["properties"] == {"a": {"type": "number"}, "b": {"type": "number"}}
    assert tools["clock"]["description"]
    assert echo["capabilities"] == {
        "history": {"compacted": {}, "full": {}},
        "stream": {"delta": {}, "message": {}, "none": {}},
        "application": {"tools": {}},
        "image": {"http": {}, "data": {}},
    }


def test_capabilities_follow_the_admin_toggles(public_meta):
    agents = by_name(public_meta)
    # echo-bare turns off client tools and images; echo-small only client tools on.
    assert "application" not in agents["echo-bare"]["capabilities"]
    assert "image" not in agents["echo-bare"]["capabilities"]
    assert agents["echo-small"]["capabilities"]["application"] == {"tools": {}}
    assert "image" not in agents["echo-small"]["capabilities"]


def test_secret_defaults_are_never_revealed(engine, public_meta, demo, other):
    for meta in (public_meta, demo.meta(), other.meta()):
        agents = by_name(meta)
        small = {option["name"]: option for option in agents["echo-small"]["options"]}
        assert small["apiKey"]["default"] == "***", "a stored secret default shows as ***"
        echo = {option["name"]: option for option in agents["echo"]["options"]}
        assert echo["apiKey"]["default"] == "", "no stored secret default shows as an empty string"
    for client in (engine.anonymous(), demo, other):
        text = client.get("/v1/meta").text
        assert SMALL_SECRET_DEFAULT not in text
        assert "gAAAAA" not in text, "not even the ciphertext leaves the server"


def test_every_secret_option_in_meta_is_redacted(engine, public_meta, db_access):
    from agents.models import AgentOption

    listed = {
        (agent["name"], option["name"]): option
        for agent in public_meta["agents"]
        for option in agent.get("options", [])
    }
    for option in AgentOption.objects.filter(type="secret").select_related("agent"):
        key = (option.agent.name, option.name)
        if key in listed:
            assert listed[key]["default"] == ("***" if option.default else ""), key
