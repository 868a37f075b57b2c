"""An agent's MCP servers in the registry: refused when they take an undeclared option, and
their tools listed once per revision of the agent (what /meta shows), kept in PostgreSQL.
The servers themselves run in tests/e2e/test_mcp_tools.py; here a remote server on a private
address is refused by the network guard before anything is sent."""

from __future__ import annotations

import uuid

import pytest

REMOTE = {"name": "tickets", "type": "http", "url": "http://127.0.0.1:9/mcp"}


def entry(name: str, servers: list[dict], options: list[dict] | None = None) -> dict:
    return {
        "name": name,
        "runtime": {"kind": "openai", "config": {"model": "gpt-4o-mini", "mcpServers": servers}},
        "options": options or [],
    }


def test_an_mcp_server_taking_an_undeclared_option_is_refused(token):
    from agents.models import Agent
    from agents.services import AgentFileError, agents_apply

    name = f"mcp-{uuid.uuid4().hex[:6]}"
    server = {**REMOTE, "headers": [{"name": "Authorization", "option": "ticketsToken", "prefix": "Bearer "}]}
    with pytest.raises(AgentFileError, match="option 'ticketsToken', which this agent does not declare"):
        agents_apply([entry(name, [server])])
    assert not Agent.objects.filter(name=name).exists()
    agents_apply([entry(name, [server], [{"type": "secret", "name": "ticketsToken"}])])
    assert Agent.objects.filter(name=name).exists()


def test_a_bad_server_is_refused_with_where_and_why(token):
    from agents.services import AgentFileError, agents_apply

    with pytest.raises(AgentFileError, match="mcpServers/0/url"):
        agents_apply([entry(f"mcp-{uuid.uuid4().hex[:6]}", [{**REMOTE, "url": "file:///etc/passwd"}])])


def test_a_private_remote_server_lists_nothing_and_says_why_once_per_revision(api):
    from agents.models import Agent, McpToolList
    from agents.services import agents_apply, mcp_refresh

    name = f"mcp-{uuid.uuid4().hex[:6]}"
    agents_apply([entry(name, [REMOTE])])
    (line,) = mcp_refresh(name)
    assert line.startswith(f"agent {name}: MCP server tickets: The MCP server 'tickets' cannot be reached: Refusing")
    row = McpToolList.objects.get(agent__name=name)
    assert row.tools == [] and "loopback" in row.problems["tickets"]
    assert row.revision == Agent.objects.get(name=name).updated_at
    meta = api.get("/v1/meta").json()
    info = next(agent for agent in meta["agents"] if agent["name"] == name)
    assert "tools" not in info
    # The same revision is read, not listed again; a change to the agent lists again.
    listed = row.listed_at
    api.get("/v1/meta")
    assert McpToolList.objects.get(agent__name=name).listed_at == listed
    agents_apply([{**entry(name, [REMOTE]), "description": "changed"}])
    api.get("/v1/meta")
    changed = McpToolList.objects.get(agent__name=name)
    assert changed.listed_at > listed and changed.revision == Agent.objects.get(name=name).updated_at


def test_an_acp_agents_mcp_servers_are_its_own_not_server_tools(api):
    from agents.models import McpToolList
    from agents.services import agents_apply

    name = f"acp-{uuid.uuid4().hex[:6]}"
    config = {"command": ["/bin/true"], "mcpServers": [{"name": "docs", "command": "/bin/true", "args": [], "env": []}]}
    agents_apply([{"name": name, "runtime": {"kind": "acp", "config": config}}])
    info = next(agent for agent in api.get("/v1/meta").json()["agents"] if agent["name"] == name)
    assert not [tool for tool in info["tools"] if tool["name"].startswith("docs")]
    assert not McpToolList.objects.filter(agent__name=name).exists()


def test_the_example_file_applies(token):
    from agents.models import Agent
    from agents.services import agents_apply, load_agents_file
    from tests.support import ROOT

    agents_apply(load_agents_file(str(ROOT / "examples" / "agents" / "mcp.yaml")))  # rolled back after the test
    agent = Agent.objects.get(name="mcp-assistant")
    assert agent.runtime_config["mcpServers"][0] == {
        "name": "time",
        "command": "mcp-server-time",
        "isolation": "tenant",
        "idleSeconds": 600,
    }


