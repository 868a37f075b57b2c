"""Keeping the prompt inside the context budget: the size estimate, and replacing the oldest
part of the history with a summary the same model writes."""

from __future__ import annotations

import json

import openai

from ..base import AgentError
from .client import TOO_LONG, chat_completion, is_overflow, log_failure, safe_error
from .conversion import CHARS_PER_TOKEN, estimate_tokens, to_chat, transcript
from .state import Turn

SUMMARY_PROMPT = (
    "You compress conversations. Summarize the conversation below so that an assistant can continue it "
    "without seeing it again: keep the user's goals, facts, names, numbers, decisions, tool results that "
    "still matter and open questions. Write plain prose, at most a few paragraphs. Reply with the summary only."
)
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


def prompt_size(turn: Turn, tools: list[dict]) -> int:
    """Measured from the provider's last report when there is one, estimated otherwise."""
    if turn.measured is not None:
        return turn.measured + estimate_tokens(turn.chat[turn.measured_at :])
    if turn.chat_tokens is not None:  # the history's estimate, and what this turn's loop added since
        added = estimate_tokens(turn.chat[turn.chat_start :]) if len(turn.chat) > turn.chat_start else 0
        return turn.chat_tokens + added + (len(json.dumps(tools)) // CHARS_PER_TOKEN if tools else 0)
    return estimate_tokens(turn.chat) + (len(json.dumps(tools)) // CHARS_PER_TOKEN if tools else 0)


async def compact(turn: Turn) -> bool:
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
    cut = next((i for i in cuts if estimate_tokens(to_chat(turn.ctx, view[i:])) <= turn.budget // 2), cuts[-1])
    earlier = [m for m in view[:lead] if is_summary(m)]
    summary = await summarize(turn, earlier + view[lead:cut])
    if not summary:
        return False
    kept = [m for m in view[:lead] if not is_summary(m)]
    turn.dropped += cut - len(turn.summary)
    turn.summary = [*kept, {"role": "system", "content": SUMMARY_PREFIX + summary}]
    turn.measured = None
    turn.chat_tokens = None
    return True


async def summarize(turn: Turn, messages: list[dict]) -> str:
    limit = turn.budget * CHARS_PER_TOKEN * 3 // 4
    text = transcript(messages)
    if len(text) > limit:
        text = "(earlier part left out)\n" + text[-limit:]
    prompt = [
        {"role": "system", "content": turn.ctx.config.get("summaryPrompt") or SUMMARY_PROMPT},
        {"role": "user", "content": text},
    ]
    try:
        answer = await chat_completion(turn.client, turn.request(prompt, stream=False), stream=False)
    except (openai.OpenAIError, ValueError) as exc:
        sentence = TOO_LONG if is_overflow(exc) else safe_error(exc, turn.timeout)
        log_failure(turn.ctx, exc, sentence, api_key=turn.api_key, what="summary call")
        raise AgentError(sentence) from None
    choice = answer.choices[0] if answer.choices else None
    summary = ((choice.message.content if choice else None) or "").strip()
    usage = answer.usage
    if usage:
        turn.ctx.add_usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
    else:  # a server that reports none: the documented estimate, marked as one
        turn.ctx.add_usage(
            prompt_tokens=estimate_tokens(prompt),
            completion_tokens=-(-len(summary) // CHARS_PER_TOKEN),
            estimated=True,
        )
    return summary


def is_summary(message: dict) -> bool:
    return message.get("role") == "system" and str(message.get("content", "")).startswith(SUMMARY_PREFIX)
