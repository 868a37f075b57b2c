"""MCP servers as server tools of an agent.

An agent lists MCP servers in its runtime configuration (`mcpServers`, the shape ACP's
`session/new` takes): `config` (schema, names, option values), `registry` (discovery: their
`tools/list` as the agent's server tools, per agent revision), `connection` (the SDK's client
sessions: stdio servers in the ACP sandbox, remote ones through the network guard), `pool`
(a process's connections: reused, reaped when idle, stopped with their session). The
host tool that calls them is agents.tools.mcp. See docs/llm-agent.md, "MCP servers".
"""
