"""Reads of the agent registry, in the shapes AAP uses."""

import threading
from datetime import UTC, datetime

from django.db.models import Prefetch

from .models import Agent, AgentOption, ServerTool


def agents_for_tenant(tenant):
    qs = Agent.objects.for_tenant(tenant) if tenant is not None else Agent.objects.filter(enabled=True)
    return qs.prefetch_related(
        Prefetch("options", queryset=AgentOption.objects.order_by("position", "id")),
        Prefetch("server_tools", queryset=ServerTool.objects.filter(enabled=True).order_by("position", "id")),
    )


def agent_for_tenant(name: str, tenant) -> Agent | None:
    return agents_for_tenant(tenant).filter(name=name).first()


def option_info(option: AgentOption) -> dict:
    info = {"type": option.type, "name": option.name}
    if option.title:
        info["title"] = option.title
    if option.description:
        info["description"] = option.description
    if option.type == AgentOption.SELECT:
        info["options"] = list(option.choices)
    info["default"] = option.public_default()
    return info


def server_tool_specs(agent: Agent) -> list[dict]:
    """Every server tool the agent exposes: the runtime's own, then the operator's."""
    specs = list(agent.runtime.builtin_server_tools(agent.runtime_config or {}))
    specs.extend(tool.spec() for tool in agent.server_tools.all() if tool.enabled)
    return specs


def agent_info(agent: Agent) -> dict:
    """An AgentInfo as `GET /meta` shows it: no secret default ever leaves as plaintext."""
    info = {"name": agent.name}
    if agent.title:
        info["title"] = agent.title
    info["version"] = agent.version
    if agent.description:
        info["description"] = agent.description
    tools = server_tool_specs(agent)
    if tools:
        info["tools"] = tools
    options = [option_info(o) for o in agent.options.all()]
    if options:
        info["options"] = options
    info["capabilities"] = agent.capabilities()
    return info


# agent id -> (revision, agent with its options and server tools loaded); see agent_definition.
_definitions: dict[int, tuple[object, Agent]] = {}
_definitions_lock = threading.Lock()


def agent_definition(agent_id: int, revision) -> Agent:
    """The agent with its options and server tools, from this process's cache while its
    `updated_at` equals `revision` (read with the session; bumped by any change to the agent,
    its options or its tools). Every turn needs the definition; it rarely changes.

    The instance is shared between threads: read it, never modify it.
    """
    cached = _definitions.get(agent_id)
    if cached is not None and cached[0] == _revision_key(revision):
        return cached[1]
    agent = (
        Agent.objects.prefetch_related("options", "server_tools").filter(pk=agent_id).first()
    )
    if agent is None:
        raise Agent.DoesNotExist(f"agent {agent_id}")
    agent.capabilities = _frozen(agent.capabilities())
    with _definitions_lock:
        _definitions[agent_id] = (_revision_key(agent.updated_at), agent)
    return agent


def _revision_key(value):
    """updated_at as naive UTC: raw SQL reads it aware (PostgreSQL) or naive (SQLite)."""
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC).replace(tzinfo=None)
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=None)
    return value


def _frozen(value):
    """capabilities() computed once for a cached definition (callers only read it)."""
    return lambda: value
