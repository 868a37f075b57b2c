"""The wire shapes of the `openai` runtime that every compatible server accepts, and what a
provider's failure text may show in a log line."""

from __future__ import annotations

import pytest

from agents.runtimes.openai.client import default_tokens_field, is_overflow, redact
from agents.runtimes.openai.conversion import ChatBuilder
from agents.runtimes.openai.loop import tool_choice
from tests.unit.test_openai_turn_cost import Ctx

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("base_url", "field"),
    [
        ("https://api.openai.com/v1", "max_completion_tokens"),
        ("http://127.0.0.1:8080/v1", "max_tokens"),
        ("https://openrouter.ai/api/v1", "max_tokens"),
        ("http://localhost:11434/v1", "max_tokens"),
    ],
)
def test_the_max_tokens_field_is_the_one_the_endpoint_reads(base_url, field):
    assert default_tokens_field(base_url) == field


@pytest.mark.parametrize(
    ("configured", "forced", "sent"),
    [
        (None, True, "auto"),
        ("auto", False, "auto"),
        ("none", True, "none"),
        ("omit", True, None),
        ("required", True, "required"),
        ("required", False, "auto"),  # after a tool's result the model must be able to answer
        ("add", True, {"type": "function", "function": {"name": "add"}}),
        ("add", False, "auto"),
        ("missing", True, "auto"),  # a tool this session does not offer
    ],
)
def test_tool_choice(configured, forced, sent):
    config = {"toolChoice": configured} if configured else {}
    assert tool_choice(config, TOOLS, forced=forced) == sent
    assert tool_choice(config, [], forced=forced) is None  # no tools, no tool_choice


def test_an_assistant_tool_call_without_text_has_empty_content_not_null():
    ctx = Ctx("s", [], {}, {})
    history = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": [{"type": "tool_use", "toolCallId": "c1", "name": "add", "input": {}}]},
        {"role": "tool", "toolCallId": "c1", "content": "5"},
    ]
    chat, _ = ChatBuilder(ctx).feed(history).result()
    assert chat[1]["content"] == "" and chat[1]["tool_calls"][0]["id"] == "c1"


def test_log_lines_keep_the_providers_words_without_its_secrets():
    text = (
        "Incorrect API key provided: sk-live-****cdef. Authorization: Bearer abcdef123456, "
        'api_key="hunter2hunter2", own key tenant-key-99 and a token ' + "x" * 40
    )
    shown = redact(text, ("tenant-key-99",))
    assert shown.startswith("Incorrect API key provided: [redacted]")
    for secret in ("sk-live", "cdef", "abcdef123456", "hunter2", "tenant-key-99", "x" * 40):
        assert secret not in shown
    assert len(redact("y " * 1000)) <= 503


def test_context_window_errors_are_recognised():
    import httpx
    import openai

    def error(status, message):
        response = httpx.Response(status, request=httpx.Request("POST", "http://x/v1/chat/completions"))
        return openai.APIStatusError(message, response=response, body={"error": {"message": message}})

    assert is_overflow(error(400, "This model's maximum context length is 2048 tokens."))
    assert is_overflow(error(500, "Requested tokens (3000) exceed context window of 2048"))
    assert is_overflow(error(400, "prompt is too long: 210000 tokens > 200000 maximum"))
    assert not is_overflow(error(400, "Invalid value for temperature."))
    assert not is_overflow(error(401, "maximum context length"))  # a status that never means that
