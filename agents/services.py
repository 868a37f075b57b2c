"""Writes of the agent registry: the declarative `apply_agents` format and the demo seed.

An entry has the shape of an AgentInfo in /meta plus `runtime: {kind, config}`, per-option
`default` (or `defaultEnv`, read from the environment when applied), each server tool's
host `implementation` (and `settings`), `capabilities` toggles, `tenants` and `enabled`.
Secret defaults are encrypted on the way in; "***" keeps the stored one.
"""

from __future__ import annotations

import os

from django.core.exceptions import ValidationError
from django.db import transaction

from infra import crypto
from tenancy.models import Tenant

from .models import Agent, AgentOption, ServerTool
from .runtimes import RUNTIME_KINDS
from .validation import mcp_option_error, model_source_error


class AgentFileError(Exception):
    """A registry entry that cannot be applied; the message says which and why."""


def _error(name: str, exc: Exception) -> AgentFileError:
    if isinstance(exc, ValidationError):
        parts = []
        for field, errors in exc.message_dict.items() if hasattr(exc, "error_dict") else [("", exc.messages)]:
            parts.append(f"{field}: {' '.join(errors)}" if field and field != "__all__" else " ".join(errors))
        return AgentFileError(f"Agent '{name}': " + "; ".join(parts))
    return AgentFileError(f"Agent '{name}': {exc}")


def _require(entry: dict, key: str, kind, name: str):
    if key not in entry:
        raise AgentFileError(f"Agent '{name}': '{key}' is required.")
    if not isinstance(entry[key], kind):
        raise AgentFileError(f"Agent '{name}': '{key}' has the wrong type.")
    return entry[key]


def _capability_toggles(entry: dict, name: str, runtime_cls) -> dict:
    caps = entry.get("capabilities") or {}
    if not isinstance(caps, dict):
        raise AgentFileError(f"Agent '{name}': 'capabilities' must be an object.")
    toggles = {}
    for key, names in (("history", ("full", "compacted")), ("stream", ("delta", "message", "none"))):
        supported = set(runtime_cls.supports.get(key, ()))
        unsupported = set(caps.get(key) or {}) - supported
        if unsupported:
            raise AgentFileError(
                f"Agent '{name}': runtime '{runtime_cls.kind}' does not support {key} {', '.join(sorted(unsupported))}."
            )
        # Not listed at all: everything the runtime supports; listed: exactly those.
        listed = set(caps[key]) if key in caps else supported
        toggles.update({f"{key}_{n}": n in listed for n in names})
    image = caps.get("image") or {}
    return {
        **toggles,
        "client_tools": "tools" in (caps.get("application") or {}),
        "image_http": "http" in image,
        "image_data": "data" in image,
    }


def _apply_options(agent: Agent, options: list, name: str) -> None:
    existing = {o.name: o for o in agent.options.all()}
    keep = set()
    for position, spec in enumerate(options):
        if not isinstance(spec, dict) or "name" not in spec:
            raise AgentFileError(f"Agent '{name}': every option needs a 'name'.")
        option = existing.get(spec["name"]) or AgentOption(agent=agent, name=spec["name"])
        was_secret = option.pk is not None and option.is_secret
        option.type = spec.get("type", "text")
        option.title = spec.get("title", "")
        option.description = spec.get("description", "")
        option.choices = spec.get("options", []) if option.type == AgentOption.SELECT else []
        option.position = position
        default = os.environ.get(spec["defaultEnv"], "") if "defaultEnv" in spec else spec.get("default", "")
        if not isinstance(default, str):
            raise AgentFileError(f"Agent '{name}': option '{spec['name']}' default must be a string.")
        if option.type == AgentOption.SECRET:
            if default == crypto.REDACTED:
                if not was_secret:
                    option.default = ""
            else:
                option.set_secret_default(default)
        else:
            option.default = default
        try:
            option.full_clean(exclude=["agent"])
        except ValidationError as exc:
            raise _error(name, exc) from None
        option.save()
        keep.add(option.name)
    agent.options.exclude(name__in=keep).delete()


