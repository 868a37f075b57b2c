"""The `openai` runtime's agent loop: model calls, streamed deltas, tool calls.

One turn is an agent loop: the compacted history (and this turn's incoming messages) goes
to the model with the enabled server tools and the client tools as function tools; the
streamed reply becomes `text_delta` / `thinking_delta` events and complete `tool_call`s.
Trusted server tools run inline (the host runs them) and the loop calls the model again;
a client or untrusted call ends the turn with `tool_use`, and the next turn's results
(already in `ctx.history`) continue the loop. When the history grows past the context
budget, its oldest part is replaced by a summary the same model writes.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

import openai
from openai.types.chat import ChatCompletionMessageToolCallParam

from infra import tracing

from ..base import AgentError, Compaction, Runtime, StopReason, ToolCall, TurnContext, new_tool_call_id
from ..mcp_config import MCP_SERVERS_SCHEMA
from ..mcp_config import check as check_mcp_servers
from .client import (
    DEFAULT_BASE_URL,
    NO_KEY,
    TOO_LONG,
    Clients,
    ContextOverflow,
    StreamFailed,
    application_chosen,
    chat_completion,
    check_endpoint,
    default_tokens_field,
    is_overflow,
    log_failure,
    safe_error,
    timed_out,
)
from .compaction import compact, prompt_size
from .conversion import CHARS_PER_TOKEN, ChatBuilder, function_tools, parse_arguments, text_of, to_chat
from .state import DEFAULTS, PartialCall, Reply, Turn

HISTORIES_KEPT = 128  # sessions whose converted history a worker process keeps between turns


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def tool_choice(config: dict, tools: list[dict], *, forced: bool) -> str | dict | None:
    """The tool_choice of a call offering `tools` (None: send none). Without one, some servers
    (llama-cpp-python) leave the tools out of the prompt; a forcing choice on every call
    would never let the model answer, so it applies to the first call after a user message."""
    choice = str(config.get("toolChoice") or "auto")
    if choice == "omit" or not tools:
        return None
    if choice in ("auto", "none"):
        return choice
    if not forced:
        return "auto"
    if choice == "required":
        return choice
    if any(tool["function"]["name"] == choice for tool in tools):
        return {"type": "function", "function": {"name": choice}}
    return "auto"  # a tool this session does not offer


def _probes(history: list[dict], length: int) -> tuple:
    """The first, middle and last of the first `length` messages: what a kept conversion checks."""
    if length <= 0:
        return ()
    return (history[0], history[(length - 1) // 2], history[length - 1])


#: The stop reason of a reply the model finished for a reason other than its answer.
FINISH_STOP_REASONS: dict[str, StopReason] = {"length": "max_tokens", "content_filter": "refusal"}


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
            "maxTokensField": {
                "enum": ["max_completion_tokens", "max_tokens"],
                "description": "The request field maxOutputTokens goes in (default: max_completion_tokens for "
                "OpenAI's own API, max_tokens for any other server).",
            },
            "toolChoice": {
                "type": "string",
                "minLength": 1,
                "description": "tool_choice sent with the tools: auto (default), none, required, omit (send no "
                "tool_choice), or a tool's name to force that tool. A forcing choice (required or a name) applies "
                "to the first model call after a user message; the loop's later calls send auto.",
            },
            "contextBudget": {"type": "integer", "minimum": 200},
            "timeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
            "maxRetries": {"type": "integer", "minimum": 0, "maximum": 10},
            "maxModelCalls": {"type": "integer", "minimum": 1, "maximum": 100},
            "summaryPrompt": {"type": "string"},
            "extraBody": {"type": "object", "description": "Extra JSON fields sent with every model call."},
            "allowedBaseUrls": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Base URLs an application may choose beyond public addresses (e.g. a model "
                "server on the private network); any other it chooses must be public.",
            },
            "mcpServers": MCP_SERVERS_SCHEMA,
        },
        "additionalProperties": False,
    }

    @classmethod
    def validate_config(cls, config) -> dict:
        config = super().validate_config(config)
        problem = check_mcp_servers(config.get("mcpServers") or [])
        if problem is not None:
            where, sentence = problem
            raise ValueError(f"Runtime configuration for '{cls.kind}' is invalid at '{where}': {sentence}.")
        return config

    def __init__(self):
        self._clients = Clients()
        # Per session: the history converted to the model's format as the last turn here began,
        # fed only the new messages next time (turn cost must not grow with the session).
        self._chats: OrderedDict[str, tuple[tuple, tuple, ChatBuilder]] = OrderedDict()
        self.converted_last = 0  # history messages the last turn converted (observability, tests)

    # --- setup ----------------------------------------------------------------------------------

    def _start(self, ctx: TurnContext) -> Turn:
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
        client = self._clients.get(
            api_key=api_key or NO_KEY,
            base_url=base_url,
            timeout=timeout,
            retries=int(config.get("maxRetries", DEFAULTS["maxRetries"])),
            guarded=application_chosen(ctx, base_url),
        )
        return Turn(
            ctx=ctx,
            client=client,
            model=model,
            timeout=timeout,
            budget=int(config.get("contextBudget", DEFAULTS["contextBudget"])),
            tokens_field=config.get("maxTokensField") or default_tokens_field(base_url),
            retries=int(config.get("maxRetries", DEFAULTS["maxRetries"])),
            api_key=api_key,
        )

    # --- the loop -------------------------------------------------------------------------------

    async def run(self, ctx: TurnContext) -> StopReason:
        turn = self._start(ctx)
        if application_chosen(ctx, str(turn.client.base_url)):
            await check_endpoint(turn.client.base_url)
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

    async def _loop(self, turn: Turn) -> StopReason:
        ctx = turn.ctx
        limit = int(ctx.config.get("maxModelCalls", DEFAULTS["maxModelCalls"]))
        tools = turn.tools = function_tools(ctx)
        turn.chat, turn.chat_tokens, turn.kept = self._history_chat(ctx)
        turn.chat_start = len(turn.chat)
        # A forcing tool choice applies to the model's first answer to a user message only.
        forced = bool(ctx.history) and ctx.history[-1].get("role") == "user"
        calls = 0
        overflowed = False
        while True:
            if calls >= limit:
                ctx.set_stop_meta(modelCallLimit=limit)
                return "max_tokens"
            if prompt_size(turn, tools) > turn.budget and await compact(turn):
                turn.chat = to_chat(ctx, turn.view())
            calls += 1
            try:
                reply = await self._call(turn, tools, tool_choice(ctx.config, tools, forced=forced and calls == 1))
            except ContextOverflow:
                # Compact (again) and ask once more; a prompt that still does not fit is told as such.
                if overflowed or not await compact(turn):
                    raise AgentError(TOO_LONG) from None
                overflowed = True
                turn.chat = to_chat(ctx, turn.view())
                continue
            if reply.refused:
                return "refusal"
            if reply.calls and reply.finish not in ("length", "content_filter"):
                if await self._run_tool_calls(turn, reply):
                    return "tool_use"
                continue
            return FINISH_STOP_REASONS.get(reply.finish or "", "end_turn")

    def _history_chat(self, ctx: TurnContext) -> tuple[list[dict], int, tuple[list[dict], int, int, ChatBuilder]]:
        """The turn's history in the model's format, its token estimate and where the builder's
        messages are in it (Turn.kept), converting only the messages added since this process
        last saw the session (all of them on a miss).

        A kept conversion is used only when the history still starts with what it was built
        from (the same first, middle and last messages at the same places: history only grows
        at its end, and compaction replaces its start) and the agent's prompt and accepted
        images are the same; otherwise it is rebuilt."""
        history = ctx.history
        setup = (ctx.config.get("systemPrompt"), tuple(sorted(ctx.capabilities.get("image", {}))))
        kept = self._chats.pop(ctx.session_id, None)
        builder = None
        if kept is not None:
            kept_setup, probes, candidate = kept
            if kept_setup == setup and len(history) >= candidate.fed and probes == _probes(history, candidate.fed):
                builder = candidate
        if builder is None:
            builder = ChatBuilder(ctx)
        before = builder.converted
        builder.feed(history[builder.fed :])
        self.converted_last = builder.converted - before
        chat, tokens = builder.result()
        if builder.settled and history:
            self._chats[ctx.session_id] = (setup, _probes(history, builder.fed), builder)
            while len(self._chats) > HISTORIES_KEPT:
                self._chats.popitem(last=False)
        return chat, tokens, (chat, 1 if builder.system else 0, len(builder.chat), builder)

    async def _emit(self, turn: Turn, event: dict) -> None:
        turn.log.append(event)
        await turn.ctx.emit(event)

    @tracing.model_call
    async def _call(self, turn: Turn, tools: list[dict], choice: str | dict | None = None) -> Reply:
        """One model call, its answer streamed as events; asked again (up to maxRetries) when an
        answer that cannot be trusted (cut, empty, unreadable) had shown nothing yet.

        Raises ContextOverflow when the prompt is over the model's window, AgentError (a safe
        sentence, logged once with the provider's own words) for any other failure."""
        attempt = 0
        while True:
            reply = Reply()
            try:
                await self._stream(turn, tools, choice, reply)
            except asyncio.CancelledError:
                self._count(turn, reply)  # what a cancelled answer used still counts
                raise
            except (openai.OpenAIError, ValueError, StreamFailed) as exc:
                self._count(turn, reply)
                if is_overflow(exc) or (isinstance(exc, StreamFailed) and exc.overflow):
                    log_failure(turn.ctx, exc, "the prompt is over the model's context window", api_key=turn.api_key)
                    raise ContextOverflow from None
                sentence = safe_error(exc, turn.timeout, streaming=reply.opened)
                if reply.text or reply.thinking:
                    sentence += " The text so far is kept."
                log_failure(turn.ctx, exc, sentence, api_key=turn.api_key)
                retry = reply.opened and not reply.shown and not timed_out(exc)
                if retry and attempt < turn.retries:
                    attempt += 1
                    continue
                raise AgentError(sentence) from None
            self._count(turn, reply)
            return reply

    async def _stream(self, turn: Turn, tools: list[dict], choice: str | dict | None, reply: Reply) -> None:
        """Stream one answer into `reply`; raises StreamFailed when it is not proven complete (a
        finish reason), the SDK's errors otherwise."""
        extra: dict = {"stream": True, "stream_options": {"include_usage": True}}
        if tools:
            extra["tools"] = tools
            if choice is not None:
                extra["tool_choice"] = choice
        request = turn.chat_body(**extra)
        stream = await chat_completion(turn.client, request, stream=True)
        reply.opened = True
        # Leaving this block (end, error or the turn's cancellation) closes the upstream stream.
        async with stream:
            kind = stream.response.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind == "application/json":  # a server that ignores `stream`: one answer in one body
                await self._absorb_whole(turn, reply, await stream.response.aread())
            elif kind not in ("text/event-stream", ""):
                body = (await stream.response.aread())[:300].decode(errors="replace")
                raise StreamFailed(
                    f"The model provider answered 200 with {kind}, not an event stream; check the base URL "
                    "(a web page or a proxy may have answered).",
                    status=stream.response.status_code,
                    detail=body,
                )
            else:
                async for chunk in stream:
                    # Plain JSON objects (see chat_completion): read defensively, a server may omit anything.
                    if not isinstance(chunk, dict):
                        raise ValueError("a stream event that is not a JSON object")
                    reply.chunks += 1
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        reply.usage = (_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))
                    for choice_ in chunk.get("choices") or []:
                        # One choice asked for; some servers omit its index.
                        if isinstance(choice_, dict) and choice_.get("index") in (0, None):
                            await self._absorb(turn, reply, choice_)
        if reply.finish is None:
            if not (reply.text or reply.thinking or reply.calls):
                # Nothing at all: what a server does with a prompt over its window (llama.cpp streams
                # an empty 200) when the prompt is over the budget; an empty answer otherwise.
                raise StreamFailed(
                    "The model provider's answer was empty: the stream ended before the model's answer began.",
                    overflow=prompt_size(turn, tools) > turn.budget,
                    detail="an empty stream",
                )
            raise StreamFailed(
                "The model's answer ended before it finished (the stream closed without a finish reason).",
                detail=f"the stream ended after {reply.chunks} chunks without a finish reason",
            )

    async def _absorb_whole(self, turn: Turn, reply: Reply, raw: bytes) -> None:
        """A non-streamed answer (a JSON body) read like a stream of one chunk."""
        answer = json.loads(raw)
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            raise ValueError("a JSON answer that is not a chat completion")
        reply.chunks += 1
        usage = answer.get("usage")
        if isinstance(usage, dict):
            reply.usage = (_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))
        for choice in answer["choices"]:
            if isinstance(choice, dict) and choice.get("index") in (0, None):
                message = choice["message"] if isinstance(choice.get("message"), dict) else {}
                calls = [
                    {**c, "index": i} for i, c in enumerate(message.get("tool_calls") or []) if isinstance(c, dict)
                ]
                delta = {**message, "tool_calls": calls}
                await self._absorb(turn, reply, {"delta": delta, "finish_reason": choice.get("finish_reason")})

    def _count(self, turn: Turn, reply: Reply) -> None:
        """Record the call's usage: the provider's report, else an estimate (marked as such) of
        what was sent and what came back, once the model had begun to answer."""
        if reply.usage:
            prompt, completion = reply.usage
            turn.ctx.add_usage(prompt_tokens=prompt, completion_tokens=completion)
            turn.measured = prompt + completion
            return
        turn.measured = None
        if not reply.chunks:  # no answer began (refused, empty, a web page): nothing was generated
            return
        produced = len(reply.text) + len(reply.thinking)
        produced += sum(len(call.name) + len(call.arguments) for call in reply.calls.values())
        turn.ctx.add_usage(
            prompt_tokens=prompt_size(turn, turn.tools),
            completion_tokens=-(-produced // CHARS_PER_TOKEN),
            estimated=True,
        )

    async def _absorb(self, turn: Turn, reply: Reply, choice: dict) -> None:
        if choice.get("finish_reason"):
            reply.finish = str(choice["finish_reason"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        # Servers name the reasoning stream differently; some send both with the same text.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            reply.thinking += reasoning
            await self._emit(turn, {"event": "thinking_delta", "delta": reasoning})
        refusal = delta.get("refusal")
        for piece in (delta.get("content"), refusal):
            if isinstance(piece, str) and piece:
                reply.text += piece
                await self._emit(turn, {"event": "text_delta", "delta": piece})
        if refusal:
            reply.refused = True
        for fragment in delta.get("tool_calls") or []:
            if not isinstance(fragment, dict):
                continue
            function = fragment.get("function")
            function = function if isinstance(function, dict) else None
            index = fragment.get("index")
            if not isinstance(index, int):  # servers that leave the index out start each call with its id or name
                starts = fragment.get("id") or (function is not None and function.get("name"))
                index = len(reply.calls) if starts or not reply.calls else max(reply.calls)
            partial = reply.calls.setdefault(index, PartialCall())
            if function is None:
                continue
            name, arguments = function.get("name"), function.get("arguments")
            if isinstance(name, str) and name and name != partial.name:
                partial.name = name if not partial.name else partial.name + name
            if isinstance(arguments, str):
                partial.arguments += arguments

    async def _run_tool_calls(self, turn: Turn, reply: Reply) -> bool:
        """Hand the model's tool calls to the host; returns True if any waits on the application."""
        ctx = turn.ctx
        valid: list[ToolCall] = []
        problems: dict[str, str] = {}
        assistant_calls: list[ChatCompletionMessageToolCallParam] = []
        for _, partial in sorted(reply.calls.items()):
            # Our own ids: servers' ids may repeat across turns or be missing.
            call_id = new_tool_call_id()
            arguments, problem = parse_arguments(partial)
            if problem:
                problems[call_id] = problem
            else:
                valid.append(ToolCall(call_id, partial.name, arguments))
            assistant_calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": partial.name or "unknown",
                        "arguments": json.dumps(arguments) if not problem else "{}",
                    },
                }
            )
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
        # "" and not null: servers that validate messages (llama-cpp-python) refuse null content.
        turn.chat.append({"role": "assistant", "content": reply.text, "tool_calls": assistant_calls})
        turn.measured_at = len(turn.chat)
        for call in assistant_calls:
            call_id = call["id"]
            if call_id in problems:
                turn.chat.append({"role": "tool", "tool_call_id": call_id, "content": problems[call_id]})
            elif outcomes[call_id].resolved:
                turn.chat.append(
                    {"role": "tool", "tool_call_id": call_id, "content": text_of(outcomes[call_id].content)}
                )
        return any(not outcome.resolved for outcome in outcomes.values())
