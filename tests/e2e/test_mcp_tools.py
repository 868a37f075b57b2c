"""MCP servers as server tools of an `openai` agent, through the whole stack: PyPI's
`mcp-server-time` and a probe server built with the `mcp` SDK (tests/fakes/mcp_probe_server.py)
over stdio in the sandbox, the same probe over streamable HTTP, the model the fake
OpenAI-compatible server.

The escape suite's file and network probes run from the probe (`probe`, sandboxed) and from
the same probe with the operator's `unsafeWithoutSandbox` (`bare`): refused from the first,
they succeed from the second, so they can tell an escape. `AAP_TEST_SANDBOX_OFF=1` registers
`probe` unsandboxed too, to show the sandboxed assertions fail then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.support import ROOT, free_port

from ..turn_checks import LiveTurn, wait_until
from .escape import SANDBOX_OFF, as_script, connect_probe, digest, read_probe, service_targets
from .test_acp_agent import host_pid

PROBE = str(ROOT / "tests" / "fakes" / "mcp_probe_server.py")
OPERATOR_TOKEN = "operator-token-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def http_probe():
    """The probe over streamable HTTP on 127.0.0.1 (a private address: allowed only when listed)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, PROBE, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    import socket

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, timeout=30, message="the HTTP MCP server listens")
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def mcp_stack(pg_stack, model, http_probe):
    endpoint = urlsplit(model.url)
    agent = {
        "name": "llm-mcp",
        "runtime": {
            "kind": "openai",
            "config": {
                "timeoutSeconds": 30,
                "mcpServers": [
                    {"name": "time", "command": "mcp-server-time"},
                    {
                        "name": "probe",
                        "command": "python",
                        "args": [PROBE],
                        "readPaths": [str(ROOT / "tests" / "fakes")],
                        "env": [{"name": "PROBE_TOKEN", "option": "probeToken"}, {"name": "PROBE_MODE", "value": "on"}],
                        "egress": [f"{endpoint.hostname}:{endpoint.port}"],
                        "timeoutSeconds": 8,
                        **({"unsafeWithoutSandbox": True} if SANDBOX_OFF else {}),
                    },
                    # The same probe with the operator's opt-out: the escapes' negative control.
                    {"name": "bare", "command": "python", "args": [PROBE], "unsafeWithoutSandbox": True},
                    {
                        "name": "brief",
                        "command": "python",
                        "args": [PROBE],
                        "readPaths": [str(ROOT / "tests" / "fakes")],
                        "isolation": "tenant",
                        "idleSeconds": 8,
                    },
                    {
                        "name": "web",
                        "type": "http",
                        "url": http_probe,
                        "allowPrivateAddresses": True,
                        "headers": [{"name": "X-Probe-Token", "option": "probeToken", "prefix": "token "}],
                    },
                    {"name": "private", "type": "http", "url": http_probe},
                ],
            },
        },
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "text", "name": "baseUrl", "default": model.url},
            {"type": "secret", "name": "probeToken", "default": OPERATOR_TOKEN},
        ],
        "capabilities": {"stream": {"delta": {}, "none": {}}},
    }
    pg_stack.apply_agents([agent])
    listed(pg_stack, "llm-mcp", {"time__get_current_time", "probe__sh", "bare__sh", "brief__sh", "web__sh"})
    yield pg_stack
    pg_stack.apply_agents([{**agent, "enabled": False}])  # out of /meta for the rest of the suite


def tools_of(client, name: str = "llm-mcp") -> dict[str, dict]:
    agent = next(a for a in client.meta()["agents"] if a["name"] == name)
    return {tool["name"]: tool for tool in agent.get("tools", [])}


def listed(stack, name: str, tools: set[str]) -> None:
    """Wait until a worker has listed the agent's MCP servers (`apply_agents` asks one)."""
    client = stack.client("demo")
    try:
        wait_until(lambda: tools <= set(tools_of(client, name)), timeout=90, message=f"{name}'s MCP tools in /meta")
    finally:
        client.close()


