"""The AAP v3 wire shapes as typed structures (camelCase, as on the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

PROTOCOL_VERSION = 3

StopReason = Literal["end_turn", "tool_use", "max_tokens", "refusal", "error"]
StreamMode = Literal["delta", "message", "none"]
HistoryType = Literal["compacted", "full"]
STOP_REASONS: tuple[StopReason, ...] = ("end_turn", "tool_use", "max_tokens", "refusal", "error")
STREAM_MODES: tuple[StreamMode, ...] = ("delta", "message", "none")
HISTORY_TYPES: tuple[HistoryType, ...] = ("compacted", "full")
EVENT_NAMES = (
    "turn_start",
    "text_delta",
    "thinking_delta",
    "text",
    "thinking",
    "tool_call",
    "tool_result",
    "turn_stop",
)

# --- content and messages -----------------------------------------------------------------


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    toolCallId: str
    name: str
    input: dict[str, Any]


class ImageBlock(TypedDict):
    type: Literal["image"]
    url: str  # https://... or data:<mime>;base64,...


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock | ImageBlock
Content = str | list[ContentBlock]


class SystemMessage(TypedDict):
    role: Literal["system"]
    content: str


class UserMessage(TypedDict):
    role: Literal["user"]
    content: Content


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: Content


class ToolMessage(TypedDict):
    role: Literal["tool"]
    toolCallId: str
    content: Content


class ToolPermissionMessage(TypedDict):
    role: Literal["tool_permission"]
    toolCallId: str
    granted: bool
    reason: NotRequired[str]


HistoryMessage = SystemMessage | UserMessage | AssistantMessage | ToolMessage
Message = HistoryMessage | ToolPermissionMessage

# --- agents, tools, sessions --------------------------------------------------------------


class ToolSpec(TypedDict):
    name: str
    title: NotRequired[str]
    description: str
    parameters: dict[str, Any]  # a JSON Schema object


class AgentOption(TypedDict):
    type: Literal["text", "secret", "select"]
    name: str
    title: NotRequired[str]
    description: NotRequired[str]
    default: str
    options: NotRequired[list[str]]


class AgentInfo(TypedDict):
    name: str
    title: NotRequired[str]
    version: str
    description: NotRequired[str]
    tools: NotRequired[list[ToolSpec]]
    options: NotRequired[list[AgentOption]]
    capabilities: NotRequired[dict[str, Any]]


class ServerToolRef(TypedDict):
    name: str
    trust: NotRequired[bool]


class AgentConfig(TypedDict):
    name: str
    tools: NotRequired[list[ServerToolRef]]
    options: NotRequired[dict[str, str]]


class SessionInfo(TypedDict):
    sessionId: str
    agent: AgentConfig
    tools: NotRequired[list[ToolSpec]]


# --- events -------------------------------------------------------------------------------


class QueuedPlace(TypedDict):
    """Where a turn waits for a worker (`turn_start._meta.queued`, `: queued` comments)."""

    position: int


@dataclass
class Event:
    """One AAP event: `event` is its name, `data` its JSON (without the name), `id` the SSE id
    this service numbers events with (None where a server sends none)."""

    event: str
    data: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The event as one JSON object, `{"event": name, **data}` (the fold's input)."""
        return {"event": self.event, **self.data}

    @property
    def meta(self) -> dict[str, Any]:
        return self.data.get("_meta") or {}

    @property
    def queued(self) -> QueuedPlace | None:
        """This service's extension on `turn_start`: the turn waits for a worker slot, at
        `position` (1: it takes the next one that frees). None: it was not queued."""
        if self.event != "turn_start":
            return None
        place = self.meta.get("queued")
        if isinstance(place, dict) and isinstance(place.get("position"), int):
            return QueuedPlace(position=place["position"])
        return None

    @property
    def text(self) -> str:
        """The text this event carries: a delta, or a whole text / thinking part."""
        return self.data.get("delta") or self.data.get("text") or self.data.get("thinking") or ""