def _apply_tools(agent: Agent, tools: list, name: str) -> None:
    existing = {t.name: t for t in agent.server_tools.all()}
    keep = set()
    for position, spec in enumerate(tools):
        if not isinstance(spec, dict) or "name" not in spec:
            raise AgentFileError(f"Agent '{name}': every server tool needs a 'name'.")
        tool = existing.get(spec["name"]) or ServerTool(agent=agent, name=spec["name"])
        tool.title = spec.get("title", "")
        tool.description = spec.get("description", "")
        tool.parameters = spec.get("parameters") or {}
        implementation = spec.get("implementation", spec["name"])
        if not isinstance(implementation, str):
            # A list or an object would reach the host tools' registry as a key and fail there.
            raise AgentFileError(f"Agent '{name}': server tool '{spec['name']}': 'implementation' must be a string.")
        tool.implementation = implementation
        tool.settings = spec.get("settings") or {}
        tool.enabled = spec.get("enabled", True)
        tool.position = position
        try:
            tool.full_clean(exclude=["agent"])
        except ValidationError as exc:
            raise _error(name, exc) from None
        tool.save()
        keep.add(tool.name)
    agent.server_tools.exclude(name__in=keep).delete()


def _apply_entry(entry: dict) -> tuple[Agent, bool]:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise AgentFileError("Every agent entry must be an object with a 'name'.")
    name = entry["name"]
    runtime = _require(entry, "runtime", dict, name)
    kind = runtime.get("kind")
    if kind not in RUNTIME_KINDS:
        raise AgentFileError(f"Agent '{name}': unknown runtime kind {kind!r}; use one of {', '.join(RUNTIME_KINDS)}.")
    from .runtimes import runtime_class

    toggles = _capability_toggles(entry, name, runtime_class(kind))
    problem = model_source_error(kind, runtime.get("config"), entry.get("options") or []) or mcp_option_error(
        runtime.get("config"), entry.get("options") or []
    )
    if problem:
        raise AgentFileError(f"Agent '{name}': {problem}")
    agent = Agent.objects.filter(name=name).first()
    created = agent is None
    agent = agent or Agent(name=name)
    agent.title = entry.get("title", "")
    agent.version = entry.get("version", "1.0.0")
    agent.description = entry.get("description", "")
    agent.runtime_kind = kind
    agent.runtime_config = runtime.get("config") or {}
    agent.enabled = entry.get("enabled", True)
    for field, value in toggles.items():
        setattr(agent, field, value)
    try:
        agent.full_clean(validate_unique=False)
    except ValidationError as exc:
        raise _error(name, exc) from None
    agent.save()
    tenant_names = entry.get("tenants") or []
    tenants = list(Tenant.objects.filter(name__in=tenant_names))
    missing = sorted(set(tenant_names) - {t.name for t in tenants})
    if missing:
        raise AgentFileError(f"Agent '{name}': unknown tenants {', '.join(missing)}; create them first.")
    agent.tenants.set(tenants)
    _apply_options(agent, entry.get("options") or [], name)
    _apply_tools(agent, entry.get("tools") or [], name)
    return agent, created


@transaction.atomic
def agents_apply(entries: list[dict], *, prune: bool = False) -> dict:
    """Create or update every agent of the file (all or nothing); `prune` removes the others."""
    if not isinstance(entries, list):
        raise AgentFileError('The file must hold a list of agents (or {"agents": [...]}).')
    # An entry without a name is refused below, with the others' errors.
    names = [str(e["name"]) for e in entries if isinstance(e, dict) and e.get("name") is not None]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise AgentFileError(f"Agents listed twice: {', '.join(repeated)}.")
    report: dict[str, list[str]] = {"created": [], "updated": [], "removed": []}
    for entry in entries:
        agent, created = _apply_entry(entry)
        report["created" if created else "updated"].append(agent.name)
    if prune:
        stale = Agent.objects.exclude(name__in=names)
        report["removed"] = list(stale.values_list("name", flat=True))
        stale.delete()
    return report