def session(client, *tools: str, trust: bool = True, **options) -> str:
    body: dict = {"agent": {"name": "llm-mcp", "tools": [{"name": t, "trust": trust} for t in tools]}}
    if options:
        body["agent"]["options"] = options
    response = client.post("/v1/sessions", body)
    assert response.status_code == 201, response.text
    return response.json()["sessionId"]


def call(model, client, session_id: str, tool: str, arguments: dict, reply: str = "done"):
    """One turn in which the model calls `tool`; returns the turn's result."""
    model.enqueue(FakeOpenAI.tool_calls([{"name": tool, "arguments": json.dumps(arguments)}]), FakeOpenAI.text(reply))
    return client.turn(session_id, text="go", stream="delta")


def results(result) -> list:
    return [e.data["content"] for e in result.events if e.event == "tool_result"]


def model_saw(model) -> list[str]:
    """The tool results the model received in its last request."""
    return [m["content"] for m in model.chat_requests()[-1]["json"]["messages"] if m["role"] == "tool"]


def test_meta_lists_the_tools_of_every_reachable_mcp_server(mcp_stack, demo):
    tools = tools_of(demo)
    assert {"time__get_current_time", "time__convert_time", "probe__sh", "probe__env", "web__sh"} <= set(tools)
    current = tools["time__get_current_time"]
    assert "timezone" in current["parameters"]["properties"] and current["description"]
    assert tools["probe__sh"]["parameters"]["required"] == ["command"]
    # A remote server on a private address the operator did not allow lists nothing.
    assert not [name for name in tools if name.startswith("private__")]


def test_an_untrusted_mcp_tool_asks_permission_and_the_model_gets_the_real_result(mcp_stack, demo, model):
    sid = session(demo, "time__get_current_time", trust=False)
    model.clear()
    first = call(model, demo, sid, "time__get_current_time", {"timezone": "Europe/Paris"})
    assert first.stop_reason == "tool_use" and not results(first)
    call_id = first.tool_calls()[0]["toolCallId"]
    second = demo.turn(
        sid, messages=[{"role": "tool_permission", "toolCallId": call_id, "granted": True}], stream="delta"
    )
    assert second.stop_reason == "end_turn", second.body
    (content,) = results(second)
    answer = json.loads(content if isinstance(content, str) else content[0]["text"])
    assert answer["timezone"] == "Europe/Paris" and answer["datetime"].startswith("20")
    assert model_saw(model) == [content if isinstance(content, str) else content[0]["text"]]


