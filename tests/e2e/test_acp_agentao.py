"""Agentao (from PyPI, `agentao --acp`) hosted as an AAP agent, end to end, inside the ACP
sandbox, with its model provider faked by the scripted OpenAI-compatible server on 127.0.0.1
(its only allowed egress)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import ROOT

from ..turn_checks import MODES, checked_turn, user
from .test_acp_agent import answer, session_of, workspace

API_KEY = "sk-agentao-key-for-tests-0001"


def agent_config(server: FakeOpenAI, **extra) -> dict:
    endpoint = urlsplit(server.url)
    if os.environ.get("AAP_TEST_SANDBOX_OFF") == "1":  # the operator's opt-out: shows what the sandbox stops
        extra.setdefault("unsafeWithoutSandbox", True)
    return {
        # The bare name, as examples/agents/agentao.yaml has it: found on the sandbox's PATH.
        "command": ["agentao", "--acp"],
        "env": {"LLM_PROVIDER": "openai", "OPENAI_BASE_URL": server.url},
        "egress": [f"{endpoint.hostname}:{endpoint.port}"],
        "options": {"model": {"env": "OPENAI_MODEL"}, "apiKey": {"env": "OPENAI_API_KEY"}},
        "hangTimeoutSeconds": 60,
        **extra,
    }


def agentao(name: str, server: FakeOpenAI, **extra) -> dict:
    return {
        "name": name,
        "title": "Agentao",
        "runtime": {"kind": "acp", "config": agent_config(server, **extra)},
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "secret", "name": "apiKey", "default": API_KEY},
        ],
        "capabilities": {"history": {"compacted": {}, "full": {}}, "stream": {"delta": {}, "message": {}, "none": {}}},
    }


@pytest.fixture(scope="module")
def fake(pg_stack, tmp_path_factory):
    server = FakeOpenAI().start()
    path = tmp_path_factory.mktemp("agentao-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [agentao("agentao", server)]}))
    pg_stack.manage("apply_agents", str(path))
    yield server
    server.stop()


@pytest.fixture
def client(pg_stack, fake):
    fake.clear()
    client = pg_stack.client("demo")
    yield client
    client.close()


def agent_home(stack, session: str, tenant: str = "demo") -> Path:
    """The HOME the service gives a session's own Agentao process."""
    return workspace(stack, session, tenant).parent / ".session-homes" / session / "agentao"


def ask_before_writing(stack, session: str) -> None:
    # Agentao's own permission rules live in its HOME: ask before writing files.
    rules = agent_home(stack, session) / ".agentao"
    rules.mkdir(parents=True)
    (rules / "permissions.json").write_text(json.dumps({"rules": [{"tool": "write_file", "action": "ask"}]}))


def test_agentao_answers_a_turn_in_every_mode(fake, client):
    session = session_of(client, "agentao")
    expected = [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "pondering"},
                {"type": "text", "text": "Hello from the fake model"},
            ],
        }
    ]
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
        FakeOpenAI.tool_calls(
            [
                {
                    "name": "write_file",
                    "arguments": json.dumps({"file_path": "notes.txt", "content": "written by agentao"}),
                }
            ]
        ),
        FakeOpenAI.text("I wrote notes.txt."),
    )
    session = session_of(client, "agentao", tools=[{"name": "edit"}])
    ask_before_writing(pg_stack, session)
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


def test_agentao_keeps_its_state_in_the_workspace_and_the_home_the_service_gives_it(pg_stack, fake, client):
    real_home = Path.home() / ".agentao"
    existed = real_home.exists()
    session = session_of(client, "agentao")
    fake.enqueue(FakeOpenAI.text("ok"))
    assert checked_turn(client, session, user("hello")).stop_reason == "end_turn"
    assert (workspace(pg_stack, session) / ".agentao").is_dir()
    assert (agent_home(pg_stack, session) / ".agentao" / "memory.db").exists()
    assert real_home.exists() is existed
    assert all(r["path"].startswith("/v1/") for r in fake.requests)


