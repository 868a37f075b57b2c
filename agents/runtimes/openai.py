"""The `openai` runtime: any model behind an OpenAI-compatible Chat Completions API.

One turn is an agent loop: the compacted history (and this turn's incoming messages) goes
to the model with the enabled server tools and the client tools as function tools; the
streamed reply becomes `text_delta` / `thinking_delta` events and complete `tool_call`s.
Trusted server tools run inline (the host runs them) and the loop calls the model again;
a client or untrusted call ends the turn with `tool_use`, and the next turn's results
(already in `ctx.history`) continue the loop. When the history grows past the context
budget, its oldest part is replaced by a summary the same model writes.

Options (declared by the operator, overridable by the application): `model`, `apiKey`
(secret), `baseUrl`. Configuration: see `config_schema`. Provider failures end the turn
with stop reason `error` and a short safe sentence (status and kind, never the key, the
request or the provider's message).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass, field

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from aap.messages import content_images, content_text, fold, image_kind
from hosting import tracing

from ..netguard import AddressRefused, GuardedTransport, NonPublicAddress, checked_address
from .base import AgentError, Compaction, Runtime, StopReason, ToolCall, TurnContext, new_tool_call_id

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULTS = {
    "timeoutSeconds": 60.0,
    "maxRetries": 2,
    "maxModelCalls": 10,
    "contextBudget": 60000,
    "maxTokensField": "max_completion_tokens",
}
SUMMARY_PROMPT = (
    "You compress conversations. Summarize the conversation below so that an assistant can continue it "
    "without seeing it again: keep the user's goals, facts, names, numbers, decisions, tool results that "
    "still matter and open questions. Write plain prose, at most a few paragraphs. Reply with the summary only."
)
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
# Sent when the application chose its own base URL without a key: the operator's key never goes there.
NO_KEY = "unused"
IMAGE_TOKENS = 800  # a rough per-image cost for the context estimate
CHARS_PER_TOKEN = 4
OPENAI_TOOL_CALL_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")

STATUS_KINDS = {
    400: "bad request",
    401: "authentication failed; check the API key",
    403: "permission denied",
    404: "not found; check the model name and the base URL",
    408: "request timeout",
    409: "conflict",
    413: "request too large",
    422: "unprocessable request",
    429: "rate limited; retries did not help",
}


def safe_error(exc: BaseException, timeout: float) -> str:
    """A sentence about a provider failure that is safe to show: status and kind only.

    The SDK's own messages are never used: they can carry the provider's text, which may
    quote part of the API key or the request.
    """
    if isinstance(exc, openai.APITimeoutError):
        return f"The model provider did not answer within {timeout:g} seconds (timeout)."
    if isinstance(exc, openai.APIConnectionError):
        if isinstance(exc.__cause__, AddressRefused):  # a redirect or a changed DNS answer, refused by the guard
            return "The model provider's address is not a public one; an application may only choose public endpoints."
        return "Could not connect to the model provider (connection error); check the base URL."
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        kind = STATUS_KINDS.get(status) or ("server error" if status >= 500 else "error")
        return f"The model provider answered {status} ({kind})."
    if isinstance(exc, openai.APIResponseValidationError):
        return "The model provider sent a response that could not be read."
    if isinstance(exc, openai.APIError):
        return "The model provider reported an error while answering."
    if isinstance(exc, ValueError):
        return "The model provider sent a malformed stream."
    return "The model client could not be set up; check the agent's options."


def estimate_tokens(chat: list[dict]) -> int:
    """A provider-independent estimate of a prompt's size (about four characters a token)."""
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
    return chars // CHARS_PER_TOKEN + images * IMAGE_TOKENS


@dataclass
class _PartialCall:
    name: str = ""
    arguments: str = ""


@dataclass
class _Reply:
    """One model call's streamed answer."""

    text: str = ""
    finish: str | None = None
    calls: dict[int, _PartialCall] = field(default_factory=dict)
    usage: tuple[int, int] | None = None
    refused: bool = False