def test_a_trusted_mcp_tool_runs_inline(mcp_stack, demo, model):
    sid = session(demo, "time__convert_time")
    model.clear()
    result = call(
        model,
        demo,
        sid,
        "time__convert_time",
        {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
    )
    assert result.stop_reason == "end_turn"
    (content,) = results(result)
    assert json.loads(content)["target"]["timezone"] == "Asia/Tokyo"
    assert model_saw(model) == [content]


def test_a_tenants_secret_option_reaches_only_its_own_mcp_server(mcp_stack, demo, other, model):
    secret = "sk-demo-" + uuid.uuid4().hex
    mine = session(demo, "probe__env", probeToken=secret)
    theirs = session(other, "probe__env")
    assert results(call(model, demo, mine, "probe__env", {"name": "PROBE_TOKEN"})) == [secret]
    assert results(call(model, other, theirs, "probe__env", {"name": "PROBE_TOKEN"})) == [OPERATOR_TOKEN]
    # Another session of the same tenant without the option: the default, never the other value.
    plain = session(demo, "probe__env")
    assert results(call(model, demo, plain, "probe__env", {"name": "PROBE_TOKEN"})) == [OPERATOR_TOKEN]
    assert secret not in json.dumps(demo.get(f"/v1/sessions/{mine}").json())


def test_a_tenants_secret_option_is_a_header_of_its_own_remote_mcp_session_only(mcp_stack, demo, other, model):
    secret = "sk-demo-" + uuid.uuid4().hex
    mine = session(demo, "web__header", probeToken=secret)
    theirs = session(other, "web__header")
    assert results(call(model, demo, mine, "web__header", {"name": "x-probe-token"})) == [f"token {secret}"]
    assert results(call(model, other, theirs, "web__header", {"name": "x-probe-token"})) == [f"token {OPERATOR_TOKEN}"]
    assert results(call(model, demo, mine, "web__header", {"name": "x-probe-token"})) == [f"token {secret}"]


def test_remote_mcp_server_allowed_by_the_operator_answers_text_and_images(mcp_stack, demo, model):
    sid = session(demo, "web__picture", "web__fail")
    result = call(model, demo, sid, "web__picture", {})
    (content,) = results(result)
    assert content[0] == {"type": "text", "text": "a red dot"}
    assert content[1]["type"] == "image" and content[1]["url"].startswith("data:image/png;base64,iVBOR")
    failed = results(call(model, demo, sid, "web__fail", {}))
    assert failed[0].startswith("Error: ")


def test_a_crash_or_a_hang_mid_call_is_an_error_result_and_the_turn_goes_on(mcp_stack, demo, model):
    sid = session(demo, "probe__crash", "probe__sleep", "probe__env")
    result = call(model, demo, sid, "probe__crash", {}, reply="recovered")
    assert result.stop_reason == "end_turn"
    (content,) = results(result)
    assert content.startswith("Error: The MCP server") and "exit" in content, content
    assert result.messages[-1]["content"][0]["text"] == "recovered"
    result = call(model, demo, sid, "probe__sleep", {"seconds": 60})
    assert results(result) == ["Error: The MCP server 'probe' did not answer within 8 seconds."]
    # The next call starts a fresh server.
    assert results(call(model, demo, sid, "probe__env", {"name": "PROBE_MODE"})) == ["on"]


def test_a_server_whose_tool_list_changes_is_listed_again(mcp_stack, demo, model):
    sid = session(demo, "probe__grow")
    added = "fresh_" + uuid.uuid4().hex[:6]
    assert results(call(model, demo, sid, "probe__grow", {"name": added})) == [f"added {added}"]
    wait_until(lambda: f"probe__{added}" in tools_of(demo), timeout=30, message="the new tool in /meta")
    # The earlier tools keep their names; the new one is a server tool like the others.
    assert {"probe__sh", "time__get_current_time"} <= set(tools_of(demo))
    fresh = session(demo, f"probe__{added}", "probe__grow")
    call(model, demo, fresh, "probe__grow", {"name": added})  # this session's own server has it too
    assert results(call(model, demo, fresh, f"probe__{added}", {})) == ["grown"]


def test_a_server_that_will_not_start_is_an_error_result_told_in_the_log(mcp_stack, demo, model):
    sid = session(demo, "probe__env", probeToken="exit-at-start")
    result = call(model, demo, sid, "probe__env", {"name": "PROBE_MODE"}, reply="carried on")
    assert result.stop_reason == "end_turn"
    (content,) = results(result)
    assert content.startswith("Error: The MCP server 'probe' ") and "exit code 4" in content, content
    assert result.messages[-1]["content"][0]["text"] == "carried on"
    log = mcp_stack.log_dir / f"{mcp_stack.name}-celery.log"
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    told = [line for line in lines if line.get("message", "").startswith("MCP tool env of server probe failed")]
    assert told and told[-1]["session"] == sid and "Traceback" in told[-1].get("exc_info", ""), told[-1:]
    assert "exit-at-start" not in log.read_text()  # the option's value is never logged


def test_cancelling_the_turn_cancels_the_mcp_call(mcp_stack, demo, model):
    sid = session(demo, "probe__sleep")
    model.enqueue(FakeOpenAI.tool_calls([{"name": "probe__sleep", "arguments": '{"seconds": 6}'}]))
    live = LiveTurn.turn(mcp_stack, sid, "sleep", stream="delta")
    live.wait_events(2)  # turn_start, the tool call
    home = Path(mcp_stack.env["AAP_WORKSPACE_ROOT"], "demo", ".session-homes", sid, "llm-mcp.mcp.probe")
    wait_until((home / "sleep-started").exists, timeout=30, message="the MCP server runs the call")
    assert demo.post(f"/v1/sessions/{sid}/turns/{live.turn_id}/cancel").status_code == 202
    stop = live.wait_end().result().events[-1].data
    assert stop["stopReason"] == "end_turn" and stop["_meta"]["cancelled"] is True
    # The server heard notifications/cancelled: its handler was cancelled, long before 6 seconds.
    wait_until(lambda: (home / "sleep-cancelled").exists(), timeout=4, message="the MCP call was cancelled")


def test_deleting_a_session_stops_its_own_mcp_server_and_removes_its_home(mcp_stack, demo, model):
    sid = session(demo, "probe__sh")
    # The shell's parent is the server: its pid in its PID namespace (the host's in the fallback).
    code, output = sh(model, demo, sid, 'echo "pid=$PPID ns=$(readlink /proc/$PPID/ns/pid)"; pwd')
    assert code == 0, output
    said, home = output.splitlines()
    process = Path(f"/proc/{host_pid(said)}")
    assert b"mcp_probe_server" in (process / "cmdline").read_bytes()
    assert Path(home).is_dir()
    assert demo.delete(f"/v1/sessions/{sid}").status_code == 204
    wait_until(lambda: not Path(home).exists(), timeout=30, message="the server's home was removed")
    wait_until(lambda: not process.exists(), timeout=30, message="the server was stopped")


def server_pid(model, client, sid: str, tool: str) -> int:
    """The host's pid of the server behind `tool` (a probe's `sh`)."""
    command = 'echo "pid=$PPID ns=$(readlink /proc/$PPID/ns/pid)"'
    (content,) = results(call(model, client, sid, tool, {"command": command}))
    assert content.startswith("exit=0\n"), content  # otherwise: why the server could not serve
    return host_pid(content.partition("\n")[2])


def test_a_server_is_reused_across_turns_of_its_unit_and_stopped_when_idle(mcp_stack, demo, model):
    first, second = session(demo, "brief__sh"), session(demo, "brief__sh")
    pid = server_pid(model, demo, first, "brief__sh")
    # isolation: tenant — the tenant's sessions with the same option values share one process.
    assert server_pid(model, demo, second, "brief__sh") == pid
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=30, message="the idle server was stopped")
    again = server_pid(model, demo, first, "brief__sh")
    assert again != pid and Path(f"/proc/{again}").exists()


