"""The AAP v3 wire protocol: shapes, their validation, and conversions.

Everything that knows what an AAP message, tool spec or event looks like lives here, so
views, services, runtimes and tests share one definition. Serializers only validate: the
accepted JSON is stored exactly as sent (history is byte-for-byte what was accepted).

Longer than ~400 lines on purpose: the protocol is one module (docs/ARCHITECTURE.md), each
serializer beside the OpenAPI schema that mirrors it.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jsonschema
from drf_spectacular.drainage import set_override
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.settings import api_settings

# The framework-free core (shapes, fold, SSE) lives in `aap`; re-exported here so the API
# layer has one protocol module to import from.
from aap.messages import (  # noqa: F401
    DATA_URI_RE,
    MessageShaper,
    content_images,
    content_text,
    denial_text,
    dumps,
    fold,
    image_kind,
    tool_uses,
)
from aap.sse import SSE_PING, event_data, sse_frame  # noqa: F401
from aap.types import EVENT_NAMES, HISTORY_TYPES, STOP_REASONS, STREAM_MODES

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --- strict scalar fields (AAP is JSON: no coercion of 1 to "1" or "true" to True) --------


class StrictCharField(serializers.CharField):
    """A JSON string, validated as sent: lengths count what was sent (no trimming)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Must be true or false."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


# An AAP object: its declared properties and `_meta` (an object the server ignores); any
# other property is refused, as the OpenAPI document says (hosting.openapi: additionalProperties
# false). A comment, not a docstring: the document would show it on every request shape.
class StrictSerializer(serializers.Serializer):
    def to_internal_value(self, data):
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data if key not in self.fields and key != "_meta")
            errors = {
                key: [f"Unknown property; this object accepts: {', '.join([*self.fields, '_meta'])}."]
                for key in unknown
            }
            if "_meta" in data and not isinstance(data["_meta"], dict):
                errors["_meta"] = ["Must be a JSON object."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


@functools.cache
def _validator(serializer_class: type[serializers.Serializer]) -> serializers.Serializer:
    return serializer_class()


def validate(serializer_class: type[serializers.Serializer], data):
    """`data` validated by `serializer_class`: what `serializer_class(data=data)` would give
    as `validated_data` after `is_valid(raise_exception=True)`, or the ValidationError that
    would raise. Through one instance per class and its `run_validation`: DRF deep-copies
    every declared field (nested serializers included) for each new instance, most of the
    cost of validating a small body, and `run_validation` keeps nothing on the instance (no
    serializer here reads `context`), so one instance serves every request and thread
    (tests/unit/test_request_validation.py holds it to `is_valid`)."""
    try:
        return _validator(serializer_class).run_validation(data)
    except serializers.ValidationError as exc:
        detail = exc.detail
        if isinstance(detail, list):  # not an object: worded as `Serializer.errors` words it
            if len(detail) == 1 and getattr(detail[0], "code", None) == "null":
                detail = [serializers.ErrorDetail("No data provided", code="null")]
            detail = {api_settings.NON_FIELD_ERRORS_KEY: detail}
        raise serializers.ValidationError(detail) from None


def unstorable(value, path: str = "") -> str | None:
    """Where `value` holds JSON that PostgreSQL's jsonb refuses, as a sentence; None if none.

    jsonb cannot hold the NUL character (`\\u0000`) in a string or key, nor a number that is
    not finite (`1e400` reads as infinity); anything else JSON can say, it can store.
    """
    if isinstance(value, str):
        return f"{path or 'the value'} contains the NUL character (\\u0000)" if "\x00" in value else None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path or 'the value'} is a number too large to store"
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if "\x00" in str(key):
                return f"a key in {path or 'the object'} contains the NUL character (\\u0000)"
            found = unstorable(item, where)
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = unstorable(item, f"{path}[{index}]")
            if found:
                return found
    return None


