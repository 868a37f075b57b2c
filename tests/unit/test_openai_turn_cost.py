"""A turn of the `openai` runtime converts only the messages its session gained since the
previous turn: turn 1,000 of a session does the work turn 10 does, and sends the model what
converting the whole history again would."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from agents.runtimes.openai import OpenAIRuntime, conversion, state
from agents.runtimes.openai.conversion import to_chat
from tests.fakes.openai_server import FakeOpenAI


@dataclass
class Ctx:
    """The parts of a TurnContext the runtime reads, and what it reports."""

    session_id: str
    history: list[dict]
    config: dict
    options: dict
    turn_id: str = "turn"
    tenant: str = "t"
    agent_name: str = "a"
    options_set: frozenset = frozenset()
    server_tools: dict = field(default_factory=dict)
    client_tools: dict = field(default_factory=dict)
    incoming: list = field(default_factory=list)
    permissions: list = field(default_factory=list)
    capabilities: dict = field(default_factory=dict)
    events: list = field(default_factory=list)

    async def emit(self, event):
        self.events.append(event)

    async def call_tools(self, calls):
        raise AssertionError("no tools here")

    def request_permission(self, call):
        raise AssertionError("no tools here")

    def set_compacted(self, compaction):
        raise AssertionError("a short session never compacts")

    def add_usage(self, **usage):
        pass

    def set_stop_meta(self, **meta):
        pass


@pytest.fixture
def model():
    with FakeOpenAI(record=True) as server:
        yield server


def run_session(
    runtime: OpenAIRuntime,
    model: FakeOpenAI,
    session: str,
    turns: int,
    *,
    system: str = "",
    first: int = 1,
    encoded: list | None = None,
) -> dict:
    """Turns `first` to `turns` of one session (the history of the turns before `first` as if
    they had run elsewhere); returns {turn number: (messages converted, request sent)}, and
    with `encoded` (the list a counting JSON encoder appends to) the JSON texts each turn made
    as a third item."""
    history: list[dict] = []
    for number in range(1, first):
        history.append({"role": "user", "content": f"question {number}"})
        history.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {number}"}]})
    config = {"systemPrompt": system} if system else {}
    seen = {}

    async def go():
        for number in range(first, turns + 1):
            history.append({"role": "user", "content": f"question {number}"})
            ctx = Ctx(session, list(history), config, {"model": "m", "apiKey": "k", "baseUrl": model.url})
            assert await runtime.run(ctx) == "end_turn"
            text = "".join(e["delta"] for e in ctx.events if e["event"] == "text_delta")
            history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            seen[number] = (runtime.converted_last, model.chat_requests()[-1]["json"]["messages"])
            if encoded is not None:
                seen[number] += (len(encoded),)
                encoded.clear()
            model.clear()

    asyncio.run(go())
    return seen, history


def test_turn_1000_converts_what_turn_10_converts_and_sends_the_whole_history(model):
    runtime = OpenAIRuntime()
    short, _ = run_session(runtime, model, "s-short", 10, system="Be brief.")
    assert short[1][0] == 1
    assert short[10][0] == 2  # the last answer and the new question
    # Turns 998-1,000 of a long session: the first of them, new to this process, converts
    # the whole history; each later one only what it gained, like turn 10.
    seen, history = run_session(runtime, model, "s-long", 1000, system="Be brief.", first=998)
    assert seen[998][0] == 1 + 2 * 997
    assert seen[999][0] == seen[1000][0] == 2
    ctx = Ctx("other", history[:-1], {"systemPrompt": "Be brief."}, {})
    assert seen[1000][1] == to_chat(ctx, history[:-1])  # what a full conversion gives
    assert len(seen[1000][1]) == 1 + 1999


def test_turn_1000_encodes_the_request_body_turn_10_encodes(model, monkeypatch):
    """The kept conversion keeps each message's JSON text: a turn's request body encodes its
    new messages and the request's other fields, not the session's whole history."""
    encoded: list = []
    real = conversion.message_json

    def counting(value):
        encoded.append(value)
        return real(value)

    monkeypatch.setattr(conversion, "message_json", counting)
    monkeypatch.setattr(state, "message_json", counting)
    runtime = OpenAIRuntime()
    short, _ = run_session(runtime, model, "s-short", 10, system="Be brief.", encoded=encoded)
    seen, history = run_session(runtime, model, "s-long", 1000, system="Be brief.", first=998, encoded=encoded)
    assert seen[998][2] > 1995  # new to this process: every message once
    assert seen[999][2] == seen[1000][2] == short[10][2] <= 5  # the lead, 2 new messages, the other fields
    ctx = Ctx("other", history[:-1], {"systemPrompt": "Be brief."}, {})
    assert seen[1000][1] == to_chat(ctx, history[:-1])  # the body still carries the whole history


def test_a_history_that_changed_at_its_start_is_converted_again(model):
    runtime = OpenAIRuntime()
    run_session(runtime, model, "s", 5)
    history = [
        {"role": "system", "content": "Summary of the earlier conversation:\nhello"},
        {"role": "user", "content": "question 1"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "next"},
    ]

    async def go():
        ctx = Ctx("s", history, {}, {"model": "m", "apiKey": "k", "baseUrl": model.url})
        assert await runtime.run(ctx) == "end_turn"

    asyncio.run(go())
    assert runtime.converted_last == len(history)
    assert model.chat_requests()[-1]["json"]["messages"] == to_chat(Ctx("x", history, {}, {}), history)


def test_one_sdk_client_per_endpoint_per_process(model):
    runtime = OpenAIRuntime()

    async def go():
        made = set()
        for number in range(3):
            ctx = Ctx(
                f"s{number}",
                [{"role": "user", "content": "hi"}],
                {},
                {"model": "m", "apiKey": "k", "baseUrl": model.url},
            )
            assert await runtime.run(ctx) == "end_turn"
            made.add(id(runtime._clients.get(api_key="k", base_url=model.url, timeout=60.0, retries=2)))
        return made

    assert len(asyncio.run(go())) == 1


def test_the_guarded_transport_carries_the_sdks_own_requests(model):
    """The openai SDK builds its clients on its own httpx package (httpx2, a fork): the network
    guard's connection pools must take that package's requests, or every model call to an
    application-chosen endpoint fails inside the transport."""
    import httpx2
    import openai

    from agents.netguard import GuardedTransport

    async def go():
        # allow_private: the fake model is on loopback; the pools are the same as for a public address
        http = openai.DefaultAsyncHttpxClient(transport=GuardedTransport(allow_private=True))
        assert isinstance(http, httpx2.AsyncClient)
        client = openai.AsyncOpenAI(api_key="k", base_url=model.url, http_client=http, max_retries=0)
        models = await client.models.list()
        await http.aclose()
        return [m.id for m in models.data]

    assert asyncio.run(go())


def test_an_unread_streamed_error_body_leaves_the_provider_text_empty():
    """A status error whose streamed body was never read (httpx2 raises ResponseNotRead for its
    text) is logged without the provider's words, not raised from the logging."""
    import httpx2
    import openai

    from agents.runtimes.openai.client import provider_text

    async def body():
        yield b'{"error": {"message": "overloaded"}}'

    request = httpx2.Request("POST", "https://models.example/v1/chat/completions")
    response = httpx2.Response(500, request=request, content=body())
    assert provider_text(openai.InternalServerError("Error code: 500", response=response, body=None)) == ""
