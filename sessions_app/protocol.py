"""The AAP v3 wire protocol: shapes, their validation, and conversions.

Everything that knows what an AAP message, tool spec or event looks like lives here, so
views, services, runtimes and tests share one definition. Serializers only validate: the
accepted JSON is stored exactly as sent (history is byte-for-byte what was accepted).
"""

from __future__ import annotations

import json
import re

import jsonschema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

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


@extend_schema_field(OpenApiTypes.OBJECT)
class JSONObjectField(serializers.Field):
    default_error_messages = {"invalid": "Must be a JSON object."}

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        return data

    def to_representation(self, value):
        return value


# --- content blocks and messages ----------------------------------------------------------


class TextBlockSerializer(serializers.Serializer):
    type = serializers.ChoiceField(["text"])
    text = StrictCharField(allow_blank=True, trim_whitespace=False)


class ThinkingBlockSerializer(serializers.Serializer):
    type = serializers.ChoiceField(["thinking"])
    thinking = StrictCharField(allow_blank=True, trim_whitespace=False)


class ToolUseBlockSerializer(serializers.Serializer):
    type = serializers.ChoiceField(["tool_use"])
    toolCallId = StrictCharField(max_length=200)
    name = StrictCharField(max_length=64)
    input = JSONObjectField()


class ImageBlockSerializer(serializers.Serializer):
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


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]})
class ContentField(serializers.Field):
    """`string | ContentBlock[]`, with the block types a given role may carry."""

    default_error_messages = {"invalid": "Content must be a string or a list of content blocks."}

    def __init__(self, *, block_types=tuple(BLOCK_SERIALIZERS), string_only=False, **kwargs):
        self.block_types = block_types
        self.string_only = string_only
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str):
            return data
        if self.string_only:
            raise serializers.ValidationError("Content must be a string for this role.")
        if not isinstance(data, list):
            self.fail("invalid")
        errors = {}
        for index, block in enumerate(data):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in self.block_types:
                errors[index] = [f"Block type must be one of: {', '.join(self.block_types)}."]
                continue
            serializer = BLOCK_SERIALIZERS[kind](data=block)
            if not serializer.is_valid():
                errors[index] = serializer.errors
        if errors:
            raise serializers.ValidationError(errors)
        return data

    def to_representation(self, value):
        return value


class SystemMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(["system"])
    content = ContentField(string_only=True)


class UserMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(["user"])
    content = ContentField(block_types=("text", "image"))


class AssistantMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(["assistant"])
    content = ContentField(block_types=("text", "thinking", "tool_use"))


class ToolMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(["tool"])
    toolCallId = StrictCharField(max_length=200)
    content = ContentField(block_types=("text", "image"))


class ToolPermissionMessageSerializer(serializers.Serializer):
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


@extend_schema_field(OpenApiTypes.OBJECT)
class MessageField(serializers.Field):
    """One message of the roles allowed in this position (history seeds or turn input)."""

    default_error_messages = {"invalid": "Each message must be a JSON object with a 'role'."}

    def __init__(self, *, roles, **kwargs):
        self.roles = roles
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        role = data.get("role")
        if role not in self.roles:
            raise serializers.ValidationError({"role": [f"Role must be one of: {', '.join(self.roles)}."]})
        serializer = MESSAGE_SERIALIZERS[role](data=data)
        if not serializer.is_valid():
            raise serializers.ValidationError(serializer.errors)
        return data  # stored exactly as sent

    def to_representation(self, value):
        return value


HISTORY_ROLES = ("system", "user", "assistant", "tool")
APPLICATION_ROLES = ("user", "tool", "tool_permission")


# --- tools and agent configuration --------------------------------------------------------


class ToolSpecSerializer(serializers.Serializer):
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


class ServerToolRefSerializer(serializers.Serializer):
    name = StrictCharField(max_length=64)
    trust = StrictBooleanField(required=False, default=False)


class AgentConfigSerializer(serializers.Serializer):
    name = StrictCharField(max_length=100, required=False)
    tools = ServerToolRefSerializer(many=True, required=False)
    options = serializers.DictField(
        child=StrictCharField(allow_blank=True, trim_whitespace=False), required=False
    )


class CreateSessionSerializer(serializers.Serializer):
    agent = AgentConfigSerializer()
    messages = serializers.ListField(child=MessageField(roles=HISTORY_ROLES), required=False)
    tools = ToolSpecSerializer(many=True, required=False)

    def validate_agent(self, value):
        if not value.get("name"):
            raise serializers.ValidationError({"name": ["The agent name is required to create a session."]})
        return value


class TurnRequestSerializer(serializers.Serializer):
    agent = AgentConfigSerializer(required=False)
    stream = serializers.ChoiceField(STREAM_MODES, required=False, default="none")
    messages = serializers.ListField(
        child=MessageField(roles=APPLICATION_ROLES), allow_empty=False,
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
    after = serializers.CharField(required=False)
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


class MetaSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    agents = serializers.ListField(child=serializers.DictField())


class HistorySerializer(serializers.Serializer):
    history = serializers.DictField(child=serializers.ListField(child=serializers.DictField()))


class TurnResponseSerializer(serializers.Serializer):
    stopReason = serializers.ChoiceField(STOP_REASONS)
    messages = serializers.ListField(child=serializers.DictField())


class ErrorSerializer(serializers.Serializer):
    error = serializers.CharField()
    details = serializers.JSONField(required=False)
