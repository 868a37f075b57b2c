"""OpenCode (npm `opencode-ai`, `opencode acp`) hosted as an AAP agent, end to end: Daphne +
Celery + PostgreSQL + Redis, OpenCode in its sandbox (its own HTTP server on its own
loopback), its model the scripted OpenAI-compatible server behind the model gateway.

The agent is registered as docs/acp-agents.md ("npm-distributed agents") says, with only what
is the site's replaced: where OpenCode is installed, the model's endpoint and the key. The
model key stays in the worker: the model gets it, OpenCode's environment and files never hold
it, and OpenCode reaches nothing but the gateway (no catalogue, plugin or update download).

`make test` installs OpenCode from the npm registry into .venv/node (the Makefile's
OPENCODE_VERSION); an `opencode` on PATH is used otherwise, and the test skips without one.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import AAP, BIN, ROOT, Stack, log_message

from ..e2e.test_acp_agent import session_of, workspace
from ..turn_checks import checked_turn, user

pytestmark = [pytest.mark.real, pytest.mark.timeout(240)]

LOCAL_PREFIX = BIN.parent / "node"  # `make test`: npm install --global --prefix .venv/node opencode-ai
API_KEY = "sk-opencode-key-for-tests-0001"
ANSWER = "Hello from the fake model, through the gateway."
PROMPT = "Say hello in one sentence."


def installed_opencode() -> Path | None:
    found = shutil.which("opencode", path=str(LOCAL_PREFIX / "bin")) or shutil.which("opencode")
    return Path(found) if found else None


def installation(binary: Path) -> Path:
    """The npm package's directory (its `bin/opencode.exe` is the platform binary)."""
    return Path(os.path.realpath(binary)).parent.parent


def documented_agent() -> dict:
    """The `opencode` agent of the "npm-distributed agents" section of docs/acp-agents.md."""
    text = (ROOT / "docs" / "acp-agents.md").read_text()
    section = text[text.index("\n## npm-distributed agents") :]
    section = section[: section.index("\n## ", 4)]
    for block in re.findall(r"```yaml\n(.*?)```", section, re.S):
        for agent in yaml.safe_load(block).get("agents", []):
            if agent["name"] == "opencode":
                return agent
    raise AssertionError("docs/acp-agents.md: the npm-distributed agents section registers no `opencode`")


def site_agent(binary: Path, model: FakeOpenAI) -> dict:
    """The documented agent with this site's installation, model endpoint and key."""
    agent = copy.deepcopy(documented_agent())
    config = agent["runtime"]["config"]
    config["command"] = [str(binary) if word == "opencode" else word for word in config["command"]]
    config["readPaths"] = [str(installation(binary))]
    config["gateway"]["baseUrl"] = model.url
    config["hangTimeoutSeconds"] = 60  # a test bound; startTimeoutSeconds keeps its default (60)
    [key] = agent["options"]
    assert key["name"] == config["gateway"]["keyOption"]
    agent["options"] = [{"type": "secret", "name": key["name"], "default": API_KEY}]
    return agent


def documented_model() -> str:
    env = documented_agent()["runtime"]["config"]["env"]
    return json.loads(env["OPENCODE_CONFIG_CONTENT"])["model"].split("/", 1)[1]


@pytest.fixture(scope="module")
def binary() -> Path:
    found = installed_opencode()
    if found is None:
        pytest.skip(
            "OpenCode is not installed: `make test` installs the npm package opencode-ai into .venv/node "
            "when npm is present (or put `opencode` on PATH)"
        )
    return found


@pytest.fixture(scope="module")
def model(binary, pg_stack):  # `binary` first: without OpenCode, no stack is started
    # Every chat completion gets the answer: OpenCode also asks its model for a session title.
    server = FakeOpenAI(default_reply=FakeOpenAI.text(ANSWER)).start()
    try:
        pg_stack.apply_agents([site_agent(binary, server)])
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(pg_stack: Stack, model):
    model.clear()
    client = pg_stack.client("demo", timeout=150)
    yield client
    client.close()


def agent_environments(home: Path) -> list[dict[str, str]]:
    """The environments of the agent processes whose HOME is `home` (read from the host)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if env.get("HOME") == str(home) and "AAP_MODEL_TOKEN" in env:
            found.append(env)
    return found


def files_holding(roots: list[Path], secret: bytes) -> list[str]:
    return [
        str(path)
        for root in roots
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink() and secret in path.read_bytes()
    ]


def refused_destinations(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [m for m in map(log_message, lines) if m.startswith("sandbox: agent opencode/") and "tried to reach" in m]


def test_opencode_answers_a_turn_through_the_model_gateway(pg_stack: Stack, client: AAP, model, log_dir):
    session = session_of(client, "opencode")
    result = checked_turn(client, session, user(PROMPT), stream="delta")
    assert result.stop_reason == "end_turn", result.events[-1].data
    said = [b["text"] for m in result.messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "text"]
    assert "".join(said) == ANSWER
    assert "text_delta" in result.names
    history = client.history(session)
    assert history[0] == {"role": "user", "content": PROMPT}
    assert history[1:] == result.messages

    # The model got the prompt with the real key; OpenCode held only its gateway token.
    requests = model.chat_requests()
    assert requests, "the model got no request"
    assert all(r["headers"].get("authorization") == f"Bearer {API_KEY}" for r in requests)
    assert all(r["json"]["model"] == documented_model() for r in requests)
    assert any(PROMPT in json.dumps(r["json"]["messages"]) for r in requests)
    home = workspace(pg_stack, session).parent / ".session-homes" / session / "opencode"
    environments = agent_environments(home)
    assert environments, f"no OpenCode process with HOME={home}"
    for env in environments:
        assert env["AAP_MODEL_URL"].startswith("http://127.0.0.1:") and env["AAP_MODEL_URL"].endswith("/gateway/v1")
        assert env["AAP_MODEL_TOKEN"] not in ("", API_KEY)
        assert API_KEY not in "\0".join(f"{k}={v}" for k, v in env.items())
    assert files_holding([workspace(pg_stack, session), home], API_KEY.encode()) == []
    # Nothing tried to leave the sandbox: no catalogue, plugin or update download.
    assert refused_destinations(log_dir / "pg-celery.log") == []
