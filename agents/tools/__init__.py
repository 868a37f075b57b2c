"""Host implementations of server tools.

An operator attaches a `ServerTool` to an agent and picks one of these implementations;
the host runs it when the agent calls the tool (inline when trusted, after a granted
permission otherwise). An implementation is an async callable taking the validated input
and returning the tool result content (a string, or AAP content blocks).
"""

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

ToolContent = str | list[dict]


class ToolInputError(Exception):
    """The input does not fit the tool; the message goes back to the agent as the result."""


@dataclass(frozen=True)
class HostTool:
    name: str
    description: str
    parameters: dict
    run: Callable[[dict, dict], Awaitable[ToolContent]]
    title: str = ""
    settings: dict = field(default_factory=dict)
    operator: bool = True  # offered to the operator in admin (MCP tools are bound by discovery)


# The turn a server tool runs for (the host sets it): tools that act per tenant or session
# (MCP servers) read its tenant, session, configuration and option values.
CURRENT_TURN: ContextVar[Any] = ContextVar("aap_current_turn", default=None)

REGISTRY: dict[str, HostTool] = {}


def register(tool: HostTool) -> HostTool:
    REGISTRY[tool.name] = tool
    return tool


def implementation_choices() -> list[tuple[str, str]]:
    return [(name, tool.title or name) for name, tool in sorted(REGISTRY.items()) if tool.operator]


def get(name: str) -> HostTool | None:
    return REGISTRY.get(name)


async def run_tool(implementation: str, arguments: Any, settings: dict | None = None) -> ToolContent:
    tool = REGISTRY.get(implementation)
    if tool is None:
        raise ToolInputError(f"No host implementation named {implementation!r} is installed.")
    if not isinstance(arguments, dict):
        raise ToolInputError("Tool input must be a JSON object.")
    return await tool.run(arguments, settings or {})


from . import builtin, http_fetch, mcp  # noqa: E402,F401  (registers the built-in tools)
