"""Host tool `mcp`: a tool of one of the agent's MCP servers (agents.mcp).

Never chosen by the operator: discovery binds each listed tool to it with the settings
`{"server", "tool"}`. A call finds (or starts) the server's connection for the turn's unit —
the tenant's, or the session's with `isolation: session` — with that tenant's option values
in its environment or headers, calls the tool, and maps the result to AAP content. A server
that will not start, times out or dies answers the call with an error the model reads; the
turn goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging

from . import CURRENT_TURN, HostTool, ToolContent, ToolInputError, register

logger = logging.getLogger("agents.mcp")

_pool = None


def pool():
    global _pool
    if _pool is None:
        from ..mcp.pool import Pool

        _pool = Pool()
        atexit.register(_pool.kill_all)
    return _pool


def _connection_factory(ctx, server):
    """(key, factory) of the connection serving `server` for this turn's unit."""
    from ..mcp.connection import Connection, process_spec
    from ..runtimes.acp_bridge import sandbox, workspace
    from ..runtimes.mcp_config import resolve

    env = resolve(server.raw.get("env"), ctx.options)
    headers = resolve(server.raw.get("headers"), ctx.options)
    per_session = server.kind == "stdio" and server.raw.get("isolation", "session") == "session"
    # Units differ by every value they hold: one tenant's secret never serves another.
    identity = [ctx.tenant, ctx.agent_name, server.raw, env, headers, ctx.session_id if per_session else None]
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    label = f"{ctx.agent_name}/{ctx.tenant}/{server.name}/{key[:8]}"
    ids = {"tenant": ctx.tenant, "session": ctx.session_id if per_session else None}
    secrets = (*env.values(), *headers.values())

    def make():
        spec = None
        if server.kind == "stdio":
            directory = f"{ctx.agent_name}.mcp.{server.name}"
            if per_session:
                home = workspace.session_home(ctx.tenant, ctx.session_id, directory)
                unit = session_unit(ctx.tenant, ctx.session_id, server.name)
            else:
                home = workspace.agent_home(ctx.tenant, f"{directory}.{key[:12]}")
                unit = sandbox.unit_name("mcp", ctx.tenant, f"{directory}.{key[:12]}")
            spec = process_spec(server, key=key, label=label, unit=unit, home=home, env=env)
        return Connection(
            server, label, ids, spec=spec, headers=headers, secrets=secrets, on_tools_changed=_changed(ctx)
        )

    return key, make


def session_unit(tenant: str, session_id: str, server: str) -> str:
    from ..runtimes.acp_bridge import sandbox

    return sandbox.unit_name("mcp", tenant, f"{session_id}.mcp.{server}")


async def session_deleted(*, session_id: str, tenant: str, config: dict) -> None:
    """A deleted session: its own servers stop (here, and in every worker, told through Redis),
    its servers' HOMEs are removed and their uids given back."""
    import asyncio

    from ..runtimes.acp_bridge import routing, sandbox, workspace
    from ..runtimes.mcp_config import servers_of

    servers = [server for server in servers_of(config) if server.kind == "stdio"]
    if not servers:
        return
    await pool().drop_session(session_id)
    with contextlib.suppress(Exception):
        await routing.announce_deleted(session_id)
    try:
        await asyncio.to_thread(workspace.remove_workspace, tenant, session_id)
        for server in servers:
            await asyncio.to_thread(sandbox.release_unit, session_unit(tenant, session_id, server.name))
    except ValueError:  # a tenant or session id that names no directory: nothing was made for it
        pass


def _changed(ctx):
    agent_name = ctx.agent_name

    def on_tools_changed(connection) -> None:
        import asyncio

        async def relist() -> None:
            from ..mcp import tools_listed

            try:
                listed = await connection.list_tools()
                await asyncio.to_thread(
                    tools_listed.send, sender=None, agent_name=agent_name, server=connection.server, listed=listed
                )
            except Exception:
                logger.exception("listing the changed tools of MCP server %s failed", connection.label)

        asyncio.get_running_loop().create_task(relist())

    return on_tools_changed


def content_of(result) -> ToolContent:
    """An MCP CallToolResult as AAP tool_result content: text (text, embedded text resources,
    structured content when no text says it), images as data: URIs; isError marked."""
    import mcp_types as types

    blocks: list[dict] = []
    for item in result.content or []:
        if isinstance(item, types.TextContent):
            blocks.append({"type": "text", "text": item.text})
        elif isinstance(item, types.ImageContent):
            blocks.append({"type": "image", "url": f"data:{item.mime_type};base64,{item.data}"})
        elif isinstance(item, types.EmbeddedResource):
            resource = item.resource
            if isinstance(resource, types.TextResourceContents):
                blocks.append({"type": "text", "text": resource.text})
            else:
                blocks.append({"type": "text", "text": f"[binary resource {resource.uri} ({resource.mime_type})]"})
        elif isinstance(item, types.ResourceLink):
            blocks.append({"type": "text", "text": f"[resource {item.name}: {item.uri}]"})
        elif isinstance(item, types.AudioContent):
            blocks.append({"type": "text", "text": f"[audio ({item.mime_type}) left out]"})
    if result.structured_content is not None and not any(b["type"] == "text" for b in blocks):
        blocks.append({"type": "text", "text": json.dumps(result.structured_content, ensure_ascii=False)})
    if result.is_error:
        text = "\n".join(b["text"] for b in blocks if b["type"] == "text")
        blocks = [{"type": "text", "text": f"Error: {text}" if text else "Error"}] + [
            b for b in blocks if b["type"] != "text"
        ]
    if all(block["type"] == "text" for block in blocks):
        return "\n".join(block["text"] for block in blocks)
    return blocks


async def _run(arguments: dict, settings: dict) -> ToolContent:
    from mcp.shared.exceptions import MCPError

    from ..mcp.connection import McpFailure
    from ..runtimes.mcp_config import server_named

    ctx = CURRENT_TURN.get()
    if ctx is None:
        raise ToolInputError("MCP tools run only within a turn.")
    server = server_named(ctx.config, settings.get("server", ""))
    if server is None:
        raise ToolInputError(f"The MCP server '{settings.get('server')}' is no longer configured for this agent.")
    key, make = _connection_factory(ctx, server)
    try:
        connection = await pool().get(key, make)
        result = await connection.call_tool(settings["tool"], arguments)
    except McpFailure as exc:
        logger.error("MCP tool %s of server %s failed: %s", settings["tool"], server.name, exc, exc_info=True)
        raise ToolInputError(str(exc)) from None
    except MCPError as exc:  # a JSON-RPC error: the server refused the call (unknown tool, bad input)
        raise ToolInputError(f"The MCP server '{server.name}' refused the call: {exc}") from None
    return content_of(result)


register(
    HostTool(
        name="mcp",
        title="A tool of an MCP server",
        description="Calls a tool of one of the agent's MCP servers.",
        parameters={"type": "object"},
        run=_run,
        operator=False,
    )
)
