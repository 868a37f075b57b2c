"""The Python AAP SDK (`aap`) against the real service: the sync and async clients, the tool
helpers, re-attach and cancel, and the `aap` command line driven with scripted input."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from aap import AAPError, AsyncClient, Client, ToolRegistry
from tests.support import BIN

from ..turn_checks import text_reply, user


@pytest.fixture
def sdk(stack):
    with Client(stack.base_url + "/v1", stack.tokens["demo"]) as client:
        yield client


def test_meta_sessions_history_and_delete(sdk):
    assert "echo" in [agent["name"] for agent in sdk.meta()["agents"]]
    session = sdk.create_session("echo", options={"style": "upper"})
    assert sdk.session(session)["agent"] == {"name": "echo", "options": {"style": "upper"}}
    assert sdk.turn(session, "hi").messages == text_reply("echo: HI")
    assert sdk.history(session) == user("hi") + text_reply("echo: HI")
    assert session in [s["sessionId"] for s in sdk.sessions(limit=2)]
    sdk.delete_session(session)
    with pytest.raises(AAPError) as missing:
        sdk.session(session)
    assert missing.value.status == 404 and session in missing.value.message


@pytest.mark.parametrize("mode", ["delta", "message"])
def test_streamed_turn_yields_typed_events_and_folds_like_json(sdk, mode):
    session = sdk.create_session("echo")
    with sdk.turn(session, "/think plans", stream=mode) as stream:
        names = [event.event for event in stream]
    assert names[0] == "turn_start" and names[-1] == "turn_stop"
    result = stream.result()
    assert result.turn_id == stream.turn_id and result.turn_id.startswith("turn_")
    assert result.stop_reason == "end_turn" and result.text == "echo: plans"
    assert sdk.turn(session, "/think plans").messages == result.messages
    assert stream.events_ticket


def test_converse_answers_client_tools_and_permissions(sdk):
    registry = ToolRegistry()
    seen = []

    @registry.tool("Looks a word up.", {"type": "object", "properties": {"x": {"type": "integer"}}}, name="mytool")
    def mytool(args):
        seen.append(args)
        return {"found": args["x"] * 2}

    asked = []
    session = sdk.create_session("echo", server_tools=[{"name": "add"}], tools=registry.specs())
    turns = sdk.converse(
        session,
        '/tools [{"name": "mytool", "input": {"x": 21}}, {"name": "add", "input": {"a": 1, "b": 2}}]',
        registry=registry,
        permit=lambda call: asked.append(call["name"]) or True,
    )
    assert [t.stop_reason for t in turns] == ["tool_use", "end_turn"]
    assert seen == [{"x": 21}] and asked == ["add"]
    assert 'tool mytool returned: {"found": 42}' in turns[-1].text
    assert "tool add returned: 3" in turns[-1].text
    denied = sdk.converse(session, '/tool add {"a": 1, "b": 1}', permit=lambda call: (False, "not today"))
    assert "Tool call denied: not today" in denied[-1].text


def test_reattach_from_last_event_id_and_cancel(sdk):
    session = sdk.create_session("echo")
    stream = sdk.turn(session, "/slow 30 200", stream="delta")
    events = iter(stream)
    first = [next(events), next(events)]
    last_seen = stream.last_event_id
    stream.close()  # the connection drops; the turn goes on
    again = sdk.reattach(session, stream.turn_id, last_event_id=last_seen)
    assert sdk.cancel(session, stream.turn_id)["cancelling"] is True
    result = again.result()
    assert result.cancelled and result.stop_reason == "end_turn"
    assert next(e.id for e in again.events) == int(last_seen) + 1
    assert first[0].event == "turn_start"
    assert sdk.reattach(session, stream.turn_id, last_event_id=again.last_event_id) is None  # 204: all read


def test_errors_carry_status_and_sentence(stack, sdk):
    with pytest.raises(AAPError) as bad:
        sdk.create_session("no-such-agent")
    assert bad.value.status == 400 and "no-such-agent" in bad.value.message
    with Client(stack.base_url + "/v1", "not-a-token") as stranger, pytest.raises(AAPError) as refused:
        stranger.create_session("echo")
    assert refused.value.status == 401


def test_async_client(stack):
    async def scenario():
        async with AsyncClient(stack.base_url + "/v1", stack.tokens["demo"]) as client:
            session = await client.create_session("echo")
            stream = await client.turn(session, "async hello", stream="delta")
            deltas = [event.text async for event in stream if event.event == "text_delta"]
            result = await stream.result()
            json_result = await client.turn(session, "again")
            sessions = [s["sessionId"] async for s in client.sessions(limit=5)]
            return session, deltas, result, json_result, sessions, await client.history(session)

    session, deltas, result, json_result, sessions, history = asyncio.run(scenario())
    assert "".join(deltas) == "echo: async hello" and result.text == "echo: async hello"
    assert json_result.messages == text_reply("echo: again")
    assert session in sessions
    assert history == user("async hello") + text_reply("echo: async hello") + user("again") + text_reply("echo: again")


# --- the command line ------------------------------------------------------------------------------


def run_cli(stack, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "AAP_URL": stack.base_url + "/v1", "AAP_TOKEN": stack.tokens["demo"]}
    return subprocess.run([str(BIN / "aap"), *args], input=stdin, env=env, capture_output=True, text=True, timeout=120)


def test_cli_chat_streams_and_asks_for_permission(stack):
    script = 'hello cli\n/tool add {"a": 20, "b": 22}\ny\n/tool add {"a": 1, "b": 1}\nn\n\n'
    done = run_cli(stack, "chat", "--agent", "echo", "--tool", "add", stdin=script)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "agent> echo: hello cli" in out
    assert 'Allow add({"a": 20, "b": 22})? [y/N]' in out
    assert "agent> tool add returned: 42" in out
    assert "agent> tool add returned: Tool call denied" in out
    session = out.split("session ", 1)[1].split()[0]
    history = run_cli(stack, "history", session)
    lines = [json.loads(line) for line in history.stdout.splitlines()]
    assert lines[0] == {"role": "user", "content": "hello cli"}
    assert {"role": "tool", "toolCallId": lines[3]["content"][0]["toolCallId"], "content": "42"} in lines
    assert session in run_cli(stack, "sessions").stdout
    assert "echo 1.0.0" in run_cli(stack, "meta").stdout


def test_cli_says_what_is_wrong(stack):
    env = {**os.environ, "AAP_URL": stack.base_url + "/v1", "AAP_TOKEN": "not-a-token"}
    done = subprocess.run([str(BIN / "aap"), "sessions"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "unknown, expired or revoked" in done.stderr and "401" in done.stderr
    unset = {k: v for k, v in os.environ.items() if k != "AAP_URL"}
    done = subprocess.run([str(BIN / "aap"), "meta"], env=unset, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "AAP_URL" in done.stderr
