"""Discovery: an agent's MCP servers' `tools/list`, as its server tools.

Listed once per agent revision (the agent's `updated_at`, which any change to it, its
options or its tools moves) and kept in PostgreSQL (McpToolList), with a per-process copy
keyed on the revision: /meta, session checks and turns read the list, never the servers.
`refresh` lists again (after `apply_agents` and an admin save; on a revision nobody listed
yet, whoever needs it first); a server's `notifications/tools/list_changed` stores its new
list under a new revision of the agent (`store_changed`).

Only a process that runs tenants' processes starts a stdio server: a Celery worker, or the
web process of the embedded mode (no Redis: it runs the turns). Elsewhere (the web process
and the commands of a deployment with workers) an agent with a stdio server is listed by a
worker: `request_listing` sends it the task agents.tasks.list_mcp_tools, and the tools appear
in /meta once it stored them. An agent with remote servers only is listed where it is needed,
through the network guard.

Discovery runs each server with the operator's option defaults (no tenant's values), in a
sandbox unit of its own, and stops it at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
import time
import uuid
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from infra import crypto
from infra import process as host_process

from .runtimes.acp_bridge import sandbox, workspace
from .runtimes.mcp_config import Server, servers_of, tool_name

logger = logging.getLogger("agents.mcp")

RETRY_SECONDS = 60.0  # a server that could not be listed is tried again after this long
LIST_TASK = "agents.tasks.list_mcp_tools"  # sent by name (agents.tasks)
ASKED = "The MCP server '{}' is being listed by a worker."
UNASKED = "The MCP server '{}' will be listed by a worker: the broker is unreachable now; the next read of the agent asks again."

# agent id -> (revision, when read, tools)
_cache: dict[int, tuple[object, float, list[dict], dict]] = {}
# agent id -> (revision, when a worker was asked to list it): asked once per revision and minute
_asked: dict[int, tuple[object, float]] = {}
# agent id -> held while this worker lists the agent
_listing: dict[int, threading.Lock] = {}
_lock = threading.Lock()


def starts_stdio_servers_here() -> bool:
    """Whether this process may start a stdio MCP server: a Celery worker, or the embedded
    mode's web process (no Redis, no worker: it runs the turns and their sandboxes)."""
    return bool(host_process.worker_node) or not settings.REDIS_URL


def listed_by_a_worker(agent) -> bool:
    """Whether the agent's servers must be listed by a worker rather than here."""
    return not starts_stdio_servers_here() and any(s.kind == "stdio" for s in servers_of(agent.runtime_config))


def revision_key(value):
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC).replace(tzinfo=None)
    return value


def _defaults(agent) -> dict[str, str]:
    values = {}
    for option in agent.options.all():
        values[option.name] = crypto.decrypt(option.default) if option.is_secret and option.default else option.default
    return values


def _taken(agent) -> set[str]:
    names = {spec["name"] for spec in agent.runtime.builtin_server_tools(agent.runtime_config or {})}
    return names | {tool.name for tool in agent.server_tools.all()}


def hosts_mcp_servers(agent) -> bool:
    """Whether the agent's runtime takes MCP servers as its server tools (the host runs them).
    An ACP agent's `mcpServers` are the agent's own (passed in `session/new`), not these."""
    runtime = agent.runtime
    return (
        runtime.host_executes_server_tools
        and "mcpServers" in runtime.config_schema.get("properties", {})
        and bool(servers_of(agent.runtime_config))
    )


def tools_for(agent) -> tuple[list[dict], dict]:
    """(tools, problems) of the agent's MCP servers at its current revision."""
    if not hosts_mcp_servers(agent):
        return [], {}
    key = revision_key(agent.updated_at)
    cached = _cache.get(agent.pk)
    now = time.monotonic()
    if cached is not None and cached[0] == key and not (cached[3] and now - cached[1] > RETRY_SECONDS):
        return cached[2], cached[3]
    from .models import McpToolList

    row = McpToolList.objects.filter(agent_id=agent.pk).first()
    if stale(agent, row) and listed_by_a_worker(agent):
        # Never here: a worker lists them. Meanwhile the tools listed for an earlier revision,
        # of the servers still configured (a call to one whose settings changed uses the new ones).
        request_listing(agent)
        names = {server.name for server in servers_of(agent.runtime_config)}
        tools = [tool for tool in (row.tools if row else []) if tool["server"] in names]
        listed = {tool["server"] for tool in tools}
        return tools, {name: ASKED.format(name) for name in names - listed}
    if row is None or stale(agent, row):
        tools, problems = refresh(agent)
    else:
        tools, problems = row.tools, row.problems
    with _lock:
        _cache[agent.pk] = (key, now, tools, problems)
    return tools, problems


