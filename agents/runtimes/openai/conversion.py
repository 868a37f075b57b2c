"""AAP history messages -> Chat Completions messages, tools as function tools, and the
model's tool-call arguments back to objects."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from openai.types.chat import ChatCompletionMessageToolCallParam

from aap.messages import content_images, content_text, image_kind

from ..base import TurnContext

OPENAI_TOOL_CALL_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
IMAGE_TOKENS = 800  # a rough per-image cost for the context estimate
CHARS_PER_TOKEN = 4


def function_tools(ctx: TurnContext) -> list[dict]:
    specs = [binding.spec for binding in ctx.server_tools.values()] + list(ctx.client_tools.values())
    return [
        {
            "type": "function",
            "function": {
                "name": spec["name"],
                "description": spec.get("description", ""),
                "parameters": spec.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for spec in specs
    ]


def message_json(value) -> str:
    """JSON text as a request body carries it (the SDK's own settings: compact, UTF-8, no NaN)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def estimate_tokens(chat: list[dict]) -> int:
    """A provider-independent estimate of a prompt's size (about four characters a token)."""
    chars, images = _size(chat)
    return chars // CHARS_PER_TOKEN + images * IMAGE_TOKENS


def _size(chat: list[dict]) -> tuple[int, int]:
    chars, images = 0, 0
    for message in chat:
        chars += 16
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    images += 1
                else:
                    chars += len(part.get("text", ""))
        for call in message.get("tool_calls") or []:
            chars += len(call["function"]["name"]) + len(call["function"]["arguments"]) + 16
    return chars, images


class ChatBuilder:
    """AAP history messages -> Chat Completions messages, fed in order, possibly over many turns.

    Thinking blocks stay out (providers reject or ignore them); every assistant tool call
    is answered right after it (a missing result gets a placeholder); tool results that
    answer nothing are left out; leading system messages become one. A builder whose
    history ended on a settled point (`settled`: no call waiting for its result) can be
    kept and fed the next turn's messages only, giving what converting the whole history
    again would (`converted` counts the messages it converted, for tests of that claim).
    """

    def __init__(self, ctx: TurnContext):
        self.accepted = ctx.capabilities.get("image", {})
        self.system = [ctx.config["systemPrompt"]] if ctx.config.get("systemPrompt") else []
        self.chat: list[dict] = []  # only ever appended to; its entries are never changed
        self._json: list[bytes] = []  # the JSON of chat's first entries, once each
        self.open_calls: list[str] = []
        self.tool_images: list[dict] = []
        self.started = False
        self.fed = 0  # messages of the history fed so far
        self.converted = 0
        self.chars = 0
        self.images = 0

    @property
    def settled(self) -> bool:
        return not self.open_calls and not self.tool_images

    def _append(self, entry: dict) -> None:
        self.chat.append(entry)
        chars, images = _size([entry])
        self.chars += chars
        self.images += images

    def _closing(self) -> list[dict]:
        """What answers the calls still open (placeholders) and carries the tools' images."""
        closing: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": call_id, "content": "No result was recorded for this call."}
            for call_id in self.open_calls
        ]
        if self.tool_images:
            closing.append(
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Images returned by the tools:"}, *self.tool_images],
                }
            )
        return closing

    def _close_calls(self) -> None:
        for entry in self._closing():
            self._append(entry)
        self.open_calls.clear()
        self.tool_images.clear()

    def feed(self, messages: list[dict]) -> ChatBuilder:
        self.fed += len(messages)
        self.converted += len(messages)
        for message in messages:
            self._feed_one(message)
        return self

    def _feed_one(self, message: dict) -> None:
        role = message.get("role")
        content = message.get("content")
        if role == "system" and not self.started:
            self.system.append(content)
            return
        self.started = True
        if role == "tool":
            call_id = _call_id(message.get("toolCallId", ""))
            if call_id not in self.open_calls:
                return
            self.open_calls.remove(call_id)
            self._append({"role": "tool", "tool_call_id": call_id, "content": text_of(content)})
            self.tool_images.extend(_image_parts(content, self.accepted, strict=True))
            return
        self._close_calls()
        if role == "system":
            self._append({"role": "system", "content": content})
        elif role == "user":
            self._append({"role": "user", "content": _user_content(content, self.accepted)})
        elif role == "assistant":
            blocks = content_blocks(message["content"])  # an AAP assistant message always has content
            text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
            calls: list[ChatCompletionMessageToolCallParam] = [
                {
                    "id": _call_id(b["toolCallId"]),
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})},
                }
                for b in blocks
                if b.get("type") == "tool_use"
            ]
            # "" and not null: servers that validate messages (llama-cpp-python) refuse null content.
            entry: dict = {"role": "assistant", "content": text}
            if calls:
                entry["tool_calls"] = calls
                self.open_calls.extend(call["id"] for call in calls)
            elif not text:
                return  # e.g. only thinking: nothing the provider needs
            self._append(entry)

    def json_of(self, count: int) -> list[bytes]:
        """The JSON of the first `count` converted messages: each is encoded once over the
        builder's life, so a kept builder's request costs what its new messages cost."""
        for entry in self.chat[len(self._json) : count]:
            self._json.append(message_json(entry).encode())
        return self._json[:count]

    def result(self) -> tuple[list[dict], int]:
        """The messages of a request and their token estimate; the builder is left as it was
        (a new list: it can be fed on)."""
        closing = self._closing()
        chat = self.chat + closing
        chars, images = _size(closing)
        chars, images = chars + self.chars, images + self.images
        if self.system:
            lead = {"role": "system", "content": "\n\n".join(self.system)}
            chat.insert(0, lead)
            chars += _size([lead])[0]
        return chat, chars // CHARS_PER_TOKEN + images * IMAGE_TOKENS