@dataclass
class _Turn:
    """What one turn's loop keeps between model calls."""

    ctx: TurnContext
    client: openai.AsyncOpenAI
    model: str
    timeout: float
    budget: int
    log: list[dict] = field(default_factory=list)  # the events this runtime caused, to fold like the host
    summary: list[dict] = field(default_factory=list)  # this turn's compaction summary, if any
    dropped: int = 0  # leading messages of the history the summary replaces
    chat: list[dict] = field(default_factory=list)  # the Chat Completions messages of the next call
    measured: int | None = None  # tokens the provider reported for the last call (prompt + completion)
    measured_at: int = 0  # len(chat) when `measured` was taken

    def history(self) -> list[dict]:
        """The compacted history as services will store it: history so far + this turn's messages."""
        return list(self.ctx.history) + fold(self.log)

    def view(self) -> list[dict]:
        """What the model sees: the summary, then the history it does not replace."""
        return self.summary + self.history()[self.dropped :]


class OpenAIRuntime(Runtime):
    """An agent backed by an OpenAI-compatible Chat Completions server (OpenAI, vLLM, Ollama, ...)."""

    kind = "openai"
    title = "OpenAI-compatible model"
    config_schema = {
        "type": "object",
        "properties": {
            "model": {"type": "string", "description": "Model when no 'model' option is declared."},
            "baseUrl": {"type": "string", "description": "Base URL when no 'baseUrl' option is declared."},
            "systemPrompt": {"type": "string"},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "maxOutputTokens": {"type": "integer", "minimum": 1},
            "maxTokensField": {"enum": ["max_completion_tokens", "max_tokens"]},
            "contextBudget": {"type": "integer", "minimum": 200},
            "timeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
            "maxRetries": {"type": "integer", "minimum": 0, "maximum": 10},
            "maxModelCalls": {"type": "integer", "minimum": 1, "maximum": 100},
            "summaryPrompt": {"type": "string"},
            "extraBody": {"type": "object", "description": "Extra JSON fields sent with every model call."},
            "allowedBaseUrls": {
                "type": "array", "items": {"type": "string"},
                "description": "Base URLs an application may choose beyond public addresses (e.g. a model "
                               "server on the private network); any other it chooses must be public.",
            },
        },
        "additionalProperties": False,
    }

    def __init__(self):
        self._http: tuple[asyncio.AbstractEventLoop, object] | None = None
        self._guarded_http: tuple[asyncio.AbstractEventLoop, object] | None = None

    # --- setup ----------------------------------------------------------------------------------

    def _client(self, *, api_key: str, base_url: str, timeout: float, retries: int, guarded: bool = False) -> openai.AsyncOpenAI:
        # One connection pool per process and loop; the per-turn SDK client is a cheap view on it.
        loop = asyncio.get_running_loop()
        if guarded:
            # Endpoints an application chose: every request (redirects too) checked and pinned.
            if self._guarded_http is None or self._guarded_http[0] is not loop:
                self._guarded_http = (loop, openai.DefaultAsyncHttpxClient(transport=GuardedTransport()))
            http_client = self._guarded_http[1]
        else:
            if self._http is None or self._http[0] is not loop:
                self._http = (loop, openai.DefaultAsyncHttpxClient())
            http_client = self._http[1]
        return openai.AsyncOpenAI(
            api_key=api_key, base_url=base_url, timeout=timeout, max_retries=retries, http_client=http_client
        )

    def _start(self, ctx: TurnContext) -> _Turn:
        config = ctx.config
        options = ctx.options
        model = (options.get("model") or config.get("model") or "").strip()
        if not model:
            raise AgentError("No model is configured for this agent; set the 'model' option.")
        base_url = (options.get("baseUrl") or config.get("baseUrl") or DEFAULT_BASE_URL).strip()
        if not base_url.startswith(("http://", "https://")):
            raise AgentError("The base URL must start with http:// or https://.")
        api_key = options.get("apiKey") or ""
        operator_url = (config.get("baseUrl") or DEFAULT_BASE_URL).strip()
        if (
            "baseUrl" in ctx.options_set
            and "apiKey" not in ctx.options_set
            and base_url.rstrip("/") != operator_url.rstrip("/")
        ):
            api_key = ""  # the operator's key only ever goes to the operator's base URL
        timeout = float(config.get("timeoutSeconds", DEFAULTS["timeoutSeconds"]))
        client = self._client(
            api_key=api_key or NO_KEY,
            base_url=base_url,
            timeout=timeout,
            retries=int(config.get("maxRetries", DEFAULTS["maxRetries"])),
            guarded=_application_chosen(ctx, base_url),
        )
        return _Turn(
            ctx=ctx, client=client, model=model, timeout=timeout,
            budget=int(config.get("contextBudget", DEFAULTS["contextBudget"])),
        )

    # --- the loop -------------------------------------------------------------------------------

    async def run(self, ctx: TurnContext) -> StopReason:
        turn = self._start(ctx)
        if _application_chosen(ctx, str(turn.client.base_url)):
            await _check_endpoint(turn.client.base_url)
        try:
            return await self._loop(turn)
        except asyncio.CancelledError:
            # A cancel can land between the host's events and this loop's record of them:
            # keep the history uncompacted (the next turn compacts again) rather than miscount.
            turn.summary = []
            raise
        finally:
            if turn.summary:
                ctx.set_compacted(Compaction(keep_last=len(turn.history()) - turn.dropped, summary=turn.summary))

    async def _loop(self, turn: _Turn) -> StopReason:
        ctx = turn.ctx
        limit = int(ctx.config.get("maxModelCalls", DEFAULTS["maxModelCalls"]))
        tools = self._tools(ctx)
        turn.chat = self._chat(ctx, turn.view())
        calls = 0
        while True:
            if calls >= limit:
                ctx.set_stop_meta(modelCallLimit=limit)
                return "max_tokens"
            if self._prompt_size(turn, tools) > turn.budget and await self._compact(turn):
                turn.chat = self._chat(ctx, turn.view())
            calls += 1
            reply = await self._call(turn, tools)
            if reply.refused:
                return "refusal"
            if reply.calls and reply.finish not in ("length", "content_filter"):
                if await self._run_tool_calls(turn, reply):
                    return "tool_use"
                continue
            return {"length": "max_tokens", "content_filter": "refusal"}.get(reply.finish or "", "end_turn")

    async def _emit(self, turn: _Turn, event: dict) -> None:
        turn.log.append(event)
        await turn.ctx.emit(event)

    def _request(self, turn: _Turn, messages: list[dict], **extra) -> dict:
        """The chat completion request body, as it goes on the wire (extraBody merged in)."""
        config = turn.ctx.config
        request = {"model": turn.model, "messages": messages, **extra}
        if "temperature" in config:
            request["temperature"] = config["temperature"]
        if "maxOutputTokens" in config:
            request[config.get("maxTokensField", DEFAULTS["maxTokensField"])] = config["maxOutputTokens"]
        if config.get("extraBody"):
            request.update(config["extraBody"])
        return request

    @tracing.model_call
    async def _call(self, turn: _Turn, tools: list[dict]) -> _Reply:
        """One streamed model call: deltas are emitted as they come, tool calls joined per index."""
        reply = _Reply()
        request = self._request(turn, turn.chat, stream=True, stream_options={"include_usage": True})
        if tools:
            request["tools"] = tools
        try:
            stream = await _chat_completion(turn.client, request, stream=True)
            # Leaving this block (end, error or the turn's cancellation) closes the upstream stream.
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        reply.usage = (chunk.usage.prompt_tokens or 0, chunk.usage.completion_tokens or 0)
                    for choice in chunk.choices or []:
                        if choice.index in (0, None):  # one choice asked for; some servers omit its index
                            await self._absorb(turn, reply, choice)
        except (openai.OpenAIError, ValueError) as exc:
            raise AgentError(safe_error(exc, turn.timeout)) from None
        prompt, completion = reply.usage or (0, 0)
        turn.ctx.add_usage(prompt_tokens=prompt, completion_tokens=completion)
        turn.measured = prompt + completion if reply.usage else None
        return reply

    async def _absorb(self, turn: _Turn, reply: _Reply, choice) -> None:
        if choice.finish_reason:
            reply.finish = choice.finish_reason
        delta = choice.delta
        if delta is None:
            return
        extra = delta.model_extra or {}
        # Servers name the reasoning stream differently; some send both with the same text.
        reasoning = extra.get("reasoning_content") or extra.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            await self._emit(turn, {"event": "thinking_delta", "delta": reasoning})
        for piece in (delta.content, delta.refusal):
            if piece:
                reply.text += piece
                await self._emit(turn, {"event": "text_delta", "delta": piece})
        if delta.refusal:
            reply.refused = True
        for fragment in delta.tool_calls or []:
            function = fragment.function
            index = fragment.index
            if index is None:  # servers that leave the index out start each call with its id or name
                starts = fragment.id or (function is not None and function.name)
                index = len(reply.calls) if starts or not reply.calls else max(reply.calls)
            partial = reply.calls.setdefault(index, _PartialCall())
            if function is None:
                continue
            if function.name and function.name != partial.name:
                partial.name = function.name if not partial.name else partial.name + function.name
            partial.arguments += function.arguments or ""

    async def _run_tool_calls(self, turn: _Turn, reply: _Reply) -> bool:
        """Hand the model's tool calls to the host; returns True if any waits on the application."""
        ctx = turn.ctx
        valid: list[ToolCall] = []
        problems: dict[str, str] = {}
        assistant_calls = []
        for _, partial in sorted(reply.calls.items()):
            # Our own ids: servers' ids may repeat across turns or be missing.
            call_id = new_tool_call_id()
            arguments, problem = _parse_arguments(partial)
            if problem:
                problems[call_id] = problem
            else:
                valid.append(ToolCall(call_id, partial.name, arguments))
            assistant_calls.append({
                "id": call_id, "type": "function",
                "function": {"name": partial.name or "unknown", "arguments": json.dumps(arguments) if not problem else "{}"},
            })
        # A call with unreadable arguments never reaches the application (no event, no
        # history): the model gets a tool result saying so inside this loop and may retry.
        outcomes = {}
        if valid:
            for outcome in await ctx.call_tools(valid):
                outcomes[outcome.call.toolCallId] = outcome
            turn.log.extend(call.as_event() for call in valid)
            turn.log.extend(
                {"event": "tool_result", "toolCallId": call.toolCallId, "content": outcomes[call.toolCallId].content}
                for call in valid
                if outcomes[call.toolCallId].resolved
            )
        turn.chat.append({"role": "assistant", "content": reply.text or None, "tool_calls": assistant_calls})
        turn.measured_at = len(turn.chat)
        for call in assistant_calls:
            call_id = call["id"]
            if call_id in problems:
                turn.chat.append({"role": "tool", "tool_call_id": call_id, "content": problems[call_id]})
            elif outcomes[call_id].resolved:
                turn.chat.append({"role": "tool", "tool_call_id": call_id, "content": _text(outcomes[call_id].content)})
        return any(not outcome.resolved for outcome in outcomes.values())

    # --- tools and messages ---------------------------------------------------------------------

    @staticmethod
    def _tools(ctx: TurnContext) -> list[dict]:
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

    @staticmethod
    def _chat(ctx: TurnContext, messages: list[dict]) -> list[dict]:
        """AAP history messages -> Chat Completions messages.

        Thinking blocks stay out (providers reject or ignore them); every assistant tool call
        is answered right after it (a missing result gets a placeholder); tool results that
        answer nothing are left out; leading system messages become one.
        """
        accepted = ctx.capabilities.get("image", {})
        chat: list[dict] = []
        system = [ctx.config["systemPrompt"]] if ctx.config.get("systemPrompt") else []
        open_calls: list[str] = []
        tool_images: list[dict] = []
        started = False

        def close_calls() -> None:
            for call_id in open_calls:
                chat.append({"role": "tool", "tool_call_id": call_id, "content": "No result was recorded for this call."})
            open_calls.clear()
            if tool_images:
                chat.append({"role": "user", "content": [{"type": "text", "text": "Images returned by the tools:"}, *tool_images]})
                tool_images.clear()

        for message in messages:
            role = message.get("role")
            content = message.get("content")
            if role == "system" and not started:
                system.append(content)
                continue
            started = True
            if role == "tool":
                call_id = _call_id(message.get("toolCallId", ""))
                if call_id not in open_calls:
                    continue
                open_calls.remove(call_id)
                chat.append({"role": "tool", "tool_call_id": call_id, "content": _text(content)})
                tool_images.extend(_image_parts(content, accepted, strict=True))
                continue
            close_calls()
            if role == "system":
                chat.append({"role": "system", "content": content})
            elif role == "user":
                chat.append({"role": "user", "content": _user_content(content, accepted)})
            elif role == "assistant":
                blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
                text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
                calls = [
                    {"id": _call_id(b["toolCallId"]), "type": "function",
                     "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}}
                    for b in blocks
                    if b.get("type") == "tool_use"
                ]
                entry: dict = {"role": "assistant", "content": text or None}
                if calls:
                    entry["tool_calls"] = calls
                    open_calls.extend(call["id"] for call in calls)
                elif not text:
                    continue  # e.g. only thinking: nothing the provider needs
                chat.append(entry)
        close_calls()
        if system:
            chat.insert(0, {"role": "system", "content": "\n\n".join(system)})
        return chat

    # --- compaction -----------------------------------------------------------------------------

    def _prompt_size(self, turn: _Turn, tools: list[dict]) -> int:
        """Measured from the provider's last report when there is one, estimated otherwise."""
        if turn.measured is not None:
            return turn.measured + estimate_tokens(turn.chat[turn.measured_at :])
        return estimate_tokens(turn.chat) + (len(json.dumps(tools)) // CHARS_PER_TOKEN if tools else 0)

    async def _compact(self, turn: _Turn) -> bool:
        """Replace the oldest part of the history with a summary; False when nothing can go.

        The cut is always right before a user message, so a tool call is never separated
        from its results, and the newest user message always stays. Leading system
        messages (other than earlier summaries) are kept as they are.
        """
        view = turn.view()
        lead = 0
        while lead < len(view) and view[lead].get("role") == "system":
            lead += 1
        cuts = [i for i in range(lead + 1, len(view)) if view[i].get("role") == "user"]
        if not cuts:
            return False
        cut = next(
            (i for i in cuts if estimate_tokens(self._chat(turn.ctx, view[i:])) <= turn.budget // 2), cuts[-1]
        )
        earlier = [m for m in view[:lead] if _is_summary(m)]
        summary = await self._summarize(turn, earlier + view[lead:cut])
        if not summary:
            return False
        kept = [m for m in view[:lead] if not _is_summary(m)]
        turn.dropped += cut - len(turn.summary)
        turn.summary = kept + [{"role": "system", "content": SUMMARY_PREFIX + summary}]
        turn.measured = None
        return True

    async def _summarize(self, turn: _Turn, messages: list[dict]) -> str:
        limit = turn.budget * CHARS_PER_TOKEN * 3 // 4
        transcript = _transcript(messages)
        if len(transcript) > limit:
            transcript = "(earlier part left out)\n" + transcript[-limit:]
        prompt = [
            {"role": "system", "content": turn.ctx.config.get("summaryPrompt") or SUMMARY_PROMPT},
            {"role": "user", "content": transcript},
        ]
        try:
            answer = await _chat_completion(turn.client, self._request(turn, prompt, stream=False), stream=False)
        except (openai.OpenAIError, ValueError) as exc:
            raise AgentError(safe_error(exc, turn.timeout)) from None
        usage = answer.usage
        turn.ctx.add_usage(
            prompt_tokens=usage.prompt_tokens if usage else 0, completion_tokens=usage.completion_tokens if usage else 0
        )
        choice = answer.choices[0] if answer.choices else None
        return ((choice.message.content if choice else None) or "").strip()


# --- helpers -----------------------------------------------------------------------------------


def _application_chosen(ctx: TurnContext, base_url: str) -> bool:
    """The application set this base URL (not the operator) and the operator did not allow it:
    it goes through the network guard."""
    if "baseUrl" not in ctx.options_set:
        return False
    url = base_url.rstrip("/")
    for allowed in ctx.config.get("allowedBaseUrls") or []:
        allowed = str(allowed).rstrip("/")
        if allowed and (url == allowed or url.startswith(allowed + "/")):
            return False
    return True


async def _check_endpoint(base_url) -> None:
    """Refuse, before any call, a chosen base URL whose host is not public (no retries, a clear sentence)."""
    url = httpx.URL(str(base_url))
    try:
        await checked_address(url.host, url.port or (443 if url.scheme == "https" else 80))
    except NonPublicAddress as exc:
        raise AgentError(
            f"The base URL's host {exc.host} is {exc.reason}, not a public address; an application may only "
            "choose public endpoints (the operator can allow others in the agent's allowedBaseUrls)."
        ) from None
    except AddressRefused as exc:
        raise AgentError(str(exc)) from None


async def _chat_completion(client: openai.AsyncOpenAI, body: dict, *, stream: bool):
    """POST /chat/completions with `body` sent as it is (the SDK's documented `post` for raw
    requests). `chat.completions.create()` first walks every message of the history through
    the SDK's type-driven transform: milliseconds per call that grow with the session (43 ms at
    400 messages), where the body built here is already plain JSON. The SDK still does the
    rest: authentication, retries, timeouts, errors and the parsing of the streamed chunks."""
    return await client.post(
        "/chat/completions",
        body=body,
        cast_to=ChatCompletion,
        stream=stream,
        stream_cls=openai.AsyncStream[ChatCompletionChunk] if stream else None,
    )


def _parse_arguments(partial: _PartialCall) -> tuple[dict, str]:
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


def _is_summary(message: dict) -> bool:
    return message.get("role") == "system" and str(message.get("content", "")).startswith(SUMMARY_PREFIX)


def _call_id(value: str) -> str:
    """A tool call id providers accept (at most 40 characters), stable for the same input."""
    if OPENAI_TOOL_CALL_ID_RE.match(value):
        return value
    return "call_" + hashlib.sha256(value.encode()).hexdigest()[:32]


def _text(content) -> str:
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
        return _text(content)
    parts = []
    for block in content:
        if block.get("type") == "text":
            parts.append({"type": "text", "text": block["text"]})
        elif block.get("type") == "image":
            parts.extend(_image_parts([block], accepted))
    return parts


def _transcript(messages: list[dict]) -> str:
    """The part of the history to summarize, as plain text (tools and images named, not sent)."""
    names: dict[str, str] = {}
    lines = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            lines.append(f"[Earlier summary or instructions] {_text(content)}")
        elif role == "user":
            images = len(content_images(content)) if isinstance(content, list) else 0
            lines.append(f"User: {_text(content)}" + (f" [{images} image(s)]" if images else ""))
        elif role == "assistant":
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for block in blocks:
                if block.get("type") == "text" and block["text"]:
                    lines.append(f"Assistant: {block['text']}")
                elif block.get("type") == "tool_use":
                    names[block["toolCallId"]] = block["name"]
                    lines.append(f"Assistant called {block['name']}({json.dumps(block.get('input') or {})})")
        elif role == "tool":
            name = names.get(message.get("toolCallId", ""), "a tool")
            lines.append(f"Result of {name}: {_text(content)[:4000]}")
    return "\n".join(line[:8000] for line in lines)