def settled(agent) -> bool:
    """Whether the agent's MCP tools, as this process read them last, are those of its
    revision (False while a worker lists them)."""
    if not hosts_mcp_servers(agent):
        return True
    cached = _cache.get(agent.pk)
    return cached is not None and cached[0] == revision_key(agent.updated_at)


def stale(agent, row) -> bool:
    """Whether the stored list (`row`, None when there is none) must be listed again: it is of
    another revision, or a server could not be listed and a minute has passed."""
    if row is None or revision_key(row.revision) != revision_key(agent.updated_at):
        return True
    return bool(row.problems) and (timezone.now() - row.listed_at).total_seconds() > RETRY_SECONDS


def request_listing(agent, *, again: bool = False) -> bool:
    """Ask a worker to list the agent's servers (agents.tasks.list_mcp_tools): once per
    revision and minute from this process unless `again`. False (logged) when the broker is
    unreachable; whoever reads the agent next asks again."""
    from celery import current_app

    key, now = revision_key(agent.updated_at), time.monotonic()
    with _lock:
        asked = _asked.get(agent.pk)
        if not again and asked is not None and asked[0] == key and now - asked[1] < RETRY_SECONDS:
            return True
        _asked[agent.pk] = (key, now)
    task_id = f"mcp-list-{agent.pk}-{uuid.uuid4().hex}"
    try:
        current_app.send_task(
            LIST_TASK, args=(agent.pk,), task_id=task_id, queue=settings.CELERY_TASK_DEFAULT_QUEUE, ignore_result=True
        )
    except Exception:  # best effort: the admin page says the listing was not asked for
        with _lock:
            _asked.pop(agent.pk, None)
        logger.warning("asking a worker to list the MCP servers of %s failed", agent.name, exc_info=True)
        return False
    logger.info("asked a worker to list the MCP servers of agent %s", agent.name)
    return True


def list_in_worker(agent_id: int) -> None:
    """The worker's side of request_listing: list the agent's servers unless its current
    revision is listed already (the task may arrive twice, or after a newer one)."""
    from .models import Agent, McpToolList

    with _lock:
        lock = _listing.setdefault(agent_id, threading.Lock())
    with lock:  # asked twice at once (by a command and a /meta): listed once, the other reads it
        agent = Agent.objects.prefetch_related("options", "server_tools").filter(pk=agent_id).first()
        if agent is None or not agent.enabled or not hosts_mcp_servers(agent):
            return
        if not stale(agent, McpToolList.objects.filter(agent_id=agent.pk).first()):
            return
        refresh(agent)


def refresh(agent) -> tuple[list[dict], dict]:
    """List every MCP server's tools now and store them for the agent's revision (where
    listed_by_a_worker, ask a worker to and say so)."""
    from .models import McpToolList

    servers = servers_of(agent.runtime_config)
    if listed_by_a_worker(agent):
        said = ASKED if request_listing(agent, again=True) else UNASKED
        return [], {server.name: said.format(server.name) for server in servers}
    options = _defaults(agent)
    listed = _run(
        _discover(agent.name, servers, options), timeout=sum(s.start_timeout + s.timeout for s in servers) + 10
    )
    tools: list[dict] = []
    problems: dict[str, str] = {}
    taken = _taken(agent)
    for server in servers:
        outcome = listed.get(server.name)
        if isinstance(outcome, str) or outcome is None:
            problems[server.name] = outcome or f"The MCP server '{server.name}' was not listed in time."
            continue
        tools.extend(_specs(server, outcome, taken))
    if agent.pk is not None:
        McpToolList.objects.update_or_create(
            agent_id=agent.pk, defaults={"revision": agent.updated_at, "tools": tools, "problems": problems}
        )
    for name, problem in problems.items():
        logger.warning("MCP server %s/%s listed no tools: %s", agent.name, name, problem)
    return tools, problems