def to_chat(ctx: TurnContext, messages: list[dict]) -> list[dict]:
    """AAP history messages -> Chat Completions messages (see ChatBuilder)."""
    return ChatBuilder(ctx).feed(messages).result()[0]


def parse_arguments(partial) -> tuple[dict, str]:
    """The call's arguments as an object, or the sentence the model gets instead of a result."""
    if not partial.name:
        return {}, "Error: this tool call had no tool name; nothing was run."
    raw = partial.arguments.strip() or "{}"
    try:
        value = json.loads(raw)
    except ValueError:
        excerpt = raw if len(raw) <= 200 else raw[:200] + "..."
        return {}, (
            f"Error: the arguments of this call to {partial.name} are not valid JSON ({excerpt}); "
            "nothing was run. Call the tool again with a JSON object."
        )
    if not isinstance(value, dict):
        return {}, (
            f"Error: the arguments of this call to {partial.name} must be a JSON object; nothing was run. "
            "Call the tool again with a JSON object."
        )
    return value, ""


def _call_id(value: str) -> str:
    """A tool call id providers accept (at most 40 characters), stable for the same input."""
    if OPENAI_TOOL_CALL_ID_RE.match(value):
        return value
    return "call_" + hashlib.sha256(value.encode()).hexdigest()[:32]


def content_blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's content as blocks: a string is one text block."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def text_of(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else content_text(content)


def _image_parts(content, accepted: dict, *, strict: bool = False) -> list[dict]:
    parts = []
    for block in content_images(content) if isinstance(content, list) else []:
        if image_kind(block["url"]) in accepted:
            parts.append({"type": "image_url", "image_url": {"url": block["url"]}})
        elif not strict:
            parts.append({"type": "text", "text": "[an image this agent does not accept was left out]"})
    return parts


def _user_content(content, accepted: dict):
    if isinstance(content, str) or not content_images(content):
        return text_of(content)
    parts = []
    for block in content:
        if block.get("type") == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif block.get("type") == "image":
            parts.extend(_image_parts([block], accepted))
    return parts


def transcript(messages: list[dict]) -> str:
    """The part of the history to summarize, as plain text (tools and images named, not sent)."""
    names: dict[str, str] = {}
    lines = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            lines.append(f"[Earlier summary or instructions] {text_of(content)}")
        elif role == "user":
            images = len(content_images(content)) if isinstance(content, list) else 0
            lines.append(f"User: {text_of(content)}" + (f" [{images} image(s)]" if images else ""))
        elif role == "assistant":
            for block in content_blocks(message["content"]):  # an AAP assistant message always has content
                if block.get("type") == "text" and block["text"]:
                    lines.append(f"Assistant: {block['text']}")
                elif block.get("type") == "tool_use":
                    names[block["toolCallId"]] = block["name"]
                    lines.append(f"Assistant called {block['name']}({json.dumps(block.get('input') or {})})")
        elif role == "tool":
            name = names.get(message.get("toolCallId", ""), "a tool")
            lines.append(f"Result of {name}: {text_of(content)[:4000]}")
    return "\n".join(line[:8000] for line in lines)