def mcp_refresh(name: str) -> list[str]:
    """List the tools of the agent's MCP servers for its current revision (after it changed),
    or ask a worker to (an agent with a stdio server, where workers run the tenants' processes);
    one line per server, saying how many tools it listed, why none, or that a worker lists it."""
    from . import mcp_registry as registry
    from .runtimes.mcp_config import servers_of

    agent = Agent.objects.prefetch_related("options", "server_tools").filter(name=name).first()
    if agent is None or not agent.enabled or not registry.hosts_mcp_servers(agent):
        return []
    tools, problems = registry.refresh(agent)
    lines = []
    for server in servers_of(agent.runtime_config):
        if server.name in problems:
            lines.append(f"agent {name}: MCP server {server.name}: {problems[server.name]}")
        else:
            count = sum(1 for tool in tools if tool["server"] == server.name)
            lines.append(f"agent {name}: MCP server {server.name}: {count} tools")
    return lines


def load_agents_file(path: str) -> list[dict]:
    data = _load(path)
    if isinstance(data, dict) and "agents" in data:
        data = data["agents"]
    return data


def _load(path: str):
    import json

    import yaml

    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        return json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise AgentFileError(f"{path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None


# --- the `tenants:` section: tenants and their limits ------------------------------------------

# The file's names for tenancy.models.LIMIT_FIELDS (null: the service's default; 0: no limit).
TENANT_LIMIT_KEYS = {
    "maxRunningTurns": "max_running_turns",
    "maxQueuedTurns": "max_queued_turns",
    "turnsPerMinute": "turns_per_minute",
    "maxSessions": "max_sessions",
    "tokensPerDay": "tokens_per_day",
}


def _apply_tenant(entry: dict) -> tuple[Tenant, bool]:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise AgentFileError("Every tenant entry must be an object with a 'name'.")
    name = entry["name"]
    unknown = sorted(set(entry) - {"name", "title", "active", "weight", "limits"})
    if unknown:
        raise AgentFileError(
            f"Tenant '{name}': unknown keys {', '.join(unknown)}; use name, title, active, weight, limits."
        )
    weight = entry.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 1000:
        raise AgentFileError(f"Tenant '{name}': 'weight' must be a whole number from 1 to 1000 (default 1).")
    limits = entry.get("limits") or {}
    if not isinstance(limits, dict):
        raise AgentFileError(f"Tenant '{name}': 'limits' must be an object.")
    unknown = sorted(set(limits) - set(TENANT_LIMIT_KEYS))
    if unknown:
        raise AgentFileError(
            f"Tenant '{name}': unknown limits {', '.join(unknown)}; the limits are {', '.join(TENANT_LIMIT_KEYS)}."
        )
    tenant = Tenant.objects.filter(name=name).first()
    created = tenant is None
    tenant = tenant or Tenant(name=name)
    if "title" in entry:
        tenant.title = entry["title"] or ""
    if "active" in entry:
        tenant.is_active = bool(entry["active"])
    if "weight" in entry:
        tenant.weight = weight
    for key, value in limits.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise AgentFileError(
                f"Tenant '{name}': limit '{key}' must be a whole number (0 for no limit) or null for the default."
            )
        setattr(tenant, TENANT_LIMIT_KEYS[key], value)
    try:
        tenant.full_clean()
    except ValidationError as exc:
        raise AgentFileError(f"Tenant '{name}': " + "; ".join(exc.messages)) from None
    tenant.save()
    return tenant, created


@transaction.atomic
def registry_apply(data, *, prune: bool = False) -> dict:
    """Apply a whole file, all or nothing: its `tenants:` (created or updated with their
    limits; never removed here) first, then its agents (see agents_apply)."""
    tenants = (data.get("tenants") or []) if isinstance(data, dict) else []
    agents = (data.get("agents") or []) if isinstance(data, dict) else data
    if isinstance(data, dict) and not {"tenants", "agents"} & set(data):
        raise AgentFileError("The file must hold a list of agents, or {tenants: [...], agents: [...]}.")
    if not isinstance(tenants, list):
        raise AgentFileError("'tenants' must be a list of tenants.")
    report: dict = {}
    if tenants:
        report["tenants"] = {"created": [], "updated": []}
    for entry in tenants:
        tenant, created = _apply_tenant(entry)
        report["tenants"]["created" if created else "updated"].append(tenant.name)
    if isinstance(data, dict) and "agents" not in data and not prune:
        return report  # a file of tenants only leaves the agents alone
    report.update(agents_apply(agents, prune=prune))
    return report


def load_registry_file(path: str):
    """A file's content for registry_apply: a list of agents, or {tenants?, agents?}."""
    return _load(path)


ECHO_AGENT = {
    "name": "echo",
    "title": "Echo",
    "version": "1.0.0",
    "description": "A deterministic agent that echoes the user's message; for tests, demos and benchmarks.",
    "runtime": {"kind": "echo", "config": {"window": 20}},
    "options": [
        {"type": "select", "name": "style", "title": "Style", "options": ["plain", "upper"], "default": "plain"},
        {"type": "text", "name": "signature", "title": "Signature", "default": ""},
        {"type": "secret", "name": "apiKey", "title": "API key", "default": crypto.REDACTED},
    ],
    "tools": [
        {
            "name": "clock",
            "title": "Clock",
            "description": "Returns the current UTC time in ISO 8601.",
            "parameters": {"type": "object", "properties": {}},
            "implementation": "clock",
        },
        {
            "name": "add",
            "title": "Add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
            "implementation": "add",
        },
    ],
    "capabilities": {
        "history": {"compacted": {}, "full": {}},
        "stream": {"delta": {}, "message": {}, "none": {}},
        "application": {"tools": {}},
        "image": {"http": {}, "data": {}},
    },
}


def assistant_agent_entry() -> dict:
    """The `assistant` agent (runtime `openai`) for `seed_demo --assistant`, defaults from the environment.

    OPENAI_BASE_URL (default OpenAI's), OPENAI_API_KEY (stored encrypted) and OPENAI_MODEL.
    """
    return {
        "name": "assistant",
        "title": "Assistant",
        "version": "1.0.0",
        "description": "A general assistant backed by an OpenAI-compatible model.",
        "runtime": {
            "kind": "openai",
            "config": {
                "systemPrompt": "You are a helpful assistant. Use the tools you are given when they help.",
                "timeoutSeconds": 120,
                "maxRetries": 2,
                "maxModelCalls": 10,
                "contextBudget": 60000,
            },
        },
        "options": [
            {
                "type": "text",
                "name": "model",
                "title": "Model",
                "default": os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
            },
            {"type": "secret", "name": "apiKey", "title": "API key", "defaultEnv": "OPENAI_API_KEY"},
            {
                "type": "text",
                "name": "baseUrl",
                "title": "Base URL",
                "default": os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1",
            },
        ],
        "tools": [
            {
                "name": "clock",
                "title": "Clock",
                "description": "Returns the current UTC time in ISO 8601.",
                "implementation": "clock",
            },
            {"name": "add", "title": "Add", "description": "Adds two numbers a and b.", "implementation": "add"},
            {
                "name": "http_fetch",
                "title": "Fetch a web page",
                "description": "GETs a public http(s) URL and returns its readable text.",
                "implementation": "http_fetch",
            },
        ],
        "capabilities": {
            "history": {"compacted": {}, "full": {}},
            "stream": {"delta": {}, "message": {}, "none": {}},
            "application": {"tools": {}},
            "image": {"http": {}, "data": {}},
        },
    }
