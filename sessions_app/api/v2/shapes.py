"""The v2-era AAP wire shapes (seed 001) and their translation to and from v3.

The `/v2/` surface is the same protocol core behind other shapes: these serializers check
what a v2-era client sends, `*_to_v3` turn it into what the services take, `*_to_v2` turn
stored or produced v3 shapes back. The differences: image blocks are `{mimeType, data}`
(v3: a `data:` URL), tool specs carry `inputSchema` (v3: `parameters`), `ServerToolRef.trust`
is required, `PUT /session` creates a session with its first turn, `/meta` says version 2.
Everything else (roles, blocks, options, events) is v3's, validated by v3's serializers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rest_framework import serializers

from aap.types import HistoryType
from sessions_app import protocol as v3
from sessions_app.protocol import StrictBooleanField, StrictCharField, StrictSerializer

MIME_RE = re.compile(r"^[\w.+-]+/[\w.+-]+$")
BASE64_RE = re.compile(r"^[A-Za-z0-9+/=\s]+$")
DATA_URL_RE = re.compile(r"^data:([\w.+-]+/[\w.+-]+);base64,(.*)$", re.DOTALL)


# --- translation ------------------------------------------------------------------------------


def _meta_of(value: dict) -> dict:
    return {"_meta": value["_meta"]} if "_meta" in value else {}


def image_to_v3(block: dict) -> dict:
    return {"type": "image", "url": f"data:{block['mimeType']};base64,{block['data']}", **_meta_of(block)}


def image_to_v2(block: dict) -> dict:
    """A `data:` URL as `{mimeType, data}`. An https:// image (possible only through /v1/)
    has no v2-era form: it is shown as a text block holding the URL, with `_meta.imageUrl`."""
    match = DATA_URL_RE.match(block.get("url", ""))
    if match:
        return {"type": "image", "mimeType": match[1], "data": match[2], **_meta_of(block)}
    meta = {**block.get("_meta", {}), "imageUrl": block.get("url", "")}
    return {"type": "text", "text": block.get("url", ""), "_meta": meta}


def _content(content: Any, image) -> Any:
    if not isinstance(content, list):
        return content
    return [image(block) if isinstance(block, dict) and block.get("type") == "image" else block for block in content]


def message_to_v3(message: dict) -> dict:
    if "content" not in message:
        return message
    return {**message, "content": _content(message["content"], image_to_v3)}


def message_to_v2(message: dict) -> dict:
    if "content" not in message:
        return message
    return {**message, "content": _content(message["content"], image_to_v2)}


def _renamed(value: dict, old: str, new: str) -> dict:
    """`value` with key `old` renamed `new`, in the same place."""
    return {(new if key == old else key): item for key, item in value.items()}


def tool_to_v3(spec: dict) -> dict:
    return _renamed(dict(spec), "inputSchema", "parameters")


def tool_to_v2(spec: dict) -> dict:
    return _renamed(dict(spec), "parameters", "inputSchema")


def event_to_v2(event: dict) -> dict:
    """A turn event in v2-era shape: only a `tool_result`'s content can differ (images)."""
    if event.get("event") == "tool_result":
        return {**event, "content": _content(event.get("content"), image_to_v2)}
    return event


def agent_info_to_v2(info: dict) -> dict:
    """An AgentInfo of /meta: tool specs with `inputSchema`; no `image` capability (v2 has none)."""
    info = dict(info)
    if "tools" in info:
        info["tools"] = [tool_to_v2(spec) for spec in info["tools"]]
    if "capabilities" in info:
        info["capabilities"] = {key: value for key, value in info["capabilities"].items() if key != "image"}
    return info


def session_to_v2(info: dict, history: Mapping[HistoryType, list[dict]]) -> dict:
    """A v3 SessionInfo and the history types the agent keeps, as a v2 SessionResponse."""
    body = dict(info)
    if "tools" in body:
        body["tools"] = [tool_to_v2(spec) for spec in body["tools"]]
    if history:
        body["history"] = {kind: [message_to_v2(m) for m in messages] for kind, messages in history.items()}
    return body


# --- the v2-era request shapes ------------------------------------------------------------------


class V2ImageBlockSerializer(StrictSerializer):
    type = serializers.ChoiceField(["image"])
    mimeType = StrictCharField(max_length=255)
    data = StrictCharField()

    def validate_mimeType(self, value):
        if not MIME_RE.match(value):
            raise serializers.ValidationError("A mimeType is type/subtype, e.g. image/png.")
        return value

    def validate_data(self, value):
        if not BASE64_RE.match(value):
            raise serializers.ValidationError("data must be the image's bytes in base64.")
        return value


class V2ContentField(v3.ContentField):
    block_serializers = {**v3.BLOCK_SERIALIZERS, "image": V2ImageBlockSerializer}
    block_schemas = {**v3.BLOCK_SCHEMAS, "image": "V2ImageBlock"}


class V2UserMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["user"])
    content = V2ContentField(block_types=("text", "image"))


class V2ToolMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["tool"])
    toolCallId = StrictCharField(max_length=200)
    content = V2ContentField(block_types=("text", "image"))


class V2MessageField(v3.MessageField):
    message_serializers = {**v3.MESSAGE_SERIALIZERS, "user": V2UserMessageSerializer, "tool": V2ToolMessageSerializer}
    role_schemas = {**v3.ROLE_SCHEMAS, "user": "V2UserMessage", "tool": "V2ToolMessage"}


class V2ToolSpecSerializer(v3.ToolSpecSerializer):
    parameters = None  # v2 names it inputSchema
    inputSchema = v3.JSONObjectField()

    def validate_inputSchema(self, value):
        return self.validate_parameters(value)


class V2ServerToolRefSerializer(StrictSerializer):
    name = StrictCharField(max_length=64)
    trust = StrictBooleanField()