# --- the sandbox, from an MCP server ---------------------------------------------------------


def sh(model, client, sid: str, command: str, server: str = "probe") -> tuple[int, str]:
    (content,) = results(call(model, client, sid, f"{server}__sh", {"command": command}))
    head, _, output = content.partition("\n")
    return int(head.removeprefix("exit=")), output


def test_a_stdio_mcp_server_works_in_its_home_and_reaches_its_egress(mcp_stack, demo, model):
    sid = session(demo, "probe__sh")
    assert sh(model, demo, sid, 'echo hello > notes.txt && cat notes.txt && python -c "print(6 * 7)"') == (
        0,
        "hello\n42\n",
    )
    fetch = 'python -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=10).status)" '
    assert sh(model, demo, sid, fetch + model.url + "/models") == (0, "200\n")
    code, output = sh(model, demo, sid, fetch + mcp_stack.base_url + "/healthz")
    assert code != 0 and "200" not in output


# The attacker: the sandboxed probe, or the same probe with the operator's unsafeWithoutSandbox.
ATTACKERS = [pytest.param("probe", id="sandboxed"), pytest.param("bare", id="unsandboxed")]


def confined(server: str) -> bool:
    """What the test expects of the attacker (`probe` stays expected confined with
    AAP_TEST_SANDBOX_OFF=1, which runs it unsandboxed: its assertions fail then)."""
    return server == "probe"