@extend_schema_field({"type": "object", "additionalProperties": True})
class JSONObjectField(serializers.Field):
    default_error_messages = {"invalid": "Must be a JSON object."}

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        problem = unstorable(data)
        if problem:
            raise serializers.ValidationError(f"Cannot be stored: {problem}.")
        return data

    def to_representation(self, value):
        return value


# --- the wire shapes as JSON Schema (components of the OpenAPI document) --------------------
# Each mirrors the serializer that validates it: the same required properties, lengths and
# choices, `_meta` allowed, any other property refused.

META = {"type": "object", "additionalProperties": True, "description": "Extra data the server ignores."}
TOOL_CALL_ID = {"type": "string", "minLength": 1, "maxLength": 200}
IMAGE_URL_PATTERN = r"^(https://[\s\S]+|data:[\w.+-]+/[\w.+-]+;base64,[A-Za-z0-9+/=\s]+)$"
ROLE_SCHEMAS = {
    "system": "SystemMessage",
    "user": "UserMessage",
    "assistant": "AssistantMessage",
    "tool": "ToolMessage",
    "tool_permission": "ToolPermissionMessage",
}
BLOCK_SCHEMAS = {"text": "TextBlock", "thinking": "ThinkingBlock", "tool_use": "ToolUseBlock", "image": "ImageBlock"}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: dict, optional: dict | None = None, description: str = "") -> dict:
    schema = {
        "type": "object",
        "properties": {**required, **(optional or {}), "_meta": META},
        "required": list(required),
        "additionalProperties": False,
    }
    if description:
        schema["description"] = description
    return schema


def content_schema(block_types, schemas: dict[str, str] = BLOCK_SCHEMAS) -> dict:
    return {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"oneOf": [ref(schemas[t]) for t in block_types]}},
        ]
    }


def message_schema(roles, schemas: dict[str, str] = ROLE_SCHEMAS) -> dict:
    return {"oneOf": [ref(schemas[role]) for role in roles]}


def _event(name: str, required: dict | None = None, description: str = "") -> dict:
    """The `data:` JSON of one event (its name is the SSE `event:` line)."""
    return _object(required or {}, description=f"`event: {name}`. {description}".strip())


def sse_event_schema() -> dict:
    """One Server-Sent Event of a turn: `id:`, `event:` and `data:` (JSON of that event's shape).
    Open API before 3.2 has a stream's `schema` describe each event."""
    return {
        "oneOf": [
            {
                "type": "object",
                "required": ["event", "data"],
                "properties": {
                    "id": {"type": "string", "pattern": "^[0-9]+$"},
                    "event": {"type": "string", "enum": [name]},
                    "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": ref(component)},
                },
            }
            for name, component in EVENT_SCHEMAS.items()
        ]
    }


