"""The `acp` runtime end to end with a scripted ACP agent (tests/fakes/acp_agent.py) as a real
child process of the worker: Daphne + Celery + PostgreSQL + Redis (and one basic turn in the
embedded mode)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT, Stack

from ..turn_checks import (
    MODES,
    LiveTurn,
    assert_deltas,
    checked_turn,
    deltas,
    numbered_calls,
    text_reply,
    user,
    wait_until,
)

TOOL_KINDS = ["read", "edit", "delete", "move", "search", "execute", "think", "fetch", "switch_mode", "other"]
OPERATOR_SECRET = "sk-acp-operator-secret-0001"
# By bare name, as an operator would: `python` is found on the sandbox's PATH (the service's own
# environment), and the script's directory is the agent's installation (readPaths).
FAKE = ["python", str(ROOT / "tests" / "fakes" / "acp_agent.py")]
FAKE_INSTALL = [str(ROOT / "tests" / "fakes")]
STREAMS = {"history": {"compacted": {}, "full": {}}, "stream": {"delta": {}, "message": {}, "none": {}}}


def fake_agent(name: str, **config) -> dict:
    env = dict(config.pop("env", {}))
    return {
        "name": name,
        "title": f"Scripted ACP agent {name}",
        "runtime": {
            "kind": "acp",
            "config": {
                "command": FAKE,
                "env": env,
                "readPaths": FAKE_INSTALL,
                "options": {"model": {"configOption": "model"}, "apiKey": {"env": "FAKE_API_KEY"}},
                **config,
            },
        },
        "options": [
            {"type": "select", "name": "model", "options": ["fast", "smart"], "default": "fast"},
            {"type": "secret", "name": "apiKey", "default": OPERATOR_SECRET},
        ],
        "capabilities": {**STREAMS, "image": {"data": {}}},
    }


AGENTS = [
    fake_agent("acp-fake", mcpServers=[{"name": "docs", "command": "/bin/true", "args": [], "env": []}]),
    fake_agent("acp-quick", permissionTimeoutSeconds=2, hangTimeoutSeconds=3),
    fake_agent("acp-terminal", terminal=True, terminalTimeoutSeconds=2),
    fake_agent("acp-loader", env={"FAKE_ACP_LOAD_SESSION": "1"}, idleSeconds=2),
    fake_agent("acp-shared", isolation="tenant"),
]
_applied: set[str] = set()


def with_agents(stack: Stack, tmp_path_factory) -> Stack:
    if stack.name not in _applied:
        path = tmp_path_factory.mktemp("acp-agents") / "agents.yaml"
        path.write_text(yaml.safe_dump({"agents": AGENTS}))
        stack.manage("apply_agents", str(path))
        _applied.add(stack.name)
    return stack


@pytest.fixture
def pg(pg_stack, tmp_path_factory) -> Stack:
    return with_agents(pg_stack, tmp_path_factory)


@pytest.fixture
def client(pg):
    client = pg.client("demo")
    yield client
    client.close()


def workspace(stack: Stack, session: str, tenant: str = "demo") -> Path:
    root = stack.env.get("AAP_WORKSPACE_ROOT") or str(Path(stack.env["HOSTING_VAR_DIR"]) / "workspaces")
    return Path(os.path.realpath(root)) / tenant / session


def session_of(client, agent: str = "acp-fake", *, tools: list[dict] | None = None, options: dict | None = None) -> str:
    config: dict = {"name": agent}
    if tools is not None:
        config["tools"] = tools
    if options is not None:
        config["options"] = options
    response = client.post("/v1/sessions", {"agent": config})
    assert response.status_code == 201, response.text
    return response.json()["sessionId"]


def said(client, session: str, text: str, **body) -> str:
    """Run a user turn that must end normally; returns the assistant's text."""
    result = checked_turn(client, session, user(text), **body)
    assert result.stop_reason == "end_turn", result.body or result.names
    return "".join(
        b["text"] for m in result.messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "text"
    )


def agent_pid(client, session: str) -> int:
    """The agent's process id on the host (inside its own PID namespace it has another)."""
    return host_pid(said(client, session, "/pid"))


def host_pid(said_pid: str) -> int:
    """The host's process id of a process that said `pid=N ns=pid:[inode]` (the one in that
    PID namespace whose innermost id is N)."""
    fields = dict(part.split("=", 1) for part in said_pid.split())
    inner, namespace = fields["pid"], fields["ns"]
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != namespace:
                continue
            status = Path(f"/proc/{entry.name}/status").read_text()
        except OSError:
            continue
        nspid = next(line for line in status.splitlines() if line.startswith("NSpid:")).split()
        if nspid[-1] == inner:
            return int(entry.name)
    raise AssertionError(f"no process on the host said {said_pid!r}")


