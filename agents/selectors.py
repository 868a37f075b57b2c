"""Reads of the agent registry, in the shapes AAP uses."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import Prefetch

from infra import crypto

from . import mcp_registry as registry
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
    info: dict[str, Any] = {"type": option.type, "name": option.name}
    if option.title:
        info["title"] = option.title
    if option.description:
        info["description"] = option.description
    if option.type == AgentOption.SELECT:
        info["options"] = list(option.choices)
    info["default"] = option.public_default()
    return info


def server_tool_specs(agent: Agent | AgentDefinition) -> list[dict]:
    """Every server tool the agent exposes: the runtime's own, then the operator's."""
    if isinstance(agent, AgentDefinition):
        return copy.deepcopy(list(agent.tool_specs))
    specs = list(agent.runtime.builtin_server_tools(agent.runtime_config or {}))
    specs.extend(tool.spec() for tool in agent.server_tools.all() if tool.enabled)
    specs.extend(registry.public_spec(tool) for tool in registry.tools_for(agent)[0])
    return specs


def agent_info(agent: Agent) -> dict:
    """An AgentInfo as `GET /meta` shows it: no secret default ever leaves as plaintext."""
    info: dict[str, Any] = {"name": agent.name}
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


@dataclass(frozen=True)
class OptionDefinition:
    """An agent option as turns read it (a secret default stays encrypted)."""

    name: str
    type: str
    choices: tuple[str, ...]
    default: str

    @property
    def is_secret(self) -> bool:
        return self.type == AgentOption.SECRET

    def default_value(self) -> str:
        """The effective default (decrypted for secrets; in memory only)."""
        return crypto.decrypt(self.default) if self.is_secret else self.default

    def public_default(self) -> str:
        if self.is_secret:
            return crypto.REDACTED if self.default else ""
        return self.default


@dataclass(frozen=True)
class ServerToolDefinition:
    """A server tool's host implementation and settings."""

    name: str
    implementation: str
    settings: dict[str, Any]


@dataclass(frozen=True)
class AgentDefinition:
    """A snapshot of an agent with its options and server tools, shared by every turn of this
    process: nothing in it is a model instance, and nobody changes it (its dicts are copies
    made for it; server_tool_specs() hands out copies of its specs)."""

    pk: int
    name: str
    enabled: bool
    runtime_kind: str
    runtime_config: dict[str, Any]
    capability_map: dict[str, Any]
    options: tuple[OptionDefinition, ...]
    server_tools: tuple[ServerToolDefinition, ...]
    tool_specs: tuple[dict[str, Any], ...]
    updated_at: Any

    def capabilities(self) -> dict[str, Any]:
        return self.capability_map

    @classmethod
    def of(cls, agent: Agent) -> AgentDefinition:
        """The snapshot of an agent whose options and server tools are loaded (or loadable)."""
        return cls(
            pk=agent.pk,
            name=agent.name,
            enabled=agent.enabled,
            runtime_kind=agent.runtime_kind,
            runtime_config=copy.deepcopy(agent.runtime_config or {}),
            capability_map=agent.capabilities(),
            options=tuple(
                OptionDefinition(o.name, o.type, tuple(o.choices or ()), o.default) for o in agent.options.all()
            ),
            server_tools=tuple(
                ServerToolDefinition(t.name, t.implementation, copy.deepcopy(t.settings or {}))
                for t in agent.server_tools.all()
            )
            + tuple(
                ServerToolDefinition(t["name"], "mcp", {"server": t["server"], "tool": t["tool"]})
                for t in registry.tools_for(agent)[0]
            ),
            tool_specs=tuple(server_tool_specs(agent)),
            updated_at=agent.updated_at,
        )


def option_rows(agent: Agent | AgentDefinition) -> Iterable[AgentOption | OptionDefinition]:
    """The agent's options, from a definition or from the database."""
    return agent.options if isinstance(agent, AgentDefinition) else agent.options.all()


# agent id -> (revision, the agent's definition); see agent_definition.
_definitions: dict[int, tuple[object, AgentDefinition]] = {}
_definitions_lock = threading.Lock()


def agent_definition(agent_id: int, revision) -> AgentDefinition:
    """The agent's definition (a frozen snapshot with its options and server tools), from
    this process's cache while its `updated_at` equals `revision` (read with the session;
    bumped by any change to the agent, its options or its tools). Every turn needs the
    definition; it rarely changes."""
    cached = _definitions.get(agent_id)
    if cached is not None and cached[0] == _revision_key(revision):
        return cached[1]
    agent = Agent.objects.prefetch_related("options", "server_tools").filter(pk=agent_id).first()
    if agent is None:
        raise Agent.DoesNotExist(f"agent {agent_id}")
    definition = AgentDefinition.of(agent)
    if not registry.settled(agent):  # its MCP tools are being listed by a worker: not kept yet
        return definition
    with _definitions_lock:
        _definitions[agent_id] = (_revision_key(agent.updated_at), definition)
    return definition


def _revision_key(value):
    """updated_at as naive UTC: raw SQL reads it aware (PostgreSQL) or naive (SQLite)."""
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC).replace(tzinfo=None)
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=None)
    return value