WIRE_SCHEMAS = {
    "TextBlock": _object({"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}),
    "ThinkingBlock": _object({"type": {"type": "string", "enum": ["thinking"]}, "thinking": {"type": "string"}}),
    "ToolUseBlock": _object(
        {
            "type": {"type": "string", "enum": ["tool_use"]},
            "toolCallId": TOOL_CALL_ID,
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "input": {"type": "object"},
        }
    ),
    "ImageBlock": _object(
        {
            "type": {"type": "string", "enum": ["image"]},
            "url": {
                "type": "string",
                "pattern": IMAGE_URL_PATTERN,
                "description": "https://... or data:<mime>;base64,...",
            },
        }
    ),
    "SystemMessage": _object({"role": {"type": "string", "enum": ["system"]}, "content": {"type": "string"}}),
    "UserMessage": _object(
        {"role": {"type": "string", "enum": ["user"]}, "content": content_schema(("text", "image"))}
    ),
    "AssistantMessage": _object(
        {
            "role": {"type": "string", "enum": ["assistant"]},
            "content": content_schema(("text", "thinking", "tool_use")),
        }
    ),
    "ToolMessage": _object(
        {
            "role": {"type": "string", "enum": ["tool"]},
            "toolCallId": TOOL_CALL_ID,
            "content": content_schema(("text", "image")),
        }
    ),
    "ToolPermissionMessage": _object(
        {
            "role": {"type": "string", "enum": ["tool_permission"]},
            "toolCallId": TOOL_CALL_ID,
            "granted": {"type": "boolean"},
        },
        {"reason": {"type": "string", "maxLength": 2000}},
    ),
    "HistoryMessage": message_schema(("system", "user", "assistant", "tool")),
    "ApplicationMessage": message_schema(("user", "tool", "tool_permission")),
    "AgentMessage": message_schema(("assistant", "tool")),
}
EVENT_SCHEMAS = {name: "".join(part.title() for part in name.split("_")) + "Event" for name in EVENT_NAMES}
WIRE_SCHEMAS |= {
    "TurnStartEvent": _event("turn_start", description="Always first; `_meta.turnId` names the turn."),
    "TextDeltaEvent": _event("text_delta", {"delta": {"type": "string"}}, "Stream `delta`."),
    "ThinkingDeltaEvent": _event("thinking_delta", {"delta": {"type": "string"}}, "Stream `delta`."),
    "TextEvent": _event("text", {"text": {"type": "string"}}, "Stream `message`: one whole text part."),
    "ThinkingEvent": _event("thinking", {"thinking": {"type": "string"}}, "Stream `message`: one whole thinking part."),
    "ToolCallEvent": _event(
        "tool_call", {"toolCallId": TOOL_CALL_ID, "name": {"type": "string"}, "input": {"type": "object"}}
    ),
    "ToolResultEvent": _event(
        "tool_result", {"toolCallId": TOOL_CALL_ID, "content": content_schema(("text", "image"))}, "Server tools only."
    ),
    "TurnStopEvent": _event(
        "turn_stop",
        {"stopReason": {"type": "string", "enum": list(STOP_REASONS)}},
        "Always last; `_meta` may carry `error`, `cancelled` and `usage`.",
    ),
}
WIRE_SCHEMAS["TurnEvent"] = {**sse_event_schema(), "description": "One event of a turn's text/event-stream."}


# --- content blocks and messages ----------------------------------------------------------


class TextBlockSerializer(StrictSerializer):
    type = serializers.ChoiceField(["text"])
    text = StrictCharField(allow_blank=True, trim_whitespace=False)


class ThinkingBlockSerializer(StrictSerializer):
    type = serializers.ChoiceField(["thinking"])
    thinking = StrictCharField(allow_blank=True, trim_whitespace=False)


class ToolUseBlockSerializer(StrictSerializer):
    type = serializers.ChoiceField(["tool_use"])
    toolCallId = StrictCharField(max_length=200)
    name = StrictCharField(max_length=64)
    input = JSONObjectField()


class ImageBlockSerializer(StrictSerializer):
    type = serializers.ChoiceField(["image"])
    url = StrictCharField()

    def validate_url(self, value):
        if image_kind(value) is None:
            raise serializers.ValidationError(
                "An image url must be an https:// URL or a data:<mime>;base64,<data> URI."
            )
        return value


BLOCK_SERIALIZERS = {
    "text": TextBlockSerializer,
    "thinking": ThinkingBlockSerializer,
    "tool_use": ToolUseBlockSerializer,
    "image": ImageBlockSerializer,
}


class ContentField(serializers.Field):
    """`string | ContentBlock[]`, with the block types a given role may carry."""

    default_error_messages = {"invalid": "Content must be a string or a list of content blocks."}
    block_serializers = BLOCK_SERIALIZERS
    block_schemas = BLOCK_SCHEMAS

    def __init__(self, *, block_types=tuple(BLOCK_SERIALIZERS), string_only=False, **kwargs):
        self.block_types = block_types
        self.string_only = string_only
        super().__init__(**kwargs)
        set_override(
            self, "field", {"type": "string"} if string_only else content_schema(block_types, self.block_schemas)
        )

    def to_internal_value(self, data):
        if isinstance(data, str):
            return data
        if self.string_only:
            raise serializers.ValidationError("Content must be a string for this role.")
        if not isinstance(data, list):
            self.fail("invalid")
        errors: dict[str, Any] = {}  # by the block's index (JSON object keys are strings)
        for index, block in enumerate(data):
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str) or kind not in self.block_types:
                errors[str(index)] = [f"Block type must be one of: {', '.join(self.block_types)}."]
                continue
            try:
                validate(self.block_serializers[kind], block)
            except serializers.ValidationError as exc:
                errors[str(index)] = exc.detail
        if errors:
            raise serializers.ValidationError(errors)
        return data

    def to_representation(self, value):
        return value


class SystemMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["system"])
    content = ContentField(string_only=True)


class UserMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["user"])
    content = ContentField(block_types=("text", "image"))


class AssistantMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["assistant"])
    content = ContentField(block_types=("text", "thinking", "tool_use"))


class ToolMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["tool"])
    toolCallId = StrictCharField(max_length=200)
    content = ContentField(block_types=("text", "image"))


class ToolPermissionMessageSerializer(StrictSerializer):
    role = serializers.ChoiceField(["tool_permission"])
    toolCallId = StrictCharField(max_length=200)
    granted = StrictBooleanField()
    reason = StrictCharField(required=False, allow_blank=True, max_length=2000)


MESSAGE_SERIALIZERS = {
    "system": SystemMessageSerializer,
    "user": UserMessageSerializer,
    "assistant": AssistantMessageSerializer,
    "tool": ToolMessageSerializer,
    "tool_permission": ToolPermissionMessageSerializer,
}


class MessageField(serializers.Field):
    """One message of the roles allowed in this position (history seeds or turn input)."""

    default_error_messages = {"invalid": "Each message must be a JSON object with a 'role'."}
    message_serializers = MESSAGE_SERIALIZERS
    role_schemas = ROLE_SCHEMAS

    def __init__(self, *, roles, **kwargs):
        self.roles = roles
        super().__init__(**kwargs)
        set_override(self, "field", message_schema(roles, self.role_schemas))

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        role = data.get("role")
        if not isinstance(role, str) or role not in self.roles:
            raise serializers.ValidationError({"role": [f"Role must be one of: {', '.join(self.roles)}."]})
        validate(self.message_serializers[role], data)
        return data  # stored exactly as sent

    def to_representation(self, value):
        return value


HISTORY_ROLES = ("system", "user", "assistant", "tool")
APPLICATION_ROLES = ("user", "tool", "tool_permission")


# --- tools and agent configuration --------------------------------------------------------


class ToolSpecSerializer(StrictSerializer):
    name = StrictCharField(max_length=64)
    title = StrictCharField(required=False, allow_blank=True, max_length=200)
    description = StrictCharField(max_length=10_000)
    parameters = JSONObjectField()

    def validate_name(self, value):
        if not TOOL_NAME_RE.match(value):
            raise serializers.ValidationError("A tool name is 1 to 64 letters, digits, '_' or '-'.")
        return value

    def validate_parameters(self, value):
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise serializers.ValidationError(f"Not a valid JSON Schema: {exc.message}") from None
        return value


class ServerToolRefSerializer(StrictSerializer):
    name = StrictCharField(max_length=64)
    trust = StrictBooleanField(required=False, default=False)


class AgentConfigSerializer(StrictSerializer):
    name = StrictCharField(max_length=100, required=False)
    tools = ServerToolRefSerializer(many=True, required=False)
    options = serializers.DictField(child=StrictCharField(allow_blank=True, trim_whitespace=False), required=False)