@pytest.mark.parametrize("server", ATTACKERS)
def test_a_stdio_mcp_server_cannot_read_outside_its_sandbox(mcp_stack, demo, other, model, key_file, server):
    theirs = session(other, "probe__sh")
    assert sh(model, other, theirs, "echo their-notes > private.txt && pwd")[0] == 0
    their_home = sh(model, other, theirs, "pwd")[1].strip()
    assert Path(their_home, "private.txt").read_text() == "their-notes\n"  # there to steal
    targets = {
        "theirs": f"{their_home}/private.txt",  # another tenant's server's files
        "key": str(key_file),  # the service's keys
        "shadow": "/etc/shadow",
        "worker": f"/proc/{mcp_stack.worker.pid}/environ",  # DATABASE_URL, REDIS_URL, ...
    }
    mine = session(demo, f"{server}__sh")
    code, output = sh(
        model, demo, mine, "echo mine-ok > own.txt; cat own.txt; " + as_script(read_probe(targets)) + "; env", server
    )
    assert output.startswith("mine-ok\n"), output  # the positive control: its own files, in the same command
    lines = output.splitlines()
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "HOSTING_ENCRYPTION_KEYS"):
        assert not [line for line in lines if line.startswith(name + "=")]  # a clean environment, always
    if confined(server):
        assert [line.split()[:2] for line in lines if line.startswith(("read ", "refused "))] == [
            ["refused", label] for label in targets
        ], output
    else:  # the same probes, unconfined: each reads what the sandbox keeps out of reach
        assert f"read theirs {digest('their-notes' + chr(10))}" in lines, output
        assert f"read key {digest(key_file.read_text())}" in lines, output
        root = os.geteuid() == 0  # then only the sandbox stands between the server and these
        assert any(line.startswith("read shadow ") for line in lines) == root, output
        assert any(line.startswith("read worker ") for line in lines) == root, output


@pytest.mark.parametrize("server", ATTACKERS)
def test_a_stdio_mcp_server_cannot_reach_postgresql_redis_or_the_service(mcp_stack, demo, model, server):
    probe = connect_probe(service_targets(mcp_stack), egress=model.url + "/models")
    sid = session(demo, f"{server}__sh")
    code, output = sh(model, demo, sid, as_script(probe), server)
    assert code == 0, output
    assert output.startswith("egress 200\n"), output  # the positive control: its egress (through its proxy)
    if confined(server):
        assert "connected" not in output and output.count("refused") == 3, output
    else:  # the same probe, unconfined, connects to each
        assert "refused" not in output and output.count("connected") == 3, output


# --- an MCP server from the npm registry -----------------------------------------------------

NODE_PREFIX = ROOT / ".venv" / "node"  # `make install-test`: npm install --global --prefix .venv/node
FILESYSTEM = NODE_PREFIX / "bin" / "mcp-server-filesystem"
FILESYSTEM_PACKAGE = NODE_PREFIX / "lib" / "node_modules" / "@modelcontextprotocol" / "server-filesystem"


@pytest.fixture(scope="module")
def files_stack(pg_stack, model):
    if not FILESYSTEM.exists():
        pytest.skip(
            "@modelcontextprotocol/server-filesystem is not installed: `make install-test` installs it from "
            "the npm registry into .venv/node when npm is present"
        )
    agent = {
        "name": "llm-files",
        "runtime": {
            "kind": "openai",
            "config": {
                "mcpServers": [
                    {"name": "files", "command": str(FILESYSTEM), "args": ["."], "readPaths": [str(FILESYSTEM_PACKAGE)]}
                ]
            },
        },
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "text", "name": "baseUrl", "default": model.url},
        ],
        "capabilities": {"stream": {"delta": {}, "none": {}}},
    }
    pg_stack.apply_agents([agent])
    listed(pg_stack, "llm-files", {"files__write_file"})
    yield pg_stack
    pg_stack.apply_agents([{**agent, "enabled": False}])