def answer(client, session: str, call_id: str, granted: bool, *, stream: str = "none", reason: str | None = None):
    message = {"role": "tool_permission", "toolCallId": call_id, "granted": granted}
    if reason:
        message["reason"] = reason
    return checked_turn(client, session, [message], stream=stream, stored=[])


def same_turn_in_every_mode(client, session: str, messages: list[dict]) -> dict:
    """The same turn once per stream mode: all three fold to the same messages (up to call ids)."""
    results = {mode: checked_turn(client, session, messages, stream=mode) for mode in MODES}
    folded = [numbered_calls(result.messages) for result in results.values()]
    assert folded[0] == folded[1] == folded[2]
    assert len({result.stop_reason for result in results.values()}) == 1
    return results


def tool_results(result) -> list[str]:
    return [m["content"] for m in result.messages if m["role"] == "tool"]


# --- discovery and configuration ---------------------------------------------------------------


def test_meta_lists_the_acp_tool_kinds_as_server_tools(client):
    agents = {a["name"]: a for a in client.meta()["agents"]}
    info = agents["acp-fake"]
    assert [tool["name"] for tool in info["tools"]] == TOOL_KINDS
    assert "application" not in info["capabilities"]
    assert OPERATOR_SECRET not in str(info)


def test_an_invalid_runtime_configuration_is_refused_with_a_sentence(pg, tmp_path):
    path = tmp_path / "bad.yaml"
    bad = fake_agent("acp-bad")
    bad["runtime"]["config"]["options"] = {"apiKey": {"argv": "--key"}}
    path.write_text(yaml.safe_dump({"agents": [bad]}))
    with pytest.raises(RuntimeError, match="Runtime configuration for 'acp' is invalid at 'options/apiKey'"):
        pg.manage("apply_agents", str(path))


# --- the event mapping -------------------------------------------------------------------------


def test_text_and_thoughts_stream_in_every_mode(client):
    session = session_of(client)
    results = same_turn_in_every_mode(client, session, user("/think deep waters"))
    assert results["none"].messages == [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "thinking about: deep waters"},
                {"type": "text", "text": "echo: deep waters"},
            ],
        }
    ]
    assert_deltas(results["delta"], ["thinking ", "about: ", "deep ", "waters"], "thinking")
    assert results["message"].names == ["turn_start", "thinking", "text", "turn_stop"]


def test_a_tool_call_the_agent_reports_failed_is_recorded_as_failed_not_as_an_edit(client):
    session = session_of(client)
    result = checked_turn(client, session, user("/failedit notes.txt"))
    assert result.stop_reason == "end_turn"
    assert tool_results(result) == ["Tool call failed: Permission denied by the user."]
    stored = [m for m in client.history(session) if m["role"] == "tool"]
    assert [m["content"] for m in stored] == ["Tool call failed: Permission denied by the user."]
    assert "Edited" not in str(client.history(session))


def test_a_tool_call_and_its_updates_become_tool_call_and_tool_result(client):
    session = session_of(client)
    results = same_turn_in_every_mode(client, session, user("/tool"))
    messages = results["none"].messages
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    use = messages[0]["content"][0]
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "read", {"path": "README"})
    assert messages[1] == {"role": "tool", "toolCallId": use["toolCallId"], "content": "README contents"}
    assert messages[2] == text_reply("done")[0]
    delta = results["delta"]
    assert delta.names == ["turn_start", "tool_call", "tool_result", "text_delta", "turn_stop"]
    assert delta.events[1].data["_meta"]["title"] == "Read README"


def test_plan_and_other_updates_never_break_the_stream(client):
    session = session_of(client)
    results = same_turn_in_every_mode(client, session, user("/plan"))
    assert results["none"].messages == text_reply("planned")
    assert results["delta"].names == ["turn_start", "text_delta", "turn_stop"]


