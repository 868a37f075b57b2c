"""What one turn of the `openai` runtime keeps: its settings, the model call's streamed reply,
and the request body it sends."""

from __future__ import annotations

from dataclasses import dataclass, field

import openai

from aap.messages import fold

from ..base import TurnContext
from .conversion import ChatBuilder, message_json

DEFAULTS = {
    "timeoutSeconds": 60.0,
    "maxRetries": 2,
    "maxModelCalls": 10,
    "contextBudget": 60000,
}


@dataclass
class PartialCall:
    name: str = ""
    arguments: str = ""


@dataclass
class Reply:
    """One model call's streamed answer."""

    text: str = ""
    finish: str | None = None
    calls: dict[int, PartialCall] = field(default_factory=dict)
    usage: tuple[int, int] | None = None
    refused: bool = False
    thinking: str = ""
    opened: bool = False  # the provider answered 200 and its body was being read
    chunks: int = 0  # stream events received

    @property
    def shown(self) -> bool:
        """Deltas of this answer reached the application (asking again would repeat them)."""
        return bool(self.text or self.thinking)


@dataclass
class Turn:
    """What one turn's loop keeps between model calls."""

    ctx: TurnContext
    client: openai.AsyncOpenAI
    model: str
    timeout: float
    budget: int
    tokens_field: str = "max_tokens"  # the request field maxOutputTokens goes in
    retries: int = 2  # how often an answer that showed nothing and failed is asked again
    api_key: str = ""  # redacted from the provider's text in log lines
    tools: list[dict] = field(default_factory=list)  # the function tools offered
    log: list[dict] = field(default_factory=list)  # the events this runtime caused, to fold like the host
    summary: list[dict] = field(default_factory=list)  # this turn's compaction summary, if any
    dropped: int = 0  # leading messages of the history the summary replaces
    chat: list[dict] = field(default_factory=list)  # the Chat Completions messages of the next call
    measured: int | None = None  # tokens the provider reported for the last call (prompt + completion)
    measured_at: int = 0  # len(chat) when `measured` was taken
    chat_tokens: int | None = None  # the estimate of `chat` as the turn began (kept with the history's conversion)
    chat_start: int = 0  # len(chat) when `chat_tokens` was taken
    # (the chat list, start, count, builder): in that list, [start : start + count] are the
    # builder's first `count` messages (the session's kept conversion), whose JSON it keeps.
    # A `chat` rebuilt (a compaction) is another list: the kept JSON no longer applies to it.
    kept: tuple[list[dict], int, int, ChatBuilder] | None = None

    def history(self) -> list[dict]:
        """The compacted history as services will store it: history so far + this turn's messages."""
        return list(self.ctx.history) + fold(self.log)

    def view(self) -> list[dict]:
        """What the model sees: the summary, then the history it does not replace."""
        return self.summary + self.history()[self.dropped :]

    def chat_body(self, **extra) -> dict | bytes:
        """The request of a model call on `chat`. As bytes when the kept conversion still opens
        it: its messages' JSON is reused, so encoding the body costs what the messages new
        since the last turn cost, not the session's length (the SDK sends bytes as they are)."""
        chat = self.chat
        request = self.request(chat, **extra)
        if self.kept is None or self.kept[0] is not chat or request["messages"] is not chat:
            return request  # (the last: an extraBody that sets the messages itself)
        _, start, count, builder = self.kept
        parts = [message_json(m).encode() for m in chat[:start]] + builder.json_of(count)
        parts += [message_json(m).encode() for m in chat[start + count :]]
        rest = {key: value for key, value in request.items() if key != "messages"}
        tail = ("," + message_json(rest)[1:] if rest else "}").encode()
        return b"".join((b'{"messages":[', b",".join(parts), b"]", tail))

    def request(self, messages: list[dict], **extra) -> dict:
        """The chat completion request body, as it goes on the wire (extraBody merged in)."""
        config = self.ctx.config
        request = {"model": self.model, "messages": messages, **extra}
        if "temperature" in config:
            request["temperature"] = config["temperature"]
        if "maxOutputTokens" in config:
            request[self.tokens_field] = config["maxOutputTokens"]
        if config.get("extraBody"):
            request.update(config["extraBody"])
        return request
