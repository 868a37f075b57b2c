"""The model gateway of an ACP agent end to end: Daphne + Celery + PostgreSQL + Redis, the
scripted ACP agent (tests/fakes/acp_agent.py) in its sandbox calling its model through the
gateway, the fake OpenAI server as that model. The model key stays in the worker: the model
gets it, the agent's environment, argv and files never hold it; the model's usage counts for
the turn, the session and the tenant."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI

from .observed import new_tenant
from .test_acp_agent import OPERATOR_SECRET, fake_agent, said, session_of, workspace

GATEWAY = {"keyOption": "apiKey", "env": {"baseUrl": "FAKE_MODEL_URL", "apiKey": "FAKE_API_KEY"}}


def gateway_agent(name: str, model: FakeOpenAI, **config) -> dict:
    # The key option `apiKey` (a secret, the operator's default OPERATOR_SECRET) has no route:
    # the gateway holds it.
    return fake_agent(
        name, gateway={"baseUrl": model.url, **GATEWAY}, options={"model": {"configOption": "model"}}, **config
    )


@pytest.fixture(scope="module")
def model(pg_stack, tmp_path_factory):
    server = FakeOpenAI().start()
    path = tmp_path_factory.mktemp("acp-gateway") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [gateway_agent("acp-gateway", server)]}))
    pg_stack.manage("apply_agents", str(path))
    yield server
    server.stop()


@pytest.fixture
def client(pg_stack, model):
    model.clear()
    client = pg_stack.client("demo")
    yield client
    client.close()


def files_holding(roots: list[Path], secret: bytes) -> list[str]:
    found = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink() and secret in path.read_bytes():
                found.append(str(path))
    return found


@pytest.mark.parametrize("tenant_key", [True, False], ids=["tenant-secret", "operator-default"])
def test_the_model_key_reaches_the_model_and_never_the_agent(pg_stack, client, model, log_dir, tenant_key):
    secret = "sk-tenant-" + os.urandom(8).hex() if tenant_key else OPERATOR_SECRET
    session = session_of(client, "acp-gateway", options={"apiKey": secret} if tenant_key else None)
    model.enqueue(FakeOpenAI.text("pong"))
    assert said(client, session, "/llm ping") == "status=200 text=pong"
    [request] = model.chat_requests()
    assert request["headers"]["authorization"] == f"Bearer {secret}"
    token_hash = said(client, session, "/env FAKE_API_KEY")
    assert token_hash.startswith("FAKE_API_KEY=") and token_hash != "FAKE_API_KEY=unset"
    assert token_hash != f"FAKE_API_KEY={hashlib.sha256(secret.encode()).hexdigest()[:12]}"
    # What the agent can read: the environment of its tools and its own (the kernel's copy) and
    # its argv.
    seen = said(
        client,
        session,
        "/sh env; for f in /proc/self/environ /proc/$PPID/environ /proc/$PPID/cmdline; do tr '\\0' '\\n' < $f; done",
    )
    assert seen.startswith("exit=0") and "FAKE_MODEL_URL=http://127.0.0.1:" in seen and "/gateway/v1" in seen
    assert "acp_agent.py" in seen  # its own argv was read
    assert secret not in seen
    home = workspace(pg_stack, session).parent / ".session-homes" / session
    assert files_holding([workspace(pg_stack, session), home], secret.encode()) == []
    if tenant_key:
        for path in log_dir.iterdir():
            assert secret not in path.read_text(errors="replace"), path.name


def test_a_wrong_token_gets_401_and_never_reaches_the_model(client, model):
    session = session_of(client, "acp-gateway")
    reply = said(client, session, "/llm --key sk-guessed-key hello")
    assert reply.startswith("status=401 ") and "invalid_api_key" in reply
    assert model.chat_requests() == []


def test_the_models_usage_counts_for_the_turn_the_session_and_the_tenant(pg_stack, model):
    client = pg_stack.client(new_tenant(pg_stack))
    try:
        session = session_of(client, "acp-gateway")
        model.enqueue(FakeOpenAI.text("streamed words", usage=(100, 20)), FakeOpenAI.text("whole", usage=(50, 7)))
        streamed = client.turn(session, text="/llm --stream first", stream="delta")
        assert streamed.messages[0]["content"][0]["text"] == "status=200 text=streamed words usage_chunks=0"
        assert streamed.events[-1].data["_meta"]["usage"] == {"promptTokens": 100, "completionTokens": 20}
        assert model.chat_requests()[0]["json"]["stream_options"] == {"include_usage": True}
        whole = client.turn(session, text="/llm second")
        assert whole.body["_meta"]["usage"] == {"promptTokens": 50, "completionTokens": 7}
        quiet = client.turn(session, text="no model call")
        assert "usage" not in quiet.body.get("_meta", {})
        [row] = client.get("/v1/usage", params={"groupBy": "session"}).json()["usage"]
        assert row["sessionId"] == session
        assert (row["promptTokens"], row["completionTokens"], row["modelCalls"]) == (150, 27, 2)
    finally:
        client.close()
