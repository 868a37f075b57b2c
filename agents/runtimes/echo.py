"""The deterministic `echo` agent, for tests, demos and benchmarks.

plain text          -> "echo: T" (style=upper uppercases T; signature appends " -- S";
                       image blocks add " [images: N]"), one text_delta per word
/think X            -> thinking "thinking about: X", then "echo: X"
/tool NAME {json}   -> one tool call; /tools [{"name", "input"}, ...] -> parallel calls;
                       once results are in: "tool NAME returned: CONTENT" per call
/error /refuse /max -> raise / stop refusal / "echo: truncated" + max_tokens
/slow N MS          -> "tick 1 ", "tick 2 ", ... MS milliseconds apart
/whoami             -> style, signature, and for apiKey: the first 8 hex of sha256 of a key
                       the session set (proof it arrived), "default" for the operator's
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time

from aap.messages import content_images, content_text, tool_uses

from .base import Compaction, Runtime, StopReason, ToolCall, TurnContext, new_tool_call_id


class EchoError(Exception):
    """Raised on purpose by /error."""


_WORD = re.compile(r"\S+\s*|\s+")


def words(text: str) -> list[str]:
    """Split into words that keep their following whitespace, so they join back exactly."""
    return _WORD.findall(text) or ([text] if text else [])


class EchoRuntime(Runtime):
    kind = "echo"
    title = "Echo (deterministic)"
    config_schema = {
        "type": "object",
        "properties": {"window": {"type": "integer", "minimum": 1, "maximum": 100000}},
        "additionalProperties": False,
    }

    def seed_window(self, config: dict) -> int | None:
        return int(config.get("window", 20))

    async def run(self, ctx: TurnContext) -> StopReason:
        window = int(ctx.config.get("window", 20))
        ctx.set_compacted(Compaction(keep_last=window))
        last = ctx.incoming[-1] if ctx.incoming else None
        if last is None or last.get("role") != "user":
            return await self._reply_to_tool_results(ctx)
        text = content_text(last["content"])
        images = len(content_images(last["content"]))
        return await self._command(ctx, text, images)

    async def _say(self, ctx: TurnContext, text: str, kind: str = "text") -> None:
        for count, match in enumerate(_WORD.finditer(text), 1):  # lazily: a 1 MiB text is 500k words
            await ctx.emit({"event": f"{kind}_delta", "delta": match.group()})
            if count % 64 == 0:
                await asyncio.sleep(0)  # a long message must not hold the loop other turns share

    def _reply(self, ctx: TurnContext, text: str, images: int = 0) -> str:
        if ctx.options.get("style") == "upper":
            text = text.upper()
        reply = f"echo: {text}"
        if images:
            reply += f" [images: {images}]"
        if ctx.options.get("signature"):
            reply += f" -- {ctx.options['signature']}"
        return reply

    async def _command(self, ctx: TurnContext, text: str, images: int) -> StopReason:
        command, _, rest = text.partition(" ")
        if command == "/think":
            await self._say(ctx, f"thinking about: {rest}", "thinking")
            await self._say(ctx, self._reply(ctx, rest))
            return "end_turn"
        if command == "/tool":
            name, _, raw = rest.strip().partition(" ")
            arguments = json.loads(raw) if raw.strip() else {}
            return await self._call(ctx, [ToolCall(new_tool_call_id(), name, arguments)])
        if command == "/tools":
            calls = [ToolCall(new_tool_call_id(), item["name"], item.get("input", {})) for item in json.loads(rest)]
            return await self._call(ctx, calls)
        if command == "/error":
            raise EchoError("echo was asked to fail")
        if command == "/refuse":
            return "refusal"
        if command == "/max":
            await self._say(ctx, "echo: truncated")
            return "max_tokens"
        if command == "/slow":
            count, _, pause = rest.partition(" ")
            n, ms = int(count), int(pause or 0)
            for i in range(1, n + 1):
                if i > 1 and ms:
                    await asyncio.sleep(ms / 1000)
                await ctx.emit({"event": "text_delta", "delta": f"tick {i} ", "_meta": {"emittedAt": time.time()}})
            return "end_turn"
        if command == "/whoami":
            key = ctx.options.get("apiKey", "")
            if "apiKey" not in ctx.options_set:
                # Nothing derived from the operator's secret reaches a tenant.
                digest = "default" if key else "unset"
            else:
                digest = hashlib.sha256(key.encode()).hexdigest()[:8] if key else "unset"
            await self._say(
                ctx,
                f"style={ctx.options.get('style', '')} signature={ctx.options.get('signature', '')} apiKey={digest}",
            )
            return "end_turn"
        await self._say(ctx, self._reply(ctx, text, images))
        return "end_turn"

    async def _call(self, ctx: TurnContext, calls: list[ToolCall]) -> StopReason:
        outcomes = await ctx.call_tools(calls)
        if any(not outcome.resolved for outcome in outcomes):
            return "tool_use"
        await self._report(ctx, [(c.name, o.content) for c, o in zip(calls, outcomes)])
        return "end_turn"

    async def _reply_to_tool_results(self, ctx: TurnContext) -> StopReason:
        """The application answered last turn's calls: report every result in call order."""
        history = list(ctx.history)
        for index in range(len(history) - 1, -1, -1):
            uses = tool_uses(history[index])
            if uses:
                results = {m["toolCallId"]: m["content"] for m in history[index + 1 :] if m.get("role") == "tool"}
                await self._report(ctx, [(use["name"], results.get(use["toolCallId"], "")) for use in uses])
                return "end_turn"
        await self._say(ctx, "echo: no tool calls to report")
        return "end_turn"

    async def _report(self, ctx: TurnContext, results: list[tuple[str, object]]) -> None:
        lines = [f"tool {name} returned: {_as_text(content)}" for name, content in results]
        await self._say(ctx, "\n".join(lines))


def _as_text(content) -> str:
    return content if isinstance(content, str) else content_text(content)
