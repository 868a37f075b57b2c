"""The `openai` runtime end to end: Daphne + Celery + PostgreSQL + Redis, with the model
provider faked by a scripted OpenAI-compatible server that the worker reaches over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import AAP, ROOT, free_port, parse_sse

OPERATOR_KEY = "sk-operator-default-key-0001"
ADD = {"name": "add", "title": "Add", "description": "Adds two numbers a and b.", "implementation": "add"}
CLOCK = {"name": "clock", "description": "Returns the current UTC time.", "implementation": "clock"}
LOOKUP = {
    "name": "lookup",
    "description": "Looks a word up in the application's dictionary.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}
ALL_STREAMS = {"delta": {}, "message": {}, "none": {}}


def llm_agent(name: str, url: str, *, config: dict | None = None, images: bool = False, tools=(ADD, CLOCK)) -> dict:
    capabilities = {"history": {"compacted": {}, "full": {}}, "stream": ALL_STREAMS, "application": {"tools": {}}}
    if images:
        capabilities["image"] = {"http": {}, "data": {}}
    return {
        "name": name,
        "title": f"Test model agent {name}",
        "runtime": {
            "kind": "openai",
            "config": {
                "systemPrompt": "You are a test agent.",
                "timeoutSeconds": 30,
                "maxRetries": 2,
                **(config or {}),
            },
        },
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "secret", "name": "apiKey", "default": OPERATOR_KEY},
            {"type": "text", "name": "baseUrl", "default": url},
        ],
        "tools": list(tools),
        "capabilities": capabilities,
    }


# A second provider and a closed port an application may choose as its base URL: both are
# on 127.0.0.1, which the network guard refuses unless the operator allows them.
ELSEWHERE = FakeOpenAI()
CLOSED_URL = f"http://127.0.0.1:{free_port()}/v1"


@pytest.fixture(scope="module")
def elsewhere():
    ELSEWHERE.start()
    yield ELSEWHERE
    ELSEWHERE.stop()


@pytest.fixture(scope="module")
def fake(pg_stack, tmp_path_factory, elsewhere):
    server = FakeOpenAI(strict=True).start()  # refuses null content, as llama-cpp-python does
    agents = [
        llm_agent("llm-main", server.url, config={"maxModelCalls": 3, "allowedBaseUrls": [elsewhere.url, CLOSED_URL]}),
        llm_agent("llm-vision", server.url, images=True),
        llm_agent("llm-impatient", server.url, config={"timeoutSeconds": 1, "maxRetries": 0}),
        llm_agent("llm-compact", server.url, config={"contextBudget": 400}),
    ]
    path = tmp_path_factory.mktemp("llm-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": agents}))
    pg_stack.manage("apply_agents", str(path))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh(fake):
    fake.clear()
    yield


def new_session(client: AAP, name: str, *, tools=None, options=None, client_tools=None, messages=None) -> str:
    """Create a session of agent `name` with server tools, options, client tools and seed messages."""
    agent: dict = {}
    if tools is not None:
        agent["tools"] = tools
    if options is not None:
        agent["options"] = options
    body: dict = {}
    if client_tools is not None:
        body["tools"] = client_tools
    if messages is not None:
        body["messages"] = messages
    return client.create_session(name, agent=agent, **body)


TRUSTED_ADD = [{"name": "add", "trust": True}]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def calls(*items: tuple[str, dict | str]) -> FakeOpenAI:
    return FakeOpenAI.tool_calls(
        [{"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)} for name, args in items]
    )


def normalized(messages: list[dict]) -> list[dict]:
    """Messages with tool call ids replaced by their order of appearance."""
    ids: dict[str, str] = {}
    text = json.dumps(messages)
    for message in messages:
        for block in message["content"] if isinstance(message.get("content"), list) else []:
            if block.get("type") == "tool_use":
                ids.setdefault(block["toolCallId"], f"id{len(ids)}")
    for real, placeholder in ids.items():
        text = text.replace(real, placeholder)
    return json.loads(text)


def chat_bodies(fake: FakeOpenAI) -> list[dict]:
    return [r["json"] for r in fake.chat_requests()]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def complete_events(buffer: bytes):
    """The events of the complete SSE frames received so far."""
    end = buffer.rfind(b"\n\n")
    return parse_sse(buffer[: end + 2])[0] if end >= 0 else []


# --- the agent loop ----------------------------------------------------------------------------


def test_meta_lists_the_openai_agent_without_its_key(fake, demo):
    info = next(a for a in demo.meta()["agents"] if a["name"] == "llm-main")
    options = {o["name"]: o["default"] for o in info["options"]}
    assert options == {"model": "fake-model", "apiKey": "***", "baseUrl": fake.url}
    assert OPERATOR_KEY not in json.dumps(demo.meta())


@pytest.mark.parametrize("mode", ["none", "delta", "message"])
def test_trusted_tool_runs_inline_then_the_model_answers_in_every_mode(fake, demo, mode):
    session = new_session(demo, "llm-main", tools=TRUSTED_ADD)
    fake.enqueue(calls(("add", {"a": 2, "b": 3})), FakeOpenAI.text("The sum is 5."))
    result = demo.turn(session, text="What is 2 + 3?", stream=mode)

    assert result.status == 200 and result.stop_reason == "end_turn"
    expected = [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "toolCallId": "id0", "name": "add", "input": {"a": 2, "b": 3}}],
        },
        {"role": "tool", "toolCallId": "id0", "content": "5"},
        {"role": "assistant", "content": [{"type": "text", "text": "The sum is 5."}]},
    ]
    assert normalized(result.messages) == expected
    assert normalized(demo.history(session)[1:]) == expected
    if mode == "delta":
        assert result.names[:3] == ["turn_start", "tool_call", "tool_result"]
        assert [e.data["delta"] for e in result.events if e.event == "text_delta"] == ["The ", "sum ", "is ", "5."]
    if mode == "message":
        assert result.names == ["turn_start", "tool_call", "tool_result", "text", "turn_stop"]

    first, second = chat_bodies(fake)
    assert first["model"] == "fake-model" and first["stream"] is True
    assert first["messages"] == [
        {"role": "system", "content": "You are a test agent."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert [t["function"]["name"] for t in first["tools"]] == ["add"]
    assert first["tool_choice"] == second["tool_choice"] == "auto"  # some servers leave tools out without it
    assert fake.chat_requests()[0]["headers"]["authorization"] == f"Bearer {OPERATOR_KEY}"
    call_id = result.tool_calls()[0]["toolCallId"]
    assert second["messages"][2:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "5"},
    ]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_deltas_stream_as_thinking(fake, demo, field):
    session = demo.create_session("llm-main")
    fake.enqueue(FakeOpenAI.text("Four.", reasoning="Two and two make four.", reasoning_field=field))
    result = demo.turn(session, text="2+2?", stream="delta")
    assert [e.event for e in result.events[1:-1]] == ["thinking_delta"] * 5 + ["text_delta"]
    assert result.messages == [
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "Two and two make four."}, {"type": "text", "text": "Four."}],
        }
    ]

    fake.enqueue(FakeOpenAI.text("Yes."))
    demo.turn(session, text="Sure?")
    # Earlier thinking is not sent back to the provider.
    assert chat_bodies(fake)[-1]["messages"][2] == {"role": "assistant", "content": "Four."}


@pytest.mark.parametrize(
    ("finish", "stop_reason"), [("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal")]
)
def test_finish_reasons_become_stop_reasons(fake, demo, finish, stop_reason):
    session = demo.create_session("llm-main")
    fake.enqueue(FakeOpenAI.text("Partial", finish=finish))
    result = demo.turn(session, text="Go", stream="message")
    assert result.stop_reason == stop_reason
    assert result.messages == [{"role": "assistant", "content": [{"type": "text", "text": "Partial"}]}]


def test_the_per_turn_model_call_limit_stops_with_max_tokens(fake, demo):
    session = new_session(demo, "llm-main", tools=TRUSTED_ADD)
    fake.enqueue(*[calls(("add", {"a": i, "b": 1})) for i in range(3)])
    result = demo.turn(session, text="Keep adding")
    assert result.stop_reason == "max_tokens"
    assert result.body["_meta"]["modelCallLimit"] == 3
    assert [m["content"] for m in result.messages if m["role"] == "tool"] == ["1", "2", "3"]
    assert len(fake.chat_requests()) == 3


def test_client_tool_round_trip(fake, demo):
    session = new_session(demo, "llm-main", client_tools=[LOOKUP])
    fake.enqueue(calls(("lookup", {"q": "aap"})))
    first = demo.turn(session, text="What does AAP mean?", stream="delta")
    assert first.stop_reason == "tool_use"
    (call,) = first.tool_calls()
    assert (call["name"], call["input"]) == ("lookup", {"q": "aap"})
    assert "tool_result" not in first.names
    assert [t["function"]["name"] for t in chat_bodies(fake)[0]["tools"]] == ["lookup"]

    fake.enqueue(FakeOpenAI.text("It means Agent Application Protocol."))
    answer = demo.turn(
        session, [{"role": "tool", "toolCallId": call["toolCallId"], "content": "Agent Application Protocol"}]
    )
    assert answer.stop_reason == "end_turn"
    assert answer.messages == [
        {"role": "assistant", "content": [{"type": "text", "text": "It means Agent Application Protocol."}]}
    ]
    sent = chat_bodies(fake)[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == call["toolCallId"]
    assert sent[-1] == {"role": "tool", "tool_call_id": call["toolCallId"], "content": "Agent Application Protocol"}


def test_parallel_untrusted_calls_wait_for_permission_and_a_denial_reaches_the_model(fake, demo):
    session = new_session(demo, "llm-main", tools=[{"name": "add", "trust": False}])
    fake.enqueue(calls(("add", {"a": 1, "b": 2}), ("add", {"a": 30, "b": 40})))
    first = demo.turn(session, text="Add both", stream="delta")
    assert first.stop_reason == "tool_use"
    one, two = first.tool_calls()
    assert (one["input"], two["input"]) == ({"a": 1, "b": 2}, {"a": 30, "b": 40})  # fragments joined per index

    fake.enqueue(FakeOpenAI.text("One sum only."))
    second = demo.turn(
        session,
        [
            {"role": "tool_permission", "toolCallId": one["toolCallId"], "granted": True},
            {"role": "tool_permission", "toolCallId": two["toolCallId"], "granted": False, "reason": "too large"},
        ],
        stream="delta",
    )
    assert second.stop_reason == "end_turn"
    assert [e.data["content"] for e in second.events if e.event == "tool_result"] == [
        "3",
        "Tool call denied: too large",
    ]
    sent = chat_bodies(fake)[-1]["messages"]
    assert sent[-2:] == [
        {"role": "tool", "tool_call_id": one["toolCallId"], "content": "3"},
        {"role": "tool", "tool_call_id": two["toolCallId"], "content": "Tool call denied: too large"},
    ]


def test_invalid_tool_arguments_never_reach_the_application(fake, demo):
    session = new_session(demo, "llm-main", client_tools=[LOOKUP])
    fake.enqueue(calls(("lookup", '{"q": "unfinished')), FakeOpenAI.text("Sorry, I will answer directly."))
    result = demo.turn(session, text="Look it up", stream="delta")

    assert result.stop_reason == "end_turn"
    assert "tool_call" not in result.names
    assert result.messages == [
        {"role": "assistant", "content": [{"type": "text", "text": "Sorry, I will answer directly."}]}
    ]
    assert "unfinished" not in json.dumps(demo.history(session))
    retry = chat_bodies(fake)[1]["messages"]
    assert retry[-2]["tool_calls"][0]["function"]["name"] == "lookup"
    assert retry[-1]["role"] == "tool" and "not valid JSON" in retry[-1]["content"]
    assert retry[-1]["tool_call_id"] == retry[-2]["tool_calls"][0]["id"]


def test_seeded_history_is_what_the_model_sees(fake, demo):
    session = new_session(
        demo,
        "llm-main",
        messages=[
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "greet"}, {"type": "text", "text": "Salut"}],
            },
        ],
    )
    demo.turn(session, text="How are you?")
    assert chat_bodies(fake)[0]["messages"] == [
        {"role": "system", "content": "You are a test agent.\n\nAnswer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "How are you?"},
    ]


def test_images_are_sent_as_image_parts_when_the_agent_accepts_them(fake, demo):
    data_uri = "data:image/png;base64,iVBORw0KGgo="
    content = [
        {"type": "text", "text": "What is in these?"},
        {"type": "image", "url": "https://example.com/cat.png"},
        {"type": "image", "url": data_uri},
    ]
    session = demo.create_session("llm-vision")
    result = demo.turn(session, [{"role": "user", "content": content}])
    assert result.stop_reason == "end_turn"
    assert chat_bodies(fake)[0]["messages"][-1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            {"type": "image_url", "image_url": {"url": data_uri}},
        ],
    }

    plain = demo.create_session("llm-main")
    refused = demo.post(f"/v1/sessions/{plain}/turns", {"messages": [{"role": "user", "content": content}]})
    assert refused.status_code == 400
    assert "capabilities.image" in refused.json()["error"]
    assert len(fake.chat_requests()) == 1


def test_usage_is_summed_on_the_turn_the_session_and_the_tenant(fake, pg_stack, db_access):
    from django.contrib import admin
    from django.test import RequestFactory

    from sessions_app.models import Session, Turn
    from tenancy.admin import TenantAdmin
    from tenancy.models import Tenant

    token = pg_stack.manage("create_tenant", "llm-usage").strip().splitlines()[-1]
    client = AAP(pg_stack.base_url, token)
    try:
        session = new_session(client, "llm-main", tools=TRUSTED_ADD)
        fake.enqueue(
            FakeOpenAI.tool_calls([{"name": "add", "arguments": '{"a": 1, "b": 1}'}], usage=(11, 3)),
            FakeOpenAI.text("2", usage=(17, 5)),
        )
        streamed = client.turn(session, text="1+1", stream="delta")
        assert streamed.events[-1].data["_meta"]["usage"] == {"promptTokens": 28, "completionTokens": 8}

        fake.enqueue(FakeOpenAI.text("Bye", usage=(7, 2)))
        answered = client.turn(session, text="Thanks")
        assert answered.body["_meta"]["usage"] == {"promptTokens": 7, "completionTokens": 2}
        assert answered.body["_meta"]["turnId"] == answered.turn_id
    finally:
        client.close()

    row = Session.objects.get(public_id=session)
    assert (row.prompt_tokens, row.completion_tokens) == (35, 10)
    turns = Turn.objects.filter(session=row).order_by("created_at")
    assert [(t.prompt_tokens, t.completion_tokens, t.model_calls) for t in turns] == [(28, 8, 2), (7, 2, 1)]
    tenant_admin = TenantAdmin(Tenant, admin.site)
    shown = tenant_admin.get_queryset(RequestFactory().get("/admin/hosting/tenant/")).get(name="llm-usage")
    assert (tenant_admin.prompt_tokens(shown), tenant_admin.completion_tokens(shown)) == (35, 10)


def test_cancel_closes_the_upstream_stream(fake, demo):
    session = demo.create_session("llm-main")
    words = [f"w{i} " for i in range(100)]
    fake.enqueue(FakeOpenAI.text("".join(words), chunks=words, delay=0.1))
    buffer, events = b"", []
    with demo.http.stream(
        "POST", f"/v1/sessions/{session}/turns", json={"messages": user("Talk slowly"), "stream": "delta"}
    ) as response:
        turn_id = response.headers["AAP-Turn-Id"]
        cancelled = False
        for chunk in response.iter_bytes():
            buffer += chunk
            events = complete_events(buffer)
            if not cancelled and any(e.event == "text_delta" for e in events):
                assert demo.post(f"/v1/sessions/{session}/turns/{turn_id}/cancel").status_code == 202
                cancelled = True
    stop = events[-1]
    assert stop.event == "turn_stop" and stop.data["stopReason"] == "end_turn" and stop.data["_meta"]["cancelled"]
    wait_for(lambda: fake.disconnects == [0], what="the fake to see the stream closed")
    streamed = "".join(e.data["delta"] for e in events if e.event == "text_delta")
    assert 0 < len(streamed) < len("".join(words))
    assert demo.history(session)[-1] == {"role": "assistant", "content": [{"type": "text", "text": streamed}]}


def test_client_disconnect_does_not_stop_the_turn(fake, demo):
    session = demo.create_session("llm-main")
    words = [f"w{i} " for i in range(10)]
    fake.enqueue(FakeOpenAI.text("".join(words), chunks=words, delay=0.1))
    buffer = b""
    with demo.http.stream(
        "POST", f"/v1/sessions/{session}/turns", json={"messages": user("Talk"), "stream": "delta"}
    ) as response:
        for chunk in response.iter_bytes():
            buffer += chunk
            if any(e.event == "text_delta" for e in complete_events(buffer)):
                break  # the application goes away
    full = wait_for(lambda: len(h := demo.history(session)) == 2 and h, what="the turn to land in history")
    assert full[-1] == {"role": "assistant", "content": [{"type": "text", "text": "".join(words)}]}
    assert fake.disconnects == []


# --- provider failures ------------------------------------------------------------------------


def test_a_bad_api_key_ends_the_turn_with_error_and_never_shows_the_key(fake, demo, pg_stack, log_dir, db_access):
    from sessions_app.models import Message, Turn

    bad_key = "sk-live-tenant-SECRET-key-4242abcdef"
    provider_text = "Incorrect API key provided: sk-live-****************************cdef."
    session = new_session(demo, "llm-main", options={"apiKey": bad_key})
    fake.enqueue(FakeOpenAI.error(401, provider_text), FakeOpenAI.error(401, provider_text))

    answered = demo.turn(session, text="Hello")
    streamed = demo.turn(session, text="Hello again", stream="delta")
    sentence = "The model provider answered 401 (authentication failed; check the API key)."
    assert answered.stop_reason == streamed.stop_reason == "error"
    assert answered.body["_meta"]["error"] == streamed.events[-1].data["_meta"]["error"] == sentence
    assert fake.chat_requests()[0]["headers"]["authorization"] == f"Bearer {bad_key}"

    fake.enqueue(FakeOpenAI.text("Fine now."))
    assert demo.turn(session, text="Once more").stop_reason == "end_turn"  # the session goes on

    seen = [
        answered.raw,
        streamed.raw,
        demo.get(f"/v1/sessions/{session}").content,
        json.dumps(demo.history(session, "full")).encode(),
        json.dumps(demo.history(session, "compacted")).encode(),
    ]
    seen += [m.encode() for m in Message.objects.filter(session__public_id=session).values_list("data", flat=True)]
    seen += [e.encode() for e in Turn.objects.filter(session__public_id=session).values_list("error", flat=True)]
    for blob in seen:
        for secret in (bad_key, "4242abcdef", "Incorrect API key"):
            assert secret.encode() not in blob
    # The worker's log tells the operator why, in the provider's own words, with the key masked.
    logs = b"".join(p.read_bytes() for p in log_dir.iterdir() if p.is_file())
    assert b"Incorrect API key provided: [redacted]" in logs
    for secret in (bad_key, "4242abcdef", "sk-live-"):
        assert secret.encode() not in logs


@pytest.mark.parametrize(
    ("replies", "sentence"),
    [
        (
            [FakeOpenAI.error(404, "The model `fake-model` does not exist or you do not have access to it.")],
            "The model provider answered 404 (not found; check the model name and the base URL).",
        ),
        (
            [FakeOpenAI.error(500, "upstream exploded near /internal/shard-7")] * 3,
            "The model provider answered 500 (server error).",
        ),
        (
            [FakeOpenAI.error(429, "Rate limit reached for org-secret123")] * 3,
            "The model provider answered 429 (rate limited; retries did not help).",
        ),
    ],
)
def test_provider_failures_end_with_a_safe_error(fake, demo, replies, sentence):
    session = demo.create_session("llm-main")
    fake.enqueue(*replies)
    result = demo.turn(session, text="Hello", stream="message")
    assert result.stop_reason == "error"
    assert result.events[-1].data["_meta"]["error"] == sentence
    assert replies[0].message.encode() not in result.raw
    assert len(fake.chat_requests()) == len(replies)  # 404 is not retried; 429 and 5xx are, twice


def test_a_rate_limited_call_is_retried(fake, demo):
    session = demo.create_session("llm-main")
    fake.enqueue(FakeOpenAI.error(429, "Slow down"), FakeOpenAI.text("Made it."))
    result = demo.turn(session, text="Hello")
    assert result.stop_reason == "end_turn"
    assert result.messages == [{"role": "assistant", "content": [{"type": "text", "text": "Made it."}]}]
    assert len(fake.chat_requests()) == 2


def test_a_stalled_stream_times_out_with_error(fake, demo):
    session = demo.create_session("llm-impatient")
    fake.enqueue(FakeOpenAI.stall(10))
    result = demo.turn(session, text="Hello", stream="delta")
    assert result.stop_reason == "error"
    assert (
        result.events[-1].data["_meta"]["error"]
        == "The model provider stopped sending its answer for 1 seconds (timeout)."
    )


def test_an_unreachable_provider_gives_a_connection_error(fake, demo):
    session = new_session(demo, "llm-main", options={"baseUrl": CLOSED_URL, "apiKey": "sk-own"})
    result = demo.turn(session, text="Hello")
    assert result.stop_reason == "error"
    assert (
        result.body["_meta"]["error"]
        == "Could not connect to the model provider (connection error); check the base URL."
    )


def test_the_operator_key_never_goes_to_a_base_url_the_application_chose(fake, demo, elsewhere):
    elsewhere.clear()
    session = new_session(demo, "llm-main", options={"baseUrl": elsewhere.url})
    assert demo.turn(session, text="Hello").stop_reason == "end_turn"
    assert elsewhere.chat_requests()[0]["headers"]["authorization"] == "Bearer unused"
    assert OPERATOR_KEY not in json.dumps(elsewhere.requests)

    demo.turn(session, text="Again", agent={"options": {"apiKey": "sk-tenant-own"}})
    assert elsewhere.chat_requests()[1]["headers"]["authorization"] == "Bearer sk-tenant-own"
    assert fake.chat_requests() == []


# --- compaction -------------------------------------------------------------------------------


def _pairs_unbroken(messages: list[dict]) -> bool:
    """Every tool message answers a tool_use of the assistant message right before its run."""
    for index, message in enumerate(messages):
        if message["role"] != "tool":
            continue
        back = index - 1
        while messages[back]["role"] == "tool":
            back -= 1
        owner = messages[back]
        ids = (
            [b["toolCallId"] for b in owner["content"] if b.get("type") == "tool_use"]
            if owner["role"] == "assistant"
            else []
        )
        if message["toolCallId"] not in ids:
            return False
    return True


def test_a_long_session_is_compacted_with_full_history_intact(fake, demo):
    session = new_session(demo, "llm-compact", tools=TRUSTED_ADD)
    long_question = "First, remember this: " + "alpha " * 150
    fake.enqueue(FakeOpenAI.text("Noted.", usage=(310, 2)))
    assert demo.turn(session, text=long_question).stop_reason == "end_turn"
    assert demo.history(session, "compacted") == demo.history(session, "full")  # under budget: untouched

    # The provider reports a prompt past the budget: compacted before the next call of the turn.
    fake.enqueue(
        FakeOpenAI.tool_calls([{"name": "add", "arguments": '{"a": 2, "b": 3}'}], usage=(395, 20)),
        FakeOpenAI.text("SUMMARY-ONE: the user asked to remember alpha."),
        FakeOpenAI.text("It is 5."),
    )
    second = demo.turn(session, text="Now add 2 and 3.")
    assert second.stop_reason == "end_turn"
    bodies = chat_bodies(fake)
    summary_request = bodies[2]
    assert not summary_request.get("stream") and "alpha alpha" in summary_request["messages"][-1]["content"]
    assert "alpha alpha" not in json.dumps(bodies[3]["messages"])
    assert "SUMMARY-ONE" in bodies[3]["messages"][0]["content"]
    assert [m["role"] for m in bodies[3]["messages"]] == ["system", "user", "assistant", "tool"]

    compacted = demo.history(session, "compacted")
    assert compacted[0]["role"] == "system" and "SUMMARY-ONE" in compacted[0]["content"]
    assert compacted[1] == {"role": "user", "content": "Now add 2 and 3."}
    assert [m["role"] for m in compacted[2:]] == ["assistant", "tool", "assistant"]
    assert _pairs_unbroken(compacted)

    # Estimated before the first call: a long new message compacts at the start of the turn.
    fake.enqueue(FakeOpenAI.text("SUMMARY-TWO: alpha, then 2 + 3 = 5."), FakeOpenAI.text("Done."))
    third = demo.turn(session, text="And now: " + "beta " * 300)
    assert third.stop_reason == "end_turn"
    summary_request = chat_bodies(fake)[4]
    assert "SUMMARY-ONE" in summary_request["messages"][-1]["content"]
    assert "add" in summary_request["messages"][-1]["content"]
    compacted = demo.history(session, "compacted")
    assert [m["role"] for m in compacted] == ["system", "user", "assistant"]
    assert "SUMMARY-TWO" in compacted[0]["content"]

    full = demo.history(session, "full")
    assert [m["role"] for m in full] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert full[0] == {"role": "user", "content": long_question}
    assert _pairs_unbroken(full)
    usage_calls = third.body["_meta"]["usage"]
    assert usage_calls["promptTokens"] > 0  # the summary call is counted too


def test_a_plain_turn_asks_the_provider_for_streamed_usage(fake, demo):
    session = demo.create_session("llm-main")
    result = demo.turn(session, text="ping")
    assert result.messages == [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    assert len(fake.chat_requests()) == 1
    assert fake.chat_requests()[0]["json"]["stream_options"] == {"include_usage": True}


def test_fake_server_answers_models_and_non_streaming_requests(fake):
    """The fake itself, as the benchmarks and the ACP tests use it."""
    assert httpx.get(fake.url + "/models").json()["data"][0]["id"] == "fake-model"
    fake.enqueue(FakeOpenAI.text("plain", usage=(3, 1)))
    body = httpx.post(fake.url + "/chat/completions", json={"model": "m", "messages": []}).json()
    assert body["choices"][0]["message"]["content"] == "plain"
    assert body["usage"]["total_tokens"] == 4


def test_fake_server_runs_as_a_process_for_benchmarks():
    argv = [sys.executable, "-m", "tests.fakes.openai_server", "--port", "0", "--tokens", "50", "--delay-ms", "1"]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        request = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/chat/completions", json=request, timeout=30) as response:
            data = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        process.terminate()
        process.wait(10)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(item) for item in data[:-1]]
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) == 50
    assert chunks[-1]["usage"]["completion_tokens"] == 50


def test_the_example_assistant_file_applies(db_access, monkeypatch):
    from agents.models import Agent
    from agents.selectors import agent_info
    from agents.services import agents_apply, load_agents_file

    monkeypatch.setenv("OPENAI_API_KEY", "sk-example-key")
    monkeypatch.setenv("OPENAI_MODEL", "example-model")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    agents_apply(load_agents_file(str(ROOT / "examples" / "agents" / "assistant.yaml")))  # rolled back after the test
    info = agent_info(Agent.objects.get(name="assistant"))
    assert {o["name"]: o["default"] for o in info["options"]} == {
        "model": "example-model",
        "apiKey": "***",
        "baseUrl": "",
    }
    assert [t["name"] for t in info["tools"]] == ["clock", "add", "http_fetch"]
