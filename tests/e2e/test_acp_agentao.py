"""Agentao (from PyPI, `agentao --acp`) hosted as an AAP agent, end to end, with its model
provider faked by the scripted OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI

from .test_acp_agent import answer, session_of, workspace
from .turns import MODES, checked_turn, user

AGENTAO = str(Path(sys.executable).parent / "agentao")
API_KEY = "sk-agentao-key-for-tests-0001"


class Tripwire:
    """A local 'proxy' that records every connection and serves none: Agentao's route to
    anything but 127.0.0.1 (HTTP_PROXY / HTTPS_PROXY / ALL_PROXY), so any attempt is seen."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.attempts: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.attempts.append(conn.recv(200))
                except OSError:
                    self.attempts.append(b"")


@pytest.fixture(scope="module")
def tripwire():
    wire = Tripwire()
    yield wire
    wire.sock.close()


@pytest.fixture(scope="module")
def fake(pg_stack, tmp_path_factory, tripwire):
    server = FakeOpenAI().start()
    home = tmp_path_factory.mktemp("agentao-home")
    # Agentao's own permission rules: ask before writing files (its default allows writes).
    (home / ".agentao").mkdir()
    (home / ".agentao" / "permissions.json").write_text(json.dumps({"rules": [{"tool": "write_file", "action": "ask"}]}))
    agent = {
        "name": "agentao",
        "title": "Agentao",
        "runtime": {"kind": "acp", "config": {
            "command": [AGENTAO, "--acp"],
            "env": {"LLM_PROVIDER": "openai", "OPENAI_BASE_URL": server.url, "HOME": str(home),
                    "HTTP_PROXY": tripwire.url, "HTTPS_PROXY": tripwire.url, "ALL_PROXY": tripwire.url,
                    "NO_PROXY": "127.0.0.1,localhost"},
            "options": {"model": {"env": "OPENAI_MODEL"}, "apiKey": {"env": "OPENAI_API_KEY"}},
            "hangTimeoutSeconds": 60,
        }},
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "secret", "name": "apiKey", "default": API_KEY},
        ],
        "capabilities": {"history": {"compacted": {}, "full": {}}, "stream": {"delta": {}, "message": {}, "none": {}}},
    }
    path = tmp_path_factory.mktemp("agentao-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [agent]}))
    pg_stack.manage("apply_agents", str(path))
    server.home = home
    yield server
    server.stop()


@pytest.fixture
def client(pg_stack, fake):
    fake.clear()
    client = pg_stack.client("demo")
    yield client
    client.close()


def test_agentao_answers_a_turn_in_every_mode(fake, client):
    session = session_of(client, "agentao")
    expected = [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "pondering"}, {"type": "text", "text": "Hello from the fake model"},
    ]}]
    for mode in MODES:
        fake.enqueue(FakeOpenAI.text("Hello from the fake model", reasoning="pondering"))
        result = checked_turn(client, session, user(f"say hello ({mode})"), stream=mode)
        assert result.stop_reason == "end_turn"
        assert result.messages == expected, mode
        if mode == "delta":
            assert [e.event for e in result.events].count("text_delta") > 1
    bodies = [r["json"] for r in fake.chat_requests()]
    assert len(bodies) == 3 and all(b["model"] == "fake-model" for b in bodies)
    assert "say hello (message)" in json.dumps(bodies[-1]["messages"])
    assert all(r["headers"].get("authorization") == f"Bearer {API_KEY}" for r in fake.chat_requests())


def test_agentao_asks_permission_to_write_a_file_and_the_grant_writes_it(pg_stack, fake, client):
    fake.enqueue(
        FakeOpenAI.tool_calls([{"name": "write_file",
                                "arguments": json.dumps({"file_path": "notes.txt", "content": "written by agentao"})}]),
        FakeOpenAI.text("I wrote notes.txt."),
    )
    session = session_of(client, "agentao", tools=[{"name": "edit"}])
    first = checked_turn(client, session, user("write a note"), stream="delta")
    assert first.stop_reason == "tool_use"
    [call] = first.tool_calls()
    assert call["name"] == "edit"
    assert call["input"] == {"file_path": "notes.txt", "content": "written by agentao"}
    assert call["_meta"]["title"] == "write_file"
    home = workspace(pg_stack, session)
    assert not (home / "notes.txt").exists()

    second = answer(client, session, call["toolCallId"], True, stream="delta")
    assert second.stop_reason == "end_turn"
    assert [m["role"] for m in second.messages] == ["tool", "assistant"]
    assert second.messages[0]["toolCallId"] == call["toolCallId"]
    assert second.messages[1] == {"role": "assistant", "content": [{"type": "text", "text": "I wrote notes.txt."}]}
    assert (home / "notes.txt").read_text() == "written by agentao"
    last = fake.chat_requests()[-1]["json"]["messages"]
    assert last[-1]["role"] == "tool"  # the model saw the tool's result: the same prompt went on


def test_agentao_keeps_its_state_in_the_workspace_and_its_home_and_never_leaves_127_0_0_1(
    pg_stack, fake, client, tripwire
):
    real_home = Path.home() / ".agentao"
    existed = real_home.exists()
    session = session_of(client, "agentao")
    fake.enqueue(FakeOpenAI.text("ok"))
    assert checked_turn(client, session, user("hello")).stop_reason == "end_turn"
    assert (workspace(pg_stack, session) / ".agentao").is_dir()
    assert (fake.home / ".agentao" / "memory.db").exists()
    assert real_home.exists() is existed
    assert all(r["path"].startswith("/v1/") for r in fake.requests)
    assert tripwire.attempts == []  # no request for anywhere but the fake model server