def test_the_web_never_starts_a_stdio_server_a_worker_lists_it(api, settings, monkeypatch):
    """Where workers run the tenants' processes (REDIS_URL set), an agent's stdio server is
    listed by a worker (agents.tasks.list_mcp_tools), never by the web process nor a command."""
    import sys

    from celery import current_app

    from agents import mcp_registry as registry
    from agents.models import Agent, McpToolList
    from agents.runtimes.acp_bridge import process, sandbox
    from agents.services import agents_apply, mcp_refresh
    from agents.tasks import list_mcp_tools
    from infra import process as host_process
    from tests.support import ROOT

    settings.REDIS_URL = settings.REDIS_URL or "redis://127.0.0.1:6379/0"  # nothing is sent there: see below
    sent, spawned = [], []
    monkeypatch.setattr(
        current_app, "send_task", lambda name, args, task_id, queue, **options: sent.append((name, args, queue))
    )
    spawn = process.AgentProcess.spawn

    async def recorded_spawn(self):
        spawned.append((host_process.worker_node, self.spec.label))
        return await spawn(self)

    monkeypatch.setattr(process.AgentProcess, "spawn", recorded_spawn)
    monkeypatch.setattr(sandbox, "harden_host", lambda: None)  # this test process stays as it is
    name = f"mcp-{uuid.uuid4().hex[:6]}"
    # Unsandboxed (the operator's opt-out) so that this process can start it without the sandbox's tools.
    probe = str(ROOT / "tests" / "fakes" / "mcp_probe_server.py")
    server = {"name": "probe", "command": sys.executable, "args": [probe], "unsafeWithoutSandbox": True}
    agents_apply([entry(name, [server])])
    agent = Agent.objects.get(name=name)

    def tools() -> list[str]:
        info = next(a for a in api.get("/v1/meta").json()["agents"] if a["name"] == name)
        return [tool["name"] for tool in info.get("tools", [])]

    # apply_agents and an admin save ask a worker, and say so; /meta would ask too (once per
    # revision and minute from a process: this one has asked already).
    assert mcp_refresh(name) == [f"agent {name}: MCP server probe: The MCP server 'probe' is being listed by a worker."]
    assert tools() == [] and tools() == []
    assert sent == [(registry.LIST_TASK, (agent.pk,), settings.CELERY_TASK_DEFAULT_QUEUE)]
    assert spawned == [] and not McpToolList.objects.filter(agent=agent).exists()
    # The task, in a worker: it starts the server, lists it and stores its tools for /meta.
    monkeypatch.setattr(host_process, "worker_node", "celery@test")
    list_mcp_tools(agent.pk)
    list_mcp_tools(agent.pk)  # delivered twice: listed once
    monkeypatch.setattr(host_process, "worker_node", "")
    assert spawned == [("celery@test", f"{name}/discovery/probe")]
    assert {"probe__sh", "probe__env"} <= set(tools())
    assert len(spawned) == 1 and len(sent) == 1


def test_with_the_broker_unreachable_the_command_says_so_and_the_next_read_asks_again(api, settings, monkeypatch):
    from celery import current_app

    from agents.services import agents_apply, mcp_refresh

    settings.REDIS_URL = settings.REDIS_URL or "redis://127.0.0.1:6379/0"
    tries = []

    def unreachable(name, args, task_id, queue, **options):
        tries.append(args)
        raise ConnectionError("no broker")

    monkeypatch.setattr(current_app, "send_task", unreachable)
    name = f"mcp-{uuid.uuid4().hex[:6]}"
    agents_apply([entry(name, [{"name": "local", "command": "/bin/false"}])])
    (line,) = mcp_refresh(name)
    assert line.endswith(
        "will be listed by a worker: the broker is unreachable now; the next read of the agent asks again."
    )
    info = next(agent for agent in api.get("/v1/meta").json()["agents"] if agent["name"] == name)
    assert "tools" not in info and len(tries) == 2  # the command's try, then /meta's