@pytest.mark.parametrize(
    "acp_reason, stop_reason",
    [
        ("end_turn", "end_turn"),
        ("max_tokens", "max_tokens"),
        ("max_turn_requests", "max_tokens"),
        ("refusal", "refusal"),
        ("cancelled", "end_turn"),
    ],
)
def test_prompt_stop_reasons_map_to_aap_stop_reasons(client, acp_reason, stop_reason):
    session = session_of(client)
    result = checked_turn(client, session, user(f"/stop {acp_reason}"), stream="delta")
    stop = result.events[-1]
    assert stop.data["stopReason"] == stop_reason
    assert stop.data.get("_meta", {}).get("cancelled", False) is (acp_reason == "cancelled")
    assert result.messages == text_reply("stopping")


def test_options_reach_the_agent_as_config_options_and_mcp_servers_as_session_new(client):
    session = session_of(client, options={"model": "smart"})
    assert " model=smart " in said(client, session, "/whoami")
    text = said(client, session, "/whoami", agent={"options": {"model": "fast"}})
    assert " model=fast " in text and " mcp=docs " in text


# --- permissions -------------------------------------------------------------------------------


def test_a_trusted_kind_is_allowed_by_the_service(pg, client):
    session = session_of(client, tools=[{"name": "edit", "trust": True}])
    result = checked_turn(client, session, user("/write notes.txt hello there"), stream="delta")
    assert result.stop_reason == "end_turn"
    assert tool_results(result) == ["wrote notes.txt"]
    assert (workspace(pg, session) / "notes.txt").read_text() == "hello there"


def test_a_kind_the_session_did_not_enable_is_rejected(pg, client):
    session = session_of(client, tools=[{"name": "read", "trust": True}])
    result = checked_turn(client, session, user("/write notes.txt nope"))
    assert result.stop_reason == "end_turn"
    assert tool_results(result) == ["Tool call denied: tool kind 'edit' is not enabled for this session"]
    assert result.messages[-1] == text_reply("not allowed to write notes.txt")[0]
    assert not (workspace(pg, session) / "notes.txt").exists()


@pytest.mark.parametrize("stream", ["none", "delta"])
def test_an_untrusted_kind_waits_for_the_application_and_the_prompt_goes_on_in_the_next_turn(pg, client, stream):
    session = session_of(client, tools=[{"name": "edit"}])
    first = checked_turn(client, session, user("/write later.txt granted text"), stream=stream)
    assert first.stop_reason == "tool_use"
    [call] = first.tool_calls()
    assert (call["name"], call["input"]) == ("edit", {"path": "later.txt", "content": "granted text"})
    assert not (workspace(pg, session) / "later.txt").exists()
    refused = client.turn(session, text="something else")
    assert refused.status == 400 and call["toolCallId"] in refused.body["error"]

    second = answer(client, session, call["toolCallId"], True, stream=stream)
    assert second.stop_reason == "end_turn"
    assert second.messages == [
        {"role": "tool", "toolCallId": call["toolCallId"], "content": "wrote later.txt"},
        *text_reply("wrote later.txt"),
    ]
    assert (workspace(pg, session) / "later.txt").read_text() == "granted text"
    assert said(client, session, "next one") == "echo: next one"


def test_a_denied_permission_is_stored_as_tool_message_and_the_agent_goes_on(pg, client):
    session = session_of(client, tools=[{"name": "edit", "trust": False}])
    [call] = checked_turn(client, session, user("/write no.txt x")).tool_calls()
    second = answer(client, session, call["toolCallId"], False, reason="not today", stream="delta")
    assert second.messages == [
        {"role": "tool", "toolCallId": call["toolCallId"], "content": "Tool call denied: not today"},
        *text_reply("not allowed to write no.txt"),
    ]
    assert not (workspace(pg, session) / "no.txt").exists()


def test_an_unanswered_permission_is_rejected_after_the_timeout_and_recorded(pg, client):
    session = session_of(client, "acp-quick", tools=[{"name": "edit"}])
    [call] = checked_turn(client, session, user("/write late.txt x")).tool_calls()
    time.sleep(5)  # past permissionTimeoutSeconds (2): the service rejects it meanwhile
    second = answer(client, session, call["toolCallId"], True)
    assert second.messages == [
        {"role": "tool", "toolCallId": call["toolCallId"], "content": "Tool call denied: no answer within 2 seconds"},
        *text_reply("not allowed to write late.txt"),
    ]
    assert not (workspace(pg, session) / "late.txt").exists()