def _specs(server: Server, listed: list, taken: set[str]) -> list[dict]:
    specs = []
    for tool in listed:
        name = tool_name(server.name, tool.name, taken)
        taken.add(name)
        spec = {"name": name, "server": server.name, "tool": tool.name}
        if tool.title:
            spec["title"] = tool.title
        spec["description"] = tool.description or f"{tool.name} (MCP server '{server.name}')"
        spec["parameters"] = _parameters(server, tool)
        specs.append(spec)
    return specs


def _parameters(server: Server, tool) -> dict:
    """The tool's inputSchema as the server tool's parameters; one that is not a valid JSON
    Schema (the host validates every call's input with it) becomes a plain object schema."""
    import jsonschema

    schema = dict(tool.input_schema or {"type": "object", "properties": {}})
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        logger.warning(
            "MCP server %s: tool %s has an invalid inputSchema; any object is passed", server.name, tool.name
        )
        return {"type": "object"}
    return schema


def public_spec(tool: dict) -> dict:
    return {key: value for key, value in tool.items() if key not in ("server", "tool")}


def _run(coro, *, timeout: float):
    """Run `coro` on a loop of its own (callers are synchronous: admin, commands, /meta)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mcp-discovery") as pool:
        return pool.submit(asyncio.run, coro).result(timeout)


async def _discover(agent_name: str, servers: list[Server], options: dict[str, str]) -> dict:
    results = await asyncio.gather(*(_list(agent_name, server, options) for server in servers))
    return {server.name: result for server, result in zip(servers, results)}


async def _list(agent_name: str, server: Server, options: dict[str, str]):
    from .mcp.connection import Connection, McpFailure, process_spec
    from .runtimes.mcp_config import resolve

    label = f"{agent_name}/discovery/{server.name}"
    env = resolve(server.raw.get("env"), options)
    headers = resolve(server.raw.get("headers"), options)
    spec = None
    if server.kind == "stdio":
        if not starts_stdio_servers_here():  # the web process of a deployment with workers
            return ASKED.format(server.name)
        key = hashlib.sha256(f"discovery\0{agent_name}\0{server.fingerprint()}".encode()).hexdigest()
        spec = process_spec(
            server,
            key=key,
            label=label,
            unit=sandbox.unit_name("mcp-discovery", agent_name, server.name),
            home=workspace.root() / ".mcp-discovery" / agent_name / server.name,
            env=env,
        )
    connection = Connection(
        server,
        label,
        {"tenant": None, "session": None},
        spec=spec,
        headers=headers,
        secrets=(*env.values(), *headers.values()),
    )
    try:
        await connection.start()
        return await connection.list_tools()
    except McpFailure as exc:
        return str(exc)
    except Exception as exc:
        logger.exception("listing the tools of MCP server %s failed", label)
        return f"The MCP server '{server.name}' could not be listed ({type(exc).__name__})."
    finally:
        await connection.close(kill=True)


def on_tools_listed(sender, *, agent_name: str, server: Server, listed: list, **kwargs) -> None:
    """The receiver of agents.mcp.tools_listed."""
    store_changed(agent_name, server, listed)


def store_changed(agent_name: str, server: Server, listed: list) -> None:
    """A server's list changed (notifications/tools/list_changed): store it under a new
    revision of the agent, so every process reads the new tools on its next turn or /meta."""
    from .models import Agent, McpToolList

    with transaction.atomic():
        agent = Agent.objects.select_for_update().filter(name=agent_name).first()
        row = McpToolList.objects.filter(agent_id=agent.pk).first() if agent else None
        if agent is None or row is None or revision_key(row.revision) != revision_key(agent.updated_at):
            return
        taken = _taken(agent) | {t["name"] for t in row.tools if t["server"] != server.name}
        tools = [t for t in row.tools if t["server"] != server.name] + _specs(server, listed, taken)
        Agent.objects.filter(pk=agent.pk).update(updated_at=timezone.now())
        agent.refresh_from_db(fields=["updated_at"])
        row.revision, row.tools = agent.updated_at, tools
        row.save()
    logger.info("MCP server %s/%s changed its tools; %d listed", agent_name, server.name, len(listed))