class V2AgentConfigSerializer(StrictSerializer):
    name = StrictCharField(max_length=100)
    tools = V2ServerToolRefSerializer(many=True, required=False)
    options = serializers.DictField(child=StrictCharField(allow_blank=True, trim_whitespace=False), required=False)


class V2AgentOverridesSerializer(StrictSerializer):
    """A turn's `agent`: AgentConfig without `name` (a session's agent never changes)."""

    tools = V2ServerToolRefSerializer(many=True, required=False)
    options = serializers.DictField(child=StrictCharField(allow_blank=True, trim_whitespace=False), required=False)


class V2CreateSessionSerializer(StrictSerializer):
    agent = V2AgentConfigSerializer()
    stream = serializers.ChoiceField(v3.STREAM_MODES, required=False, default="none")
    messages = serializers.ListField(
        child=V2MessageField(roles=v3.HISTORY_ROLES),
        min_length=1,
        help_text="The seed history; the last message is the user message of the first turn.",
    )
    tools = V2ToolSpecSerializer(many=True, required=False)

    def validate_messages(self, value):
        if value[-1]["role"] != "user":
            raise serializers.ValidationError("The last message must be a user message: the first turn's input.")
        return value


class V2TurnRequestSerializer(StrictSerializer):
    agent = V2AgentOverridesSerializer(required=False)
    stream = serializers.ChoiceField(v3.STREAM_MODES, required=False, default="none")
    messages = serializers.ListField(
        child=V2MessageField(roles=(*v3.HISTORY_ROLES, "tool_permission")),
        min_length=1,
        help_text="One user message, or one answer per pending tool call.",
    )
    tools = V2ToolSpecSerializer(many=True, required=False)


class V2SessionListQuerySerializer(serializers.Serializer):
    after = serializers.CharField(
        required=False, allow_blank=True, help_text="The `nextCursor` of the previous page (empty: the first page)."
    )
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=20)


def create_request_to_v3(data: dict) -> dict:
    """A validated PUT /session body as services.turns.session_open's arguments."""
    *seed, first = (message_to_v3(m) for m in data["messages"])
    tools = [tool_to_v3(spec) for spec in data["tools"]] if "tools" in data else None
    return {
        "agent_config": dict(data["agent"]),
        "seed": seed,
        "tools": tools,
        "turn": {"stream": data["stream"], "messages": [first]},
    }


def turn_request_to_v3(data: dict) -> dict:
    """A validated POST /session/:id body as a v3 turn request (services.turns.turn_start)."""
    turn: dict = {"stream": data["stream"], "messages": [message_to_v3(m) for m in data["messages"]]}
    if "agent" in data:
        turn["agent"] = dict(data["agent"])
    if "tools" in data:
        turn["tools"] = [tool_to_v3(spec) for spec in data["tools"]]
    return turn


# --- response shapes (for the OpenAPI document) -------------------------------------------------


class V2SessionCreatedSerializer(serializers.Serializer):
    sessionId = serializers.CharField()
    stopReason = serializers.ChoiceField(v3.STOP_REASONS)
    messages = v3.DocumentedField({"type": "array", "items": v3.ref("V2Message")})


class V2TurnResponseSerializer(serializers.Serializer):
    stopReason = serializers.ChoiceField(v3.STOP_REASONS)
    messages = v3.DocumentedField({"type": "array", "items": v3.ref("V2Message")})


class V2SessionSerializer(serializers.Serializer):
    sessionId = serializers.CharField()
    agent = v3.DocumentedField({"type": "object", "description": "AgentConfig: name, tools?, options?"})
    tools = V2ToolSpecSerializer(many=True, required=False)
    history = v3.DocumentedField(
        {
            "type": "object",
            "properties": {kind: {"type": "array", "items": v3.ref("V2Message")} for kind in v3.HISTORY_TYPES},
            "description": "The history types the agent keeps.",
        },
        required=False,
    )


class V2SessionListSerializer(serializers.Serializer):
    sessions = serializers.ListField(child=serializers.CharField())
    nextCursor = serializers.CharField(required=False)


class V2MetaSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    agents = v3.DocumentedField({"type": "array", "items": v3.ref("V2AgentInfo")})


WIRE_SCHEMAS = {
    "V2ImageBlock": v3._object(
        {
            "type": {"type": "string", "enum": ["image"]},
            "mimeType": {"type": "string", "pattern": MIME_RE.pattern, "maxLength": 255},
            "data": {"type": "string", "pattern": BASE64_RE.pattern, "description": "The bytes in base64."},
        }
    ),
    "V2UserMessage": v3._object(
        {
            "role": {"type": "string", "enum": ["user"]},
            "content": v3.content_schema(("text", "image"), V2ContentField.block_schemas),
        }
    ),
    "V2ToolMessage": v3._object(
        {
            "role": {"type": "string", "enum": ["tool"]},
            "toolCallId": v3.TOOL_CALL_ID,
            "content": v3.content_schema(("text", "image"), V2ContentField.block_schemas),
        }
    ),
    "V2Message": v3.message_schema(v3.HISTORY_ROLES, V2MessageField.role_schemas),
    "V2AgentInfo": {
        **v3.WIRE_SCHEMAS["AgentInfo"],
        "properties": {
            **v3.WIRE_SCHEMAS["AgentInfo"]["properties"],
            "tools": {"type": "array", "items": v3.ref("V2ToolSpec"), "description": "The server tools it exposes."},
            "capabilities": {
                "type": "object",
                "description": "history, stream, application: a missing key is unsupported.",
            },
        },
    },
    "V2SessionStartEvent": v3._object(
        {"sessionId": {"type": "string"}}, description="`event: session_start`. PUT /session only, always first."
    ),
}
