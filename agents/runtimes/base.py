"""The one interface every agent runtime implements.

A runtime turns a turn's incoming messages into AAP events through `ctx.emit` and returns
its stop reason. It speaks in AAP messages and events only, never in HTTP or database rows.
The host (sessions_app.engine.host) does what is the same for every runtime: stream-mode shaping,
folding events into messages, persistence, permissions, server tool execution and turning
exceptions into `turn_stop` `error`.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from aap.types import HISTORY_TYPES, STOP_REASONS, STREAM_MODES, StopReason  # noqa: F401 (re-exported)


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex


@dataclass(frozen=True)
class ServerToolBinding:
    """A server tool enabled on the session: its public spec, trust, and host implementation."""

    spec: dict
    trust: bool
    implementation: str = ""
    settings: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass(frozen=True)
class ToolCall:
    toolCallId: str
    name: str
    input: dict

    def as_event(self) -> dict:
        return {"event": "tool_call", "toolCallId": self.toolCallId, "name": self.name, "input": self.input}


@dataclass
class ToolOutcome:
    """What became of one tool call: a result now, or pending on the application."""

    call: ToolCall
    content: Any = None  # str | list[dict]; set when resolved
    pending: Literal["client", "permission"] | None = None

    @property
    def resolved(self) -> bool:
        return self.pending is None


@dataclass
class PermissionAnswer:
    """The application's answer to a pending untrusted server tool call."""

    call: ToolCall
    granted: bool
    reason: str | None = None


@dataclass
class Compaction:
    """A rewrite of the compacted history: keep the last `keep_last` messages, prefix `summary`."""

    keep_last: int
    summary: list[dict] = field(default_factory=list)


class TurnContext(Protocol):
    """What the host gives a runtime for one turn."""

    session_id: str
    turn_id: str
    tenant: str
    agent_name: str
    config: dict
    options: dict[str, str]  # effective values, secrets decrypted (in memory only)
    options_set: frozenset[str]  # the option names the application set (the others are defaults)
    server_tools: dict[str, ServerToolBinding]
    client_tools: dict[str, dict]
    history: list[dict]  # the compacted history, ending with this turn's incoming messages
    incoming: list[dict]  # the messages this turn added (user message, or tool results)
    permissions: list[PermissionAnswer]  # only for runtimes that execute their own tools
    capabilities: dict

    async def emit(self, event: dict) -> None:
        """Emit one AAP event: text_delta, thinking_delta, tool_call or tool_result."""

    async def call_tools(self, calls: list[ToolCall]) -> list[ToolOutcome]:
        """Emit tool calls; run trusted server tools inline; report those pending on the app."""

    def request_permission(self, call: ToolCall) -> None:
        """An already-emitted tool call now waits on the application's permission (runtimes
        that run their own tools); the turn then ends with `tool_use`."""

    def set_compacted(self, compaction: Compaction) -> None:
        """Rewrite the compacted history once the turn's messages are appended."""

    def add_usage(self, *, prompt_tokens: int = 0, completion_tokens: int = 0, estimated: bool = False) -> None:
        """Record token usage of one model call (`estimated`: counted by the runtime, the
        provider reported none)."""

    def set_stop_meta(self, **meta: Any) -> None:
        """Extra `_meta` for this turn's `turn_stop` event (e.g. a safe error sentence)."""


class AgentError(Exception):
    """A failure a runtime reports with a sentence that is safe to show the application."""

    def __init__(self, safe_message: str):
        super().__init__(safe_message)
        self.safe_message = safe_message


class Runtime(ABC):
    """An agent kind. One instance per worker process and kind; `run` is called per turn."""

    kind: ClassVar[str]
    title: ClassVar[str] = ""
    #: What this kind can do at all; admin toggles narrow `image` and `application`.
    supports: ClassVar[dict] = {
        "history": ("compacted", "full"),
        "stream": ("delta", "message", "none"),
        "application_tools": True,
        "image": ("http", "data"),
    }
    #: JSON Schema of the agent's runtime configuration (validated in admin and apply_agents).
    config_schema: ClassVar[dict] = {"type": "object"}
    #: False when the agent process runs its own tools and only asks permission (ACP).
    host_executes_server_tools: ClassVar[bool] = True

    @classmethod
    def validate_config(cls, config: Any) -> dict:
        """Validate a runtime configuration; raises ValueError with a readable sentence."""
        import jsonschema

        if config is None:
            config = {}
        try:
            jsonschema.validate(config, cls.config_schema)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            raise ValueError(
                f"Runtime configuration for '{cls.kind}' is invalid"
                + (f" at '{where}'" if where else "")
                + f": {exc.message}"
            ) from None
        return config

    @classmethod
    def builtin_server_tools(cls, config: dict) -> list[dict]:
        """Server tools this kind exposes by itself (ToolSpec dicts), beside the admin ones."""
        return []

    @abstractmethod
    async def run(self, ctx: TurnContext) -> StopReason:
        """Run one turn: emit events through ctx, return the stop reason."""

    def seed_window(self, config: dict) -> int | None:
        """How many of a seeded history's last messages the compacted history starts with
        (None: all of them; the runtime compacts on its first turn)."""
        return None

    async def on_session_deleted(self, *, session_id: str, tenant: str, config: dict) -> None:  # noqa: B027 (optional hook)
        """Release whatever the runtime holds for a deleted session."""

    def shutdown(self) -> None:  # noqa: B027 (optional hook)
        """The process is exiting (a worker's shutdown): stop what the runtime runs, as what
        it runs expects. Blocking and bounded; called from a thread other than the runtime loop."""

    def pinned_worker(self, *, session_id: str) -> str | None:
        """The Celery worker node holding this session's in-flight work, where its next turn
        must run (None: any worker). Called while a turn is being started."""
        return None
