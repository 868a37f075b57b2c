"""MCP servers as server tools of an agent.

An agent lists MCP servers in its runtime configuration (`mcpServers`, the shape ACP's
`session/new` takes): agents.runtimes.mcp_config (schema, names, option values), agents.mcp_registry (discovery: their
`tools/list` as the agent's server tools, per agent revision), `connection` (the SDK's client
sessions: stdio servers in the ACP sandbox, remote ones through the network guard), `pool`
(a process's connections: reused, reaped when idle, stopped with their session). The
host tool that calls them is agents.tools.mcp. See docs/llm-agent.md, "MCP servers".
"""

from django.dispatch import Signal

# A connected server said its tools changed (notifications/tools/list_changed) and was listed
# again: kwargs agent_name, server (mcp_config.Server), listed (its tools). The registry stores
# them (connected in agents.apps); the host tool that notices does not import the registry.
tools_listed = Signal()