def test_a_permission_is_asked_for_the_input_the_agent_completed_in_later_updates(pg, client):
    """OpenCode's order: a tool_call with part of its input, an update completing it, then the
    request (whose toolCall has only the id and a title): the application sees what will run."""
    session = session_of(client, tools=[{"name": "execute"}])
    first = checked_turn(client, session, user("/staged"), stream="delta")
    assert first.stop_reason == "tool_use"
    [call] = first.tool_calls()
    cwd = call["input"]["cwd"]
    assert os.path.realpath(cwd) == str(workspace(pg, session))
    assert (call["name"], call["input"]) == ("execute", {"cwd": cwd, "command": "echo staged"})
    assert call["_meta"]["title"] == "Run echo staged" and call["_meta"]["locations"] == [{"path": cwd}]
    second = answer(client, session, call["toolCallId"], True)
    assert second.messages == [
        {"role": "tool", "toolCallId": call["toolCallId"], "content": "ran: echo staged"},
        *text_reply("ran: echo staged"),
    ]


def test_a_grant_does_not_hold_for_an_input_the_agent_changed_after_asking(pg, client):
    session = session_of(client, tools=[{"name": "execute"}])
    [asked] = checked_turn(client, session, user("/staged change")).tool_calls()
    assert asked["input"]["command"] == "echo staged"
    home = workspace(pg, session)
    (home / "go").write_text("")  # the agent now changes the command, while the application decides
    wait_until(lambda: (home / "changed").exists(), timeout=30, message="the agent's changed input")
    time.sleep(1)  # the service has read the update the agent wrote before its marker

    second = answer(client, session, asked["toolCallId"], True, stream="delta")
    assert second.stop_reason == "tool_use"
    [again] = second.tool_calls()
    assert again["toolCallId"] != asked["toolCallId"]
    assert (again["name"], again["input"]) == ("execute", {"cwd": asked["input"]["cwd"], "command": "echo changed"})
    assert second.messages[0] == {
        "role": "tool",
        "toolCallId": asked["toolCallId"],
        "content": "Tool call denied: the agent changed the call's input after permission was asked; asked again",
    }
    third = answer(client, session, again["toolCallId"], True)
    assert third.messages == [
        {"role": "tool", "toolCallId": again["toolCallId"], "content": "ran: echo changed"},
        *text_reply("ran: echo changed"),
    ]


def test_an_input_the_agent_changed_after_the_grant_is_recorded_with_the_result(pg, client):
    session = session_of(client, tools=[{"name": "execute"}])
    [call] = checked_turn(client, session, user("/staged late")).tool_calls()
    second = answer(client, session, call["toolCallId"], True)
    changed = json.dumps({"cwd": call["input"]["cwd"], "command": "echo late"})
    assert second.messages == [
        {
            "role": "tool",
            "toolCallId": call["toolCallId"],
            "content": f"The agent changed this call after it was allowed, to: {changed}\nran: echo late",
        },
        *text_reply("ran: echo late"),
    ]


# --- the client methods: files, terminals, anything else -----------------------------------------


def test_file_access_outside_the_workspace_is_refused(pg, client, tmp_path):
    session = session_of(client, tools=[{"name": "edit", "trust": True}])
    said(client, session, "/write inside.txt hello")
    home = workspace(pg, session)
    outside = tmp_path / "outside.txt"
    outside.write_text("secret outside")
    (home / "link.txt").symlink_to(outside)
    (home / "linkdir").symlink_to(tmp_path, target_is_directory=True)

    assert said(client, session, "/read inside.txt") == "read: hello"
    assert said(client, session, f"/readraw {home}/sub/../inside.txt") == "read failed: -32602"
    for path in ("../inside.txt", str(outside), "link.txt", "linkdir/outside.txt"):
        assert said(client, session, f"/read {path}") == "read failed: -32602", path
    assert said(client, session, "/readraw inside.txt") == "read failed: -32602"  # relative
    assert said(client, session, "/read missing.txt") == "read failed: -32002"
    for path in (f"{home}/link.txt", f"{home}/linkdir/new.txt", f"{home}/../escaped.txt"):
        assert said(client, session, f"/writeraw {path} pwned") == "write failed: -32602", path
    assert outside.read_text() == "secret outside"
    assert not (tmp_path / "new.txt").exists() and not (home.parent / "escaped.txt").exists()


def test_two_tenants_sessions_never_see_each_others_workspace(pg, client):
    other = pg.client("other")
    try:
        mine = session_of(client, tools=[{"name": "edit", "trust": True}])
        theirs = session_of(other, tools=[{"name": "edit", "trust": True}])
        said(client, mine, "/write private.txt only demo")
        said(other, theirs, "/write private.txt only other")
        assert said(client, mine, "/read private.txt") == "read: only demo"
        assert said(other, theirs, "/read private.txt") == "read: only other"
        assert said(other, theirs, f"/read {workspace(pg, mine)}/private.txt") == "read failed: -32602"
        assert said(client, mine, f"/read {workspace(pg, theirs, 'other')}/private.txt") == "read failed: -32602"
        assert said(client, mine, "/pid") != said(other, theirs, "/pid")  # never one process for two tenants
    finally:
        other.close()


