"""Every process caches agent definitions (agents.selectors.agent_definition); any change to
an agent, its options or its server tools moves the agent's revision, so the next turn reads
the definition again."""

from __future__ import annotations

from agents.models import Agent, AgentOption, ServerTool
from agents.selectors import agent_definition


def revision(agent: Agent):
    return Agent.objects.values_list("updated_at", flat=True).get(pk=agent.pk)


def test_option_and_tool_changes_move_the_revision_and_refresh_the_definition():
    agent = Agent.objects.create(name="definition-probe", runtime_kind="echo")
    option = AgentOption.objects.create(agent=agent, name="signature", default="one")
    first = revision(agent)
    assert [o.default for o in agent_definition(agent.pk, first).options] == ["one"]

    option.default = "two"
    option.save(update_fields=["default"])  # as rotate_secrets does: the agent row itself is not saved
    second = revision(agent)
    assert second > first
    assert [o.default for o in agent_definition(agent.pk, second).options] == ["two"]

    ServerTool.objects.create(agent=agent, name="clock", description="Current UTC time.", implementation="clock")
    third = revision(agent)
    assert third > second
    assert [t.name for t in agent_definition(agent.pk, third).server_tools] == ["clock"]

    agent.options.all().delete()
    fourth = revision(agent)
    assert fourth > third
    assert list(agent_definition(agent.pk, fourth).options) == []


def test_an_unchanged_revision_is_served_from_the_cache(django_assert_num_queries):
    agent = Agent.objects.create(name="definition-cached", runtime_kind="echo")
    current = revision(agent)
    agent_definition(agent.pk, current)
    with django_assert_num_queries(0):
        assert agent_definition(agent.pk, current).name == "definition-cached"


def test_turns_share_a_frozen_definition_never_a_model_instance():
    import dataclasses

    import pytest

    from agents.selectors import AgentDefinition, server_tool_specs

    agent = Agent.objects.create(name="definition-frozen", runtime_kind="echo")
    AgentOption.objects.create(agent=agent, name="signature", default="one")
    ServerTool.objects.create(agent=agent, name="clock", description="Current UTC time.", implementation="clock")
    definition = agent_definition(agent.pk, revision(agent))
    assert isinstance(definition, AgentDefinition) and not isinstance(definition, Agent)
    with pytest.raises(dataclasses.FrozenInstanceError):
        definition.name = "changed"  # type: ignore[misc]
    specs = server_tool_specs(definition)
    specs[0]["name"] = "changed by a caller"
    assert "changed by a caller" not in [spec["name"] for spec in server_tool_specs(definition)]
    assert [o.default_value() for o in definition.options] == ["one"]


def test_a_raw_update_that_leaves_updated_at_alone_still_reaches_every_process():
    """The unsafe opt-out set by a raw UPDATE and reverted the same way (an attacker with the
    database, a hand-made fix) must never stay in a worker's cache: the database moves the
    revision itself."""
    from django.db import connection

    agent = Agent.objects.create(name="definition-raw", runtime_kind="acp", runtime_config={"command": ["x"]})
    before = revision(agent)
    assert agent_definition(agent.pk, before).runtime_config == {"command": ["x"]}
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE agents_agent SET runtime_config = %s, updated_at = updated_at WHERE id = %s",
            ['{"command": ["x"], "unsafeWithoutSandbox": true}', agent.pk],
        )
    unsafe = revision(agent)
    assert unsafe > before
    assert agent_definition(agent.pk, unsafe).runtime_config["unsafeWithoutSandbox"] is True
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE agents_agent SET runtime_config = %s, updated_at = %s WHERE id = %s",
            ['{"command": ["x"]}', before, agent.pk],
        )
    reverted = revision(agent)
    assert reverted > unsafe
    assert "unsafeWithoutSandbox" not in agent_definition(agent.pk, reverted).runtime_config