def test_npm_filesystem_server_writes_and_reads_its_own_directory_only(files_stack, demo, model):
    agent = next(a for a in demo.meta()["agents"] if a["name"] == "llm-files")
    names = {tool["name"] for tool in agent["tools"]}
    assert {"files__write_file", "files__read_text_file", "files__list_allowed_directories"} <= names
    tools = [{"name": name, "trust": True} for name in ("files__write_file", "files__read_text_file")]
    response = demo.post("/v1/sessions", {"agent": {"name": "llm-files", "tools": tools}})
    sid = response.json()["sessionId"]
    wrote = results(call(model, demo, sid, "files__write_file", {"path": "notes.txt", "content": "kept"}))
    assert wrote[0].startswith("Successfully wrote to ")
    assert results(call(model, demo, sid, "files__read_text_file", {"path": "notes.txt"})) == ["kept"]
    assert model_saw(model)[-1] == "kept"
    # Outside its directory: refused by the server, and by the sandbox had it tried.
    (outside,) = results(call(model, demo, sid, "files__read_text_file", {"path": "/etc/hostname"}))
    assert outside.startswith("Error: ") and "denied" in outside.lower(), outside


# --- discovery: in a worker, never in the web process -----------------------------------------


def test_the_web_never_starts_a_stdio_mcp_server_a_worker_lists_them(pg_stack, model, demo):
    name = f"llm-listed-{uuid.uuid4().hex[:6]}"
    agent = {
        "name": name,
        "runtime": {"kind": "openai", "config": {"mcpServers": [{"name": "time", "command": "mcp-server-time"}]}},
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "text", "name": "baseUrl", "default": model.url},
        ],
    }
    web_log = pg_stack.log_dir / f"{pg_stack.name}-daphne.log"
    worker_log = pg_stack.log_dir / f"{pg_stack.name}-celery.log"
    started = f"MCP server {name}/discovery/time started"
    pg_stack.apply_agents([agent])  # asks a worker to list the servers
    try:
        listed(pg_stack, name, {"time__get_current_time"})
        assert worker_log.read_text().count(started) == 1  # the positive control: the worker started it
        # A revision nobody listed (a raw UPDATE): /meta, served by the web, asks a worker.
        bump = "from django.utils import timezone; from agents.models import Agent; "
        pg_stack.manage("shell", "-c", bump + f"Agent.objects.filter(name={name!r}).update(updated_at=timezone.now())")
        assert "time__get_current_time" in tools_of(demo, name)  # the earlier list meanwhile
        wait_until(lambda: worker_log.read_text().count(started) == 2, timeout=60, message="listed again")
        assert "time__get_current_time" in tools_of(demo, name)
        assert f"asked a worker to list the MCP servers of agent {name}" in web_log.read_text()
        assert f"{name}/discovery" not in web_log.read_text()  # nothing started (nor failed to) in the web
    finally:
        pg_stack.apply_agents([{**agent, "enabled": False}])


# --- the embedded mode (`make run` without DATABASE_URL: SQLite, turns in the web process) -----


def test_the_embedded_mode_lists_and_calls_mcp_server_time(embedded_stack, model):
    agent = {
        "name": "llm-time",
        "runtime": {"kind": "openai", "config": {"mcpServers": [{"name": "time", "command": "mcp-server-time"}]}},
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "text", "name": "baseUrl", "default": model.url},
        ],
        "capabilities": {"stream": {"delta": {}, "none": {}}},
    }
    embedded_stack.apply_agents([agent])
    client = embedded_stack.client("demo")
    try:
        info = next(a for a in client.meta()["agents"] if a["name"] == "llm-time")
        assert {"time__get_current_time", "time__convert_time"} <= {tool["name"] for tool in info["tools"]}
        response = client.post(
            "/v1/sessions",
            {"agent": {"name": "llm-time", "tools": [{"name": "time__get_current_time", "trust": True}]}},
        )
        sid = response.json()["sessionId"]
        (content,) = results(call(model, client, sid, "time__get_current_time", {"timezone": "UTC"}))
        assert json.loads(content)["timezone"] == "UTC"
        assert client.delete(f"/v1/sessions/{sid}").status_code == 204
    finally:
        embedded_stack.apply_agents([{**agent, "enabled": False}])
        client.close()