def test_terminals_are_off_unless_the_operator_enables_them(pg, client):
    off = session_of(client)
    assert said(client, off, "/terminal pwd") == "terminal failed: -32601"
    on = session_of(client, "acp-terminal")
    assert said(client, on, "/terminal pwd") == f"exit=0 output={workspace(pg, on)}"
    assert said(client, on, "/terminal sleep 30") == "exit=None output="  # killed at terminalTimeoutSeconds


def test_an_unknown_client_method_is_method_not_found_and_the_turn_goes_on(client):
    session = session_of(client)
    assert said(client, session, "/unknown") == "unknown method error -32601; still here"


# --- failures, cancel, lifecycle -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["/hang", "/exit", "/garbage"])
def test_a_hung_exited_or_garbage_writing_agent_ends_the_turn_with_error_and_the_next_turn_works(client, command):
    session = session_of(client, "acp-quick")
    before = agent_pid(client, session)
    failed = checked_turn(client, session, user(command), stream="delta")
    stop = failed.events[-1].data
    assert stop["stopReason"] == "error"
    assert stop["_meta"]["error"].startswith("The agent ")
    assert said(client, session, "back again") == "echo: back again"
    assert agent_pid(client, session) != before


LOADER_LIBRARY = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/loaded-as-%d", MARK_DIR, (int)getuid());
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
}
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="root's part is what is probed (CI runs as root)")
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the loader library")
def test_a_loader_variable_asked_for_a_terminal_never_runs_as_root(pg, client):
    """An agent asks terminal/create for LD_PRELOAD of a library it wrote into its workspace:
    the library loads only inside the command's sandbox, as the unit's uid (the positive
    control), never in the launcher that starts it as root."""
    session = session_of(client, "acp-terminal")
    assert said(client, session, "/terminal true") == "exit=0 output="  # the process and workspace exist
    work = workspace(pg, session)
    source = work / "preload.c"
    source.write_text(LOADER_LIBRARY.replace("MARK_DIR", f'"{work}"'))
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(work / "preload.so"), str(source)], check=True)
    os.chmod(work / "preload.so", 0o755)
    said(client, session, f"/terminal LD_PRELOAD={work}/preload.so true")
    marks = sorted(path.name for path in work.glob("loaded-as-*"))
    assert "loaded-as-0" not in marks
    assert marks and all(name != "loaded-as-0" for name in marks)  # it did load, inside


def test_sigkill_of_the_agent_mid_turn_gives_error_and_a_working_next_turn(pg, client):
    session = session_of(client)
    pid = agent_pid(client, session)
    live = LiveTurn.turn(pg, session, "/slow 100 200", stream="delta")
    live.wait_for(lambda turn: any(e.event == "text_delta" for e in turn.events), what="the first tick")
    os.kill(pid, signal.SIGKILL)
    result = live.wait_end().result()
    assert result.events[-1].data["stopReason"] == "error"
    assert "exited" in result.events[-1].data["_meta"]["error"]
    assert client.history(session)[-len(result.messages) :] == result.messages
    assert agent_pid(client, session) != pid


def test_cancel_sends_session_cancel_and_the_turn_ends_cancelled(pg, client):
    session = session_of(client)
    pid = agent_pid(client, session)
    live = LiveTurn.turn(pg, session, "/slow 100 200", stream="delta")
    live.wait_for(lambda turn: len(deltas(turn)) >= 2, what="two ticks")
    response = client.post(f"/v1/sessions/{session}/turns/{live.turn_id}/cancel")
    assert response.status_code == 202
    result = live.wait_end().result()
    stop = result.events[-1].data
    assert stop["stopReason"] == "end_turn" and stop["_meta"]["cancelled"] is True
    ticks = deltas(result)
    assert 2 <= len(ticks) < 100
    assert client.history(session)[-1] == text_reply("".join(ticks))[0]
    assert agent_pid(client, session) == pid  # the agent stopped the prompt; nothing was killed


