"""An ACP agent's runtime configuration: its JSON schema (checked when the operator saves the
agent) and the parsed form a turn reads, defaults filled in."""

from __future__ import annotations

from dataclasses import dataclass

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
    },
}


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
        )
