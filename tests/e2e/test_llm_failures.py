"""The `openai` runtime against model servers that fail: every failure a server or the network
in front of it produces ends the turn with `error` and a sentence saying what happened, in every
stream mode; no failure leaves the session unable to answer its next turn; usage a server does
not report is estimated and marked; a prompt over the model's window is compacted or told.

Daphne + Celery + PostgreSQL + Redis; the model is the scripted server (tests/fakes), strict
like llama-cpp-python (null content refused)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import log_message

from ..turn_checks import MODES
from .test_limits import assert_429, limited_tenant
from .test_llm_agent import calls, llm_agent, new_session, user

# maxRetries 1: a failure that showed nothing is asked once more (the SDK retries a 5xx once too).
RETRIED = {"timeoutSeconds": 1, "maxRetries": 1}
BROKE = (
    "The connection to the model provider broke while it was answering; the model's answer ended before it finished."
)
KEPT = " The text so far is kept."
PARTIAL = "Half of an answer"

# (the server's replies, the sentence, the text kept). Replies are enough for every retry.
FAILURES = {
    "hang": ([FakeOpenAI.stall(10)], "The model provider stopped sending its answer for 1 seconds (timeout).", ""),
    "500": ([FakeOpenAI.error(500, "upstream exploded")] * 2, "The model provider answered 500 (server error).", ""),
    "html 200": (
        [FakeOpenAI.html()] * 2,
        "The model provider answered 200 with text/html, not an event stream; check the base URL "
        "(a web page or a proxy may have answered).",
        "",
    ),
    "garbage": (
        [FakeOpenAI.garbage()] * 2,
        "The model provider sent a malformed stream (data that is not JSON); the model's answer was not read.",
        "",
    ),
    "empty": (
        [FakeOpenAI.empty()] * 2,
        "The model provider's answer was empty: the stream ended before the model's answer began.",
        "",
    ),
    "early end": (
        [FakeOpenAI.early_end(PARTIAL)],
        "The model's answer ended before it finished (the stream closed without a finish reason)." + KEPT,
        PARTIAL,
    ),
    "cut": ([FakeOpenAI.cut(PARTIAL)], BROKE + KEPT, PARTIAL),
    "reset": ([FakeOpenAI.reset(PARTIAL)], BROKE + KEPT, PARTIAL),
}


@pytest.fixture(scope="module")
def model(pg_stack, tmp_path_factory):
    server = FakeOpenAI(strict=True).start()
    quiet = FakeOpenAI(strict=True, report_usage=False).start()  # reports no usage, like llama-cpp-python
    narrow = FakeOpenAI(strict=True, window=500).start()  # a 500-token window
    agents = [
        llm_agent("llm-fails", server.url, config=RETRIED),
        llm_agent("llm-quiet", quiet.url, config=RETRIED),
        llm_agent("llm-narrow", narrow.url, config={**RETRIED, "contextBudget": 300}),
        llm_agent("llm-overflow", server.url, config={**RETRIED, "contextBudget": 4000}),
        llm_agent("llm-capped", server.url, config={**RETRIED, "maxOutputTokens": 7}),
    ]
    path = tmp_path_factory.mktemp("llm-failure-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": agents}))
    pg_stack.manage("apply_agents", str(path))
    yield server, quiet, narrow
    for fake in (server, quiet, narrow):
        fake.stop()


@pytest.fixture
def fake(model):
    for server in model:
        server.clear()
    return model[0]


def error_of(result) -> str:
    return (result.body if result.body is not None else result.events[-1].data)["_meta"]["error"]


def worker_lines(pg_stack, turn_id: str) -> list[str]:
    lines = []
    for path in pg_stack.log_dir.glob("pg-*.log"):
        lines += [log_message(line) for line in path.read_text(errors="replace").splitlines()]
    return [line for line in lines if turn_id in line]


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("mode", MODES)
def test_every_model_failure_ends_with_error_and_a_sentence(fake, demo, pg_stack, mode, failure):
    replies, sentence, kept = FAILURES[failure]
    session = demo.create_session("llm-fails")
    fake.enqueue(*replies)
    result = demo.turn(session, text="Hello", stream=mode)

    assert result.stop_reason == "error"
    assert error_of(result) == sentence
    expected = [{"role": "assistant", "content": [{"type": "text", "text": kept}]}] if kept else []
    assert result.messages == expected
    assert demo.history(session)[1:] == expected
    # Logged once per failed attempt, with the turn's ids and what the provider said.
    logged = [line for line in worker_lines(pg_stack, result.turn_id) if "model call failed" in line]
    assert logged and all(session in line and "tenant demo" in line for line in logged)
    assert len(logged) == len(fake.chat_requests()) or failure == "500"  # the SDK retried the 500 itself
    if failure == "500":
        assert "status=500 provider said: upstream exploded" in logged[0]

    fake.enqueue(FakeOpenAI.text("Back again."))
    after = demo.turn(session, text="Still there?", stream=mode)
    assert after.stop_reason == "end_turn"
    assert after.messages == [{"role": "assistant", "content": [{"type": "text", "text": "Back again."}]}]


BOOM = [FakeOpenAI.error(500, "down for maintenance")] * 2


@pytest.mark.parametrize(
    "step", ["first call", "after a trusted tool", "after a grant", "after a denial", "after a client tool"]
)
def test_a_session_whose_turn_failed_anywhere_in_the_tool_loop_answers_the_next_turn(fake, demo, step):
    lookup = {"name": "lookup", "description": "Looks a word up.", "parameters": {"type": "object"}}
    trust = step != "after a grant" and step != "after a denial"
    session = new_session(demo, "llm-fails", tools=[{"name": "add", "trust": trust}], client_tools=[lookup])
    if step == "first call":
        fake.enqueue(*BOOM)
        failed = demo.turn(session, text="What is 2 + 3?")
    elif step == "after a trusted tool":
        fake.enqueue(calls(("add", {"a": 2, "b": 3})), *BOOM)
        failed = demo.turn(session, text="What is 2 + 3?")
        assert [m["role"] for m in failed.messages] == ["assistant", "tool"]
    else:
        tool = "lookup" if step == "after a client tool" else "add"
        fake.enqueue(calls((tool, {"a": 2, "b": 3})))
        waiting = demo.turn(session, text="What is 2 + 3?")
        assert waiting.stop_reason == "tool_use"
        [call] = waiting.tool_calls()
        if step == "after a client tool":
            answer = {"role": "tool", "toolCallId": call["toolCallId"], "content": "5"}
        else:
            answer = {"role": "tool_permission", "toolCallId": call["toolCallId"], "granted": step == "after a grant"}
        fake.enqueue(*BOOM)
        failed = demo.turn(session, [answer])
    assert failed.stop_reason == "error"
    assert error_of(failed) == "The model provider answered 500 (server error)."

    fake.enqueue(FakeOpenAI.text("The answer is 5."))
    after = demo.turn(session, text="So?")
    assert after.stop_reason == "end_turn", error_of(after)
    assert after.messages == [{"role": "assistant", "content": [{"type": "text", "text": "The answer is 5."}]}]
    sent = fake.chat_requests()[-1]["json"]["messages"]
    assert all(m.get("content") is not None for m in sent)  # what the strict server checked
    if step != "first call":
        [assistant] = [m for m in sent if m.get("tool_calls")]
        assert assistant["content"] == ""
        assert sent[sent.index(assistant) + 1]["role"] == "tool"


def test_usage_a_server_does_not_report_is_estimated_marked_and_limited(model, pg_stack, tmp_path, db_access):
    from sessions_app.models import Turn

    _, quiet, _ = model
    quiet.clear()
    name, client = limited_tenant(pg_stack, tmp_path, tokensPerDay=20)
    try:
        session = client.create_session("llm-quiet")
        quiet.enqueue(FakeOpenAI.text("An answer of a few words, counted by the runtime."))
        streamed = client.turn(session, text="Tell me something.", stream="delta")
        assert streamed.stop_reason == "end_turn"
        usage = streamed.events[-1].data["_meta"]["usage"]
        assert usage["estimated"] is True
        assert usage["promptTokens"] > 0 and usage["completionTokens"] > 0
        turn = Turn.objects.get(id=streamed.turn_id)
        assert (turn.prompt_tokens, turn.completion_tokens, turn.usage_estimated) == (
            usage["promptTokens"],
            usage["completionTokens"],
            True,
        )
        row = client.get("/v1/usage").json()["total"]
        assert (row["estimatedTurns"], row["promptTokens"]) == (1, usage["promptTokens"])
        # The estimate counts towards the tenant's tokens per day like a reported usage.
        assert_429(client.turn(session, text="more"), "tokensPerDay", "LLM tokens for today")
    finally:
        client.close()


def test_an_over_long_paste_is_told_then_the_session_goes_on_compacted(model, demo):
    _, _, narrow = model
    narrow.clear()
    session = demo.create_session("llm-narrow")
    paste = "lorem ipsum dolor sit amet " * 120  # ~800 tokens: over the window on its own
    result = demo.turn(session, text=paste, stream="delta")
    assert result.stop_reason == "error"
    assert error_of(result) == (
        "The conversation is too long for the model: it does not fit the model's context window even after "
        "compaction; send a shorter message or start a new session."
    )
    assert result.messages == []

    narrow.enqueue(FakeOpenAI.text("The user pasted lorem ipsum."), FakeOpenAI.text("Short answer."))
    after = demo.turn(session, text="Never mind. Hello?", stream="delta")
    assert after.stop_reason == "end_turn", error_of(after)
    assert after.messages == [{"role": "assistant", "content": [{"type": "text", "text": "Short answer."}]}]
    summary_call, answer_call = [r["json"] for r in narrow.chat_requests()[-2:]]
    assert summary_call.get("stream") is not True
    assert paste not in json.dumps(answer_call["messages"])  # the paste was summarized away


def test_a_provider_saying_the_prompt_is_over_its_window_gets_a_compacted_retry(fake, demo):
    session = demo.create_session("llm-overflow")
    fake.enqueue(FakeOpenAI.text("First answer."))
    assert demo.turn(session, text="First question").stop_reason == "end_turn"
    window = "This model's maximum context length is 2048 tokens. However, you requested 3036 tokens."
    fake.enqueue(FakeOpenAI.error(400, window), FakeOpenAI.text("Summary: a first question."), FakeOpenAI.text("Done."))
    result = demo.turn(session, text="Second question", stream="message")
    assert result.stop_reason == "end_turn"
    assert result.messages == [{"role": "assistant", "content": [{"type": "text", "text": "Done."}]}]
    retried = fake.chat_requests()[-1]["json"]["messages"]
    assert "Summary of the earlier conversation:\nSummary: a first question." in retried[0]["content"]
    assert retried[1:] == [{"role": "user", "content": "Second question"}]  # the first exchange summarized


def test_max_tokens_goes_where_every_compatible_server_reads_it(fake, demo):
    demo.turn(demo.create_session("llm-capped"), user("Hi"))
    body = fake.chat_requests()[-1]["json"]
    assert body["max_tokens"] == 7 and "max_completion_tokens" not in body


def test_a_server_that_ignores_stream_is_read_as_one_answer(fake, demo):
    session = demo.create_session("llm-fails")
    fake.enqueue(FakeOpenAI.unstreamed("All at once.", usage=(9, 3)))
    result = demo.turn(session, text="Hello", stream="delta")
    assert result.stop_reason == "end_turn"
    assert result.messages == [{"role": "assistant", "content": [{"type": "text", "text": "All at once."}]}]
    assert result.events[-1].data["_meta"]["usage"] == {"promptTokens": 9, "completionTokens": 3}
