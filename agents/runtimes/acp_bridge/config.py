"""An ACP agent's runtime configuration: its JSON schema (checked when the operator saves the
agent) and the parsed form a turn reads, defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from . import limits, sandbox

ENV_NAME = {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}

NAME_VALUES = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "value"],
        "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
        "additionalProperties": False,
    },
}

# The model gateway (gateway.py): the agent gets the gateway's URL and a token of its own in
# these variables; the key option's value stays in the worker.
GATEWAY_SCHEMA = {
    "type": "object",
    "required": ["baseUrl", "keyOption", "env"],
    "additionalProperties": False,
    "properties": {
        "baseUrl": {"type": "string", "minLength": 1},
        "keyOption": {"type": "string", "minLength": 1},
        "env": {
            "type": "object",
            "required": ["baseUrl", "apiKey"],
            "additionalProperties": False,
            "properties": {"baseUrl": ENV_NAME, "apiKey": ENV_NAME},
        },
    },
}
# Set by the sandbox itself: a gateway variable of these names would never reach the agent.
FIXED_ENV = frozenset(
    name
    for base in ("HOME", "TMPDIR", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
    for name in (base, base.lower())
)

CONFIG_SCHEMA = {
    "type": "object",
    "required": ["command"],
    "additionalProperties": False,
    "properties": {
        "command": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "env": {"type": "object", "propertyNames": ENV_NAME, "additionalProperties": {"type": "string"}},
        "options": {
            "type": "object",
            "additionalProperties": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["env"],
                        "properties": {"env": ENV_NAME},
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "required": ["configOption"],
                        "properties": {"configOption": {"type": "string", "minLength": 1}},
                        "additionalProperties": False,
                    },
                ]
            },
        },
        "mcpServers": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "type": {"enum": ["stdio", "http", "sse"]},
                    "command": {"type": "string"},
                    "args": {"type": "array", "items": {"type": "string"}},
                    "env": NAME_VALUES,
                    "url": {"type": "string"},
                    "headers": NAME_VALUES,
                },
                "additionalProperties": False,
            },
        },
        "terminal": {"type": "boolean"},
        "idleSeconds": {"type": "number", "exclusiveMinimum": 0},
        "permissionTimeoutSeconds": {"type": "number", "exclusiveMinimum": 0},
        "hangTimeoutSeconds": {"type": "number", "exclusiveMinimum": 0},
        "startTimeoutSeconds": {"type": "number", "exclusiveMinimum": 0},
        "terminalTimeoutSeconds": {"type": "number", "exclusiveMinimum": 0},
        "terminalOutputBytes": {"type": "integer", "minimum": 1},
        "maxFileBytes": {"type": "integer", "minimum": 1},
        # The sandbox (docs/acp-agents.md): who shares a process and a uid, where it may connect,
        # its limits, what else it may read, and the explicit opt-out.
        "isolation": {"enum": ["session", "tenant"]},
        "egress": sandbox.EGRESS_SCHEMA,
        "limits": limits.LIMITS_SCHEMA,
        "readPaths": {"type": "array", "items": {"type": "string", "pattern": "^/"}},
        "unsafeWithoutSandbox": {"type": "boolean"},
        "gateway": GATEWAY_SCHEMA,
    },
}


def check(config: dict) -> tuple[str, str] | None:
    """What the schema cannot say, as (where, sentence); None when the configuration holds."""
    gateway = config.get("gateway")
    if not gateway:
        return None
    url = urlsplit(gateway["baseUrl"])
    try:
        url.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        url = urlsplit("")
    if url.scheme not in ("http", "https") or not url.hostname or url.username or url.password:
        return "gateway/baseUrl", "must be an absolute http:// or https:// URL without user or password"
    if url.query or url.fragment:
        return "gateway/baseUrl", "must have no query string or fragment"
    key_option = gateway["keyOption"]
    routes = config.get("options") or {}
    if key_option in routes:
        how = "env" if "env" in routes[key_option] else "configOption"
        return (
            f"options/{key_option}",
            f"option '{key_option}' is the gateway's key (gateway/keyOption), which stays in the worker; "
            f"remove its route to {how}",
        )
    url_env, key_env = gateway["env"]["baseUrl"], gateway["env"]["apiKey"]
    if url_env == key_env:
        return "gateway/env", f"baseUrl and apiKey need two variables, not {url_env} twice"
    for name in (url_env, key_env):
        if name in FIXED_ENV:
            return "gateway/env", f"{name} is set by the sandbox itself; choose another variable"
        if name in (config.get("env") or {}):
            return "gateway/env", f"{name} is also set in env; the gateway sets it"
        for option, route in routes.items():
            if route.get("env") == name:
                return "gateway/env", f"{name} is also the route of option '{option}'; the gateway sets it"
    return None


@dataclass(frozen=True)
class Gateway:
    """The `gateway` of a configuration: the agent's model endpoint, reached through the worker."""

    base_url: str
    key_option: str
    url_env: str
    key_env: str

    @classmethod
    def parse(cls, gateway: dict | None) -> Gateway | None:
        if not gateway:
            return None
        return cls(
            base_url=gateway["baseUrl"],
            key_option=gateway["keyOption"],
            url_env=gateway["env"]["baseUrl"],
            key_env=gateway["env"]["apiKey"],
        )


@dataclass(frozen=True)
class Config:
    """A validated runtime configuration with its defaults filled in."""

    command: tuple[str, ...]
    env: dict
    options: dict
    mcp_servers: list
    terminal: bool
    idle: float
    permission_timeout: float
    hang: float
    start_timeout: float
    terminal_timeout: float
    terminal_output_bytes: int
    max_file_bytes: int
    isolation: str
    egress: tuple[str, ...]
    limits: limits.Limits
    read_paths: tuple[str, ...]
    unsafe: bool
    gateway: Gateway | None

    @classmethod
    def parse(cls, config: dict) -> Config:
        return cls(
            command=tuple(config.get("command") or ()),
            env=dict(config.get("env") or {}),
            options=dict(config.get("options") or {}),
            mcp_servers=list(config.get("mcpServers") or []),
            terminal=bool(config.get("terminal", False)),
            idle=float(config.get("idleSeconds", 600)),
            permission_timeout=float(config.get("permissionTimeoutSeconds", 600)),
            hang=float(config.get("hangTimeoutSeconds", 300)),
            start_timeout=float(config.get("startTimeoutSeconds", 60)),
            terminal_timeout=float(config.get("terminalTimeoutSeconds", 120)),
            terminal_output_bytes=int(config.get("terminalOutputBytes", 64 * 1024)),
            max_file_bytes=int(config.get("maxFileBytes", 1024 * 1024)),
            isolation=config.get("isolation", "session"),
            egress=tuple(config.get("egress") or ()),
            limits=limits.Limits.parse(config.get("limits")),
            read_paths=tuple(config.get("readPaths") or ()),
            unsafe=bool(config.get("unsafeWithoutSandbox", False)),
            gateway=Gateway.parse(config.get("gateway")),
        )
