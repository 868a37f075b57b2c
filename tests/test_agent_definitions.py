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
    assert [o.default for o in agent_definition(agent.pk, first).options.all()] == ["one"]

    option.default = "two"
    option.save(update_fields=["default"])  # as rotate_secrets does: the agent row itself is not saved
    second = revision(agent)
    assert second > first
    assert [o.default for o in agent_definition(agent.pk, second).options.all()] == ["two"]

    ServerTool.objects.create(agent=agent, name="clock", description="Current UTC time.", implementation="clock")
    third = revision(agent)
    assert third > second
    assert [t.name for t in agent_definition(agent.pk, third).server_tools.all()] == ["clock"]

    agent.options.all().delete()
    fourth = revision(agent)
    assert fourth > third
    assert list(agent_definition(agent.pk, fourth).options.all()) == []


def test_an_unchanged_revision_is_served_from_the_cache(django_assert_num_queries):
    agent = Agent.objects.create(name="definition-cached", runtime_kind="echo")
    current = revision(agent)
    agent_definition(agent.pk, current)
    with django_assert_num_queries(0):
        assert agent_definition(agent.pk, current).name == "definition-cached"
