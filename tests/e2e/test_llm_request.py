"""The model request the `openai` runtime sends, as the model provider receives it: plain JSON
with the operator's extra body fields at its top level, and the whole history in order."""

from __future__ import annotations

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI

from ..turn_checks import text_reply
from .test_llm_agent import llm_agent


@pytest.fixture(scope="module")
def model(pg_stack, tmp_path_factory):
    server = FakeOpenAI(strict=True).start()
    agent = llm_agent(
        "llm-request",
        server.url,
        config={
            "temperature": 0.5,
            "maxOutputTokens": 64,
            "maxTokensField": "max_completion_tokens",  # configured: not the default for this server
            "extraBody": {"top_k": 7, "chat_template_kwargs": {"x": [1, 2]}},
        },
    )
    path = tmp_path_factory.mktemp("llm-request") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [agent]}))
    pg_stack.manage("apply_agents", str(path))
    yield server
    server.stop()


def test_request_is_plain_json_with_extra_body_fields_at_the_top(model, demo):
    session = demo.create_session("llm-request")
    for i in range(3):
        model.enqueue(FakeOpenAI.text(f"answer {i}"))
        assert demo.turn(session, text=f"question {i}").messages == text_reply(f"answer {i}")
    requests = [r["json"] for r in model.chat_requests()]
    assert len(requests) == 3
    last = requests[-1]
    assert last["model"] == "fake-model" and last["stream"] is True
    assert last["temperature"] == 0.5 and last["max_completion_tokens"] == 64
    assert last["top_k"] == 7 and last["chat_template_kwargs"] == {"x": [1, 2]}
    assert "extra_body" not in last
    said = [
        (m["role"], m["content"] if isinstance(m["content"], str) else m["content"][0]["text"])
        for m in last["messages"]
    ]
    assert said == [
        ("system", "You are a test agent."),
        ("user", "question 0"),
        ("assistant", "answer 0"),
        ("user", "question 1"),
        ("assistant", "answer 1"),
        ("user", "question 2"),
    ]