def test_the_attack_chain_replayed_with_agentao_gets_nothing(pg_stack, fake, client, other):
    """What a tenant once got by letting Agentao run its tools: other tenants' keys, the key
    files, the worker's environment, PostgreSQL and Redis, writes outside the workspace, a
    dead worker. Every output Agentao's tools produced went to the (fake) model: nothing of it
    may carry any of those."""
    other_key = "sk-other-tenant-" + uuid.uuid4().hex
    fake.enqueue(FakeOpenAI.text("ok"))
    theirs = session_of(other, "agentao", options={"apiKey": other_key})
    assert checked_turn(other, theirs, user("hello")).stop_reason == "end_turn"
    their_pid = min(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _environ_has(p, other_key))

    var = Path(os.environ.get("HOSTING_VAR_DIR", ROOT / "var"))
    var.mkdir(parents=True, exist_ok=True)
    key = var / f"encryption_key-probe-{uuid.uuid4().hex[:8]}"
    key.write_text("fernet-key-material-" + uuid.uuid4().hex)
    key.chmod(0o600)
    escape = Path("/tmp") / f"escape-{uuid.uuid4().hex}"
    redis = urlsplit(pg_stack.env["REDIS_URL"])
    database = urlsplit(pg_stack.env["DATABASE_URL"])
    connect = (
        "import socket\nfor port in (%d, %d, %d):\n    try:\n        socket.create_connection(('127.0.0.1', port), 5)"
        "\n        print('CONN' + 'ECTED', port)\n    except OSError as exc:\n        print('no', port, exc)\n"
        % (database.port or 5432, redis.port, urlsplit(pg_stack.base_url).port)
    )
    script = (
        "W=$(cut -d' ' -f4 /proc/$PPID/stat); echo uid=$(id -u); cat /etc/shadow; "
        f"cat {key}; cat /proc/{their_pid}/environ; cat /proc/$W/environ; env; "
        f"printf '%s' \"{connect}\" > probe.py; python probe.py; "
        f"echo escaped > {escape}; kill -9 $W; echo done"
    )
    workspace_root = workspace(pg_stack, "x").parent.parent
    fake.enqueue(
        FakeOpenAI.tool_calls(
            [
                {"name": "read_file", "arguments": json.dumps({"file_path": "/etc/shadow"})},
                {"name": "read_file", "arguments": json.dumps({"file_path": str(key)})},
                {"name": "list_directory", "arguments": json.dumps({"path": str(workspace_root)})},
                {"name": "run_shell_command", "arguments": json.dumps({"command": script})},
            ]
        ),
        FakeOpenAI.text("I tried."),
    )
    try:
        # The tenant enables and trusts every kind: it is the application answering permissions.
        mine = session_of(
            client,
            "agentao",
            tools=[{"name": kind, "trust": True} for kind in ("read", "search", "execute", "edit", "other")],
        )
        result = checked_turn(client, mine, user("collect everything"))
        assert result.stop_reason == "end_turn", result.body
        seen = json.dumps(fake.chat_requests()[-1]["json"]["messages"]) + json.dumps(client.history(mine))
        assert "uid=" in seen and "done" in seen  # the shell ran, as the agent's own tool
        assert "uid=0" not in seen
        assert other_key not in seen
        assert key.read_text() not in seen
        assert "root:" not in seen
        for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "HOSTING_ENCRYPTION_KEYS"):
            assert name not in seen
        assert "CONNECTED" not in seen
        assert theirs not in seen  # the workspace root's listing was refused
        assert not escape.exists()
        assert pg_stack.worker.poll() is None  # the worker lives
        fake.enqueue(FakeOpenAI.text("still here"))
        assert checked_turn(client, mine, user("hello again")).stop_reason == "end_turn"
    finally:
        key.unlink()
        escape.unlink(missing_ok=True)


def test_agentao_resumes_its_conversation_after_a_worker_shutdown(pg_stack, fake, client):
    """A deploy SIGTERMs the worker: its Agentao gets its stdin closed and time to save the
    session, and the next worker's session/load gives the model the earlier conversation."""
    session = session_of(client, "agentao")
    fake.enqueue(FakeOpenAI.text("Noted: the password is periwinkle."))
    assert checked_turn(client, session, user("Remember: the password is periwinkle.")).stop_reason == "end_turn"
    try:
        took = pg_stack.terminate_worker()
    finally:
        if pg_stack.worker.poll() is not None:
            pg_stack.start_worker()
    assert took < 45  # within the compose worker's stop_grace_period (60 s)
    assert list((workspace(pg_stack, session) / ".agentao" / "sessions").glob("*.json")), "Agentao saved nothing"

    fake.enqueue(FakeOpenAI.text("The password is periwinkle."))
    assert checked_turn(client, session, user("What is the password?")).stop_reason == "end_turn"
    seen = json.dumps(fake.chat_requests()[-1]["json"]["messages"])
    assert "Remember: the password is periwinkle." in seen
    assert "Noted: the password is periwinkle." in seen
    assert "What is the password?" in seen


def _environ_has(proc: Path, value: str) -> bool:
    try:
        return value.encode() in (proc / "environ").read_bytes()
    except OSError:
        return False


@pytest.fixture
def other(pg_stack, fake):
    client = pg_stack.client("other")
    yield client
    client.close()


def test_the_agentao_example_works_as_shipped_with_its_bare_command(pg_stack, fake, client, tmp_path):
    """examples/agents/agentao.yaml as an operator applies it, pointed at the fake provider:
    `agentao` is found on the sandbox's PATH (the service's environment), in its sandbox."""
    [example] = yaml.safe_load((ROOT / "examples" / "agents" / "agentao.yaml").read_text())["agents"]
    assert example["runtime"]["config"]["command"] == ["agentao", "--acp"]
    example["name"] = "agentao-example"
    config = example["runtime"]["config"]
    assert "apiKey" not in config["options"]  # the key stays in the worker: its gateway holds it
    config["gateway"]["baseUrl"] = fake.url
    example["options"] = [
        {**option, "default": {"model": "fake-model", "apiKey": API_KEY}[option["name"]]}
        for option in example["options"]
    ]
    for option in example["options"]:
        option.pop("defaultEnv")
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [example]}))
    pg_stack.manage("apply_agents", str(path))
    fake.enqueue(FakeOpenAI.text("Hello from the example"))
    session = session_of(client, "agentao-example")
    result = checked_turn(client, session, user("hello"))
    assert result.stop_reason == "end_turn", result.body
    assert result.messages == [{"role": "assistant", "content": [{"type": "text", "text": "Hello from the example"}]}]
    assert {r["headers"]["authorization"] for r in fake.chat_requests()} == {f"Bearer {API_KEY}"}
    assert result.body["_meta"]["usage"]["promptTokens"] > 0  # the gateway counted the model's usage