class CreateSessionSerializer(StrictSerializer):
    agent = AgentConfigSerializer()
    messages = serializers.ListField(child=MessageField(roles=HISTORY_ROLES), required=False)
    tools = ToolSpecSerializer(many=True, required=False)

    def validate_agent(self, value):
        if not value.get("name"):
            raise serializers.ValidationError({"name": ["The agent name is required to create a session."]})
        return value


class TurnRequestSerializer(StrictSerializer):
    agent = AgentConfigSerializer(required=False)
    stream = serializers.ChoiceField(STREAM_MODES, required=False, default="none")
    messages = serializers.ListField(
        child=MessageField(roles=APPLICATION_ROLES),
        allow_empty=False,
        min_length=1,
        help_text="One user message, or one answer per pending tool call.",
    )
    tools = ToolSpecSerializer(many=True, required=False)


class HistoryQuerySerializer(serializers.Serializer):
    type = serializers.ChoiceField(
        HISTORY_TYPES,
        error_messages={
            "invalid_choice": "Use type=compacted or type=full.",
            "required": "Use type=compacted or type=full.",
        },
    )


class SessionListQuerySerializer(serializers.Serializer):
    after = serializers.CharField(
        required=False, allow_blank=True, help_text="The `next` cursor of the previous page (empty: the first page)."
    )
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=20)


# --- response shapes (for the OpenAPI document) --------------------------------------------


class SessionIdSerializer(serializers.Serializer):
    sessionId = serializers.CharField()


class SessionInfoSerializer(serializers.Serializer):
    sessionId = serializers.CharField()
    agent = AgentConfigSerializer()
    tools = ToolSpecSerializer(many=True, required=False)


class SessionListSerializer(serializers.Serializer):
    sessions = SessionInfoSerializer(many=True)
    next = serializers.CharField(required=False)


class DocumentedField(serializers.Field):
    """A response field whose shape is given as JSON Schema (for the OpenAPI document)."""

    def __init__(self, schema: dict, **kwargs):
        super().__init__(**kwargs)
        set_override(self, "field", schema)

    def to_representation(self, value):
        return value


WIRE_SCHEMAS["AgentOption"] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["text", "secret", "select"]},
        "name": {"type": "string"},
        "title": {"type": "string"},
        "description": {"type": "string"},
        "default": {"type": "string", "description": 'For a secret: "***" when the operator stored one, else "".'},
        "options": {"type": "array", "items": {"type": "string"}, "description": "The choices of a select."},
    },
    "required": ["type", "name", "default"],
}
WIRE_SCHEMAS["AgentInfo"] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "title": {"type": "string"},
        "version": {"type": "string"},
        "description": {"type": "string"},
        "tools": {"type": "array", "items": ref("ToolSpec"), "description": "The server tools it exposes."},
        "options": {"type": "array", "items": ref("AgentOption")},
        "capabilities": {
            "type": "object",
            "description": "history, stream, application, image: a missing key is unsupported.",
        },
    },
    "required": ["name", "version"],
}


class MetaSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    agents = DocumentedField({"type": "array", "items": ref("AgentInfo")})


class HistorySerializer(serializers.Serializer):
    history = DocumentedField(
        {
            "type": "object",
            "properties": {kind: {"type": "array", "items": ref("HistoryMessage")} for kind in HISTORY_TYPES},
            "description": "One key: the type asked for.",
        }
    )


class TurnResponseSerializer(serializers.Serializer):
    stopReason = serializers.ChoiceField(STOP_REASONS)
    messages = DocumentedField({"type": "array", "items": ref("AgentMessage")})
    _meta = DocumentedField(
        {"type": "object", "description": "turnId; usage, error, cancelled when they apply."}, required=False
    )


class TurnCancelSerializer(serializers.Serializer):
    turnId = serializers.CharField()
    cancelling = serializers.BooleanField(help_text="false when the turn had already ended.")


class ErrorSerializer(serializers.Serializer):
    error = serializers.CharField()
    details = serializers.JSONField(required=False)