def test_session_delete_removes_the_workspace_and_drops_a_waiting_prompt(pg, client):
    session = session_of(client, tools=[{"name": "edit"}])
    pid = agent_pid(client, session)
    assert checked_turn(client, session, user("/write gone.txt x")).stop_reason == "tool_use"
    home = workspace(pg, session)
    assert home.is_dir()
    assert client.delete(f"/v1/sessions/{session}").status_code == 204
    assert not home.exists()
    # The session was its agent process's isolation unit: the process went with it.
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=10)
    other = session_of(client)
    assert agent_pid(client, other) != pid
    assert not home.exists()


def test_each_session_has_its_own_agent_process_unless_the_operator_shares_them_per_tenant(pg, client, other):
    def owner(client, session):
        pid = agent_pid(client, session)
        return pid, Path(f"/proc/{pid}").stat().st_uid

    first, second = session_of(client), session_of(client)
    (pid1, uid1), (pid2, uid2) = owner(client, first), owner(client, second)
    assert pid1 != pid2
    if os.geteuid() == 0:  # the service runs as root here: each unit runs as a uid of its own
        assert uid1 != uid2 and 0 not in (uid1, uid2)
    shared = [session_of(client, "acp-shared") for _ in range(2)]
    (pid3, uid3), (pid4, uid4) = (owner(client, s) for s in shared)
    assert (pid3, uid3) == (pid4, uid4)
    theirs = session_of(other, "acp-shared")
    pid5, uid5 = owner(other, theirs)
    assert pid5 != pid3  # never across tenants
    if os.geteuid() == 0:
        assert uid5 != uid3
        tenant_dir = workspace(pg, first).parent.stat()
        assert (tenant_dir.st_uid, tenant_dir.st_mode & 0o777) == (0, 0o711)  # the service's, traversable only
        assert workspace(pg, shared[0]).stat().st_uid == uid3
        assert workspace(pg, first).stat().st_uid == uid1
    owner(client, session_of(client))  # a session's own process still starts beside the shared one


def test_secret_options_reach_only_the_process_environment(pg, client, log_dir, db_access):
    secret = "sk-app-secret-" + os.urandom(6).hex()
    session = session_of(client, options={"apiKey": secret})
    result = client.turn(session, text="/env FAKE_API_KEY", stream="delta")
    assert result.messages == text_reply(f"FAKE_API_KEY={hashlib.sha256(secret.encode()).hexdigest()[:12]}")
    pid = agent_pid(client, session)
    assert secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert secret not in result.raw.decode()
    assert secret not in str(client.history(session))
    assert client.get(f"/v1/sessions/{session}").json()["agent"]["options"]["apiKey"] == "***"
    for path in log_dir.iterdir():
        assert secret not in path.read_text(errors="replace"), path.name
    from sessions_app.models import Message

    assert not Message.objects.filter(data__contains=secret).exists()


def test_the_agent_session_is_loaded_again_after_a_process_restart(client):
    session = session_of(client, "acp-loader")
    first = said(client, session, "/whoami")
    acp_session = re.search(r"session=(\S+)", first).group(1)
    assert " loaded=False " in first
    assert client.turn(session, text="/exit").stop_reason == "error"
    again = said(client, session, "/whoami")
    assert f"session={acp_session} " in again and " loaded=True " in again
    assert "(replayed" not in str(client.history(session))  # the load's replay is not a turn


def test_an_idle_agent_process_is_reaped_and_started_again_on_demand(client):
    session = session_of(client, "acp-loader")
    pid = agent_pid(client, session)
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=60, message="the idle agent to be reaped")
    assert agent_pid(client, session) != pid


def test_an_image_reaches_an_agent_that_accepts_images(client):
    session = session_of(client)
    content = [{"type": "text", "text": "look"}, {"type": "image", "url": "data:image/png;base64,iVBORw0KGgo="}]
    result = checked_turn(client, session, [{"role": "user", "content": content}])
    assert result.messages == text_reply("echo: look [images: 1]")


# --- the embedded mode ---------------------------------------------------------------------------


def test_a_basic_turn_works_on_both_stacks(stack, tmp_path_factory):
    with_agents(stack, tmp_path_factory)
    client = stack.client()
    try:
        session = session_of(client, tools=[{"name": "edit", "trust": True}])
        result = checked_turn(client, session, user("/write hello.txt from acp"), stream="delta")
        assert result.stop_reason == "end_turn"
        assert (workspace(stack, session) / "hello.txt").read_text() == "from acp"
        assert said(client, session, "hi") == "echo: hi"
    finally:
        client.close()
