"""An agent's `mcpServers`: their JSON schema, what the schema cannot say, the names their
tools get, and the values (options included) that reach one tenant's server."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from .acp_bridge import limits, sandbox

SERVER_NAME = "^[A-Za-z0-9_-]{1,32}$"
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _named_values(name: dict) -> dict:
    """A list of {name, value} or {name, option, prefix?}: a value written in the configuration,
    or an option's value (a tenant's own secret, or the operator's default) after `prefix`."""
    return {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": name,
                "value": {"type": "string"},
                "option": {"type": "string", "minLength": 1},
                "prefix": {"type": "string"},
            },
            "oneOf": [{"required": ["value"], "not": {"required": ["prefix"]}}, {"required": ["option"]}],
            "additionalProperties": False,
        },
    }


SERVER_SCHEMA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": SERVER_NAME},
        "type": {"enum": ["stdio", "http"]},
        # stdio: a process in its own sandbox
        "command": {"type": "string", "minLength": 1},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": _named_values({"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}),
        "isolation": {"enum": ["session", "tenant"]},
        "egress": sandbox.EGRESS_SCHEMA,
        "limits": limits.LIMITS_SCHEMA,
        "readPaths": {"type": "array", "items": {"type": "string", "pattern": "^/"}},
        "idleSeconds": {"type": "number", "exclusiveMinimum": 0},
        # the operator's opt-out, as an ACP agent's: no confinement at all (logged at each start)
        "unsafeWithoutSandbox": {"type": "boolean"},
        # http: streamable HTTP, through the network guard
        "url": {"type": "string", "minLength": 1},
        "headers": _named_values({"type": "string", "pattern": "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"}),
        "allowPrivateAddresses": {"type": "boolean"},
        # both
        "startTimeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 600},
        "timeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
    },
}

MCP_SERVERS_SCHEMA = {
    "type": "array",
    "items": SERVER_SCHEMA,
    "description": "MCP servers whose tools become the agent's server tools (docs/llm-agent.md, MCP servers).",
}

STDIO_ONLY = (
    "command",
    "args",
    "env",
    "isolation",
    "egress",
    "limits",
    "readPaths",
    "idleSeconds",
    "unsafeWithoutSandbox",
)
HTTP_ONLY = ("url", "headers", "allowPrivateAddresses")


def kind(server: dict) -> str:
    return server.get("type") or "stdio"


def check(servers: list) -> tuple[str, str] | None:
    """What the schema cannot say, as (where, sentence); None when the servers hold."""
    seen: set[str] = set()
    for index, server in enumerate(servers or []):
        where = f"mcpServers/{index}"
        if server["name"] in seen:
            return f"{where}/name", f"'{server['name']}' names two MCP servers; give each its own name"
        seen.add(server["name"])
        if kind(server) == "stdio":
            if not server.get("command"):
                return where, "a stdio MCP server needs a 'command' (the program to run)"
            stray = [key for key in HTTP_ONLY if key in server]
        else:
            url = urlsplit(server.get("url") or "")
            if url.scheme not in ("http", "https") or not url.hostname or url.username or url.password:
                return (
                    f"{where}/url",
                    "an http MCP server needs an absolute http:// or https:// 'url' without user or password",
                )
            stray = [key for key in STDIO_ONLY if key in server]
        if stray:
            return f"{where}/{stray[0]}", f"'{stray[0]}' is not a setting of a {kind(server)} MCP server"
    return None


def options_named(servers: list) -> set[str]:
    """The options whose values the servers take (env or headers)."""
    return {
        entry["option"]
        for server in servers or []
        for entry in [*(server.get("env") or []), *(server.get("headers") or [])]
        if "option" in entry
    }


def resolve(entries: list | None, options: dict[str, str]) -> dict[str, str]:
    """name -> value of env or headers, options filled in (an empty option leaves it out)."""
    values = {}
    for entry in entries or []:
        if "option" in entry:
            value = options.get(entry["option"]) or ""
            if value:
                values[entry["name"]] = entry.get("prefix", "") + value
        else:
            values[entry["name"]] = entry["value"]
    return values


def tool_name(server: str, tool: str, taken: set[str]) -> str:
    """The server tool name of an MCP server's tool: `<server>__<tool>` when that is a valid
    tool name no one else has, else a name with a hash of both (stable: the same server and
    tool always map to the same name while the agent's other tools stay)."""
    plain = f"{server}__{tool}"
    if TOOL_NAME_RE.match(plain) and plain not in taken:
        return plain
    digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", plain)[: 64 - 11]
    return f"{stem}_{digest}"


@dataclass(frozen=True)
class Server:
    """One configured MCP server with its defaults filled in."""

    name: str
    kind: str
    raw: dict
    start_timeout: float
    timeout: float
    idle: float

    @classmethod
    def parse(cls, server: dict) -> Server:
        return cls(
            name=server["name"],
            kind=kind(server),
            raw=server,
            start_timeout=float(server.get("startTimeoutSeconds", 30)),
            timeout=float(server.get("timeoutSeconds", 60)),
            idle=float(server.get("idleSeconds", 300)),
        )

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True).encode()).hexdigest()


def servers_of(config: dict) -> list[Server]:
    return [Server.parse(server) for server in (config or {}).get("mcpServers") or []]


def server_named(config: dict, name: str) -> Server | None:
    return next((server for server in servers_of(config) if server.name == name), None)
