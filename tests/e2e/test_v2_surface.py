"""A v2-era application (written from seed 001, the types of the AAP TypeScript SDK v0.1.0)
against /v2/ on the real stack: every call in every stream mode, client tools, server tools
and permissions, images as mimeType/data, paging by nextCursor, errors as JSON, and the
same sessions and history through /v1/."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from ..support import parse_sse

MODES = ("none", "delta", "message")
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
LOOKUP = {
    "name": "lookup",
    "description": "Looks a word up in the application's dictionary.",
    "inputSchema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}


def user(content) -> dict:
    return {"role": "user", "content": content}


def tool_command(name: str, args: dict) -> dict:
    return user(f"/tool {name} {json.dumps(args)}")


class Answer:
    """One PUT /session or POST /session/:id answer: the AgentResponse, or the SSE events
    folded into the same shape (seed 001: `{sessionId?, stopReason, messages}`)."""

    def __init__(self, response: httpx.Response, raw: bytes):
        self.status = response.status_code
        self.headers = response.headers
        self.events: list[dict] = []
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            events, _ = parse_sse(raw)
            self.events = [{"event": e.event, **e.data} for e in events]
            self.ids = [e.id for e in events]
            self.body = None
        else:
            self.body = json.loads(raw)

    @property
    def names(self) -> list[str]:
        return [e["event"] for e in self.events]

    @property
    def session_id(self) -> str:
        if self.body is not None:
            return self.body["sessionId"]
        assert self.events[0]["event"] == "session_start"
        return self.events[0]["sessionId"]

    @property
    def stop_reason(self) -> str:
        return self.body["stopReason"] if self.body is not None else self.events[-1]["stopReason"]

    @property
    def messages(self) -> list[dict]:
        if self.body is not None:
            return self.body["messages"]
        return fold(self.events)

    def tool_calls(self) -> list[dict]:
        return [b for m in self.messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"]


def fold(events: list[dict]) -> list[dict]:
    """Seed 001's events as the messages a `stream: "none"` answer carries."""
    messages: list[dict] = []
    blocks: list[dict] = []
    joining = None
    for event in events:
        kind = event["event"]
        if kind in ("text_delta", "thinking_delta"):
            part = kind.split("_")[0]
            if joining == part:
                blocks[-1][part] += event["delta"]
            else:
                blocks.append({"type": part, part: event["delta"]})
            joining = part
            continue
        joining = None
        if kind in ("text", "thinking"):
            blocks.append({"type": kind, kind: event[kind]})
        elif kind == "tool_call":
            blocks.append({"type": "tool_use", **{k: event[k] for k in ("toolCallId", "name", "input")}})
        elif kind == "tool_result":
            if blocks:
                messages.append({"role": "assistant", "content": blocks})
            blocks = []
            messages.append({"role": "tool", "toolCallId": event["toolCallId"], "content": event["content"]})
    if blocks:
        messages.append({"role": "assistant", "content": blocks})
    return messages


class V2Client:
    """Seed 001's calls, as the v0.1.0 client makes them (base URL `https://host/v2`)."""

    def __init__(self, base_url: str, token: str):
        self.http = httpx.Client(
            base_url=base_url + "/v2",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=60,
        )

    def close(self):
        self.http.close()

    def _send(self, method: str, path: str, body: dict, **headers) -> Answer:
        if body.get("stream") in ("delta", "message"):
            headers["Accept"] = "text/event-stream"
        with self.http.stream(method, path, content=json.dumps(body), headers=headers) as response:
            return Answer(response, response.read())

    def meta(self) -> dict:
        return self.http.get("/meta").json()

    def create_session(self, body: dict, **headers) -> Answer:
        return self._send("PUT", "/session", body, **headers)

    def send_turn(self, session_id: str, body: dict, **headers) -> Answer:
        return self._send("POST", f"/session/{session_id}", body, **headers)

    def get_session(self, session_id: str) -> dict:
        response = self.http.get(f"/session/{session_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def list_sessions(self, **params) -> dict:
        response = self.http.get("/sessions", params=params)
        assert response.status_code == 200, response.text
        return response.json()

    def delete_session(self, session_id: str) -> httpx.Response:
        return self.http.delete(f"/session/{session_id}")


@pytest.fixture
def v2(stack):
    client = V2Client(stack.base_url, stack.tokens["demo"])
    yield client
    client.close()


@pytest.fixture
def v2pg(pg_stack):
    client = V2Client(pg_stack.base_url, pg_stack.tokens["demo"])
    yield client
    client.close()


def v1_history(client, session_id: str, kind: str = "full") -> list[dict]:
    response = client.get(f"/v1/sessions/{session_id}/history", params={"type": kind})
    assert response.status_code == 200, response.text
    return response.json()["history"][kind]


def as_v2(message: dict) -> dict:
    """A v3 history message as seed 001 writes it (images as mimeType/data)."""
    if not isinstance(message.get("content"), list):
        return message
    content = []
    for block in message["content"]:
        if block.get("type") == "image":
            mime, _, data = block["url"].removeprefix("data:").partition(";base64,")
            block = {"type": "image", "mimeType": mime, "data": data}
        content.append(block)
    return {**message, "content": content}


def assert_same_history_on_both_surfaces(v2: V2Client, client, session_id: str) -> list[dict]:
    full = v2.get_session(session_id)["history"]["full"]
    assert full == [as_v2(m) for m in v1_history(client, session_id)]
    return full


# --- every call, every stream mode ------------------------------------------------------------------


def test_meta_says_version_2_with_input_schemas(v2):
    meta = v2.meta()
    assert meta["version"] == 2
    echo = next(agent for agent in meta["agents"] if agent["name"] == "echo")
    add = next(tool for tool in echo["tools"] if tool["name"] == "add")
    assert add["inputSchema"]["required"] == ["a", "b"] and "parameters" not in add


@pytest.mark.parametrize("mode", MODES)
def test_a_conversation_in_every_mode_is_one_session_on_both_surfaces(stack, v2, client, mode):
    first = v2.create_session(
        {
            "agent": {"name": "echo", "options": {"style": "upper"}},
            "stream": mode,
            "messages": [
                {"role": "system", "content": "Be brief."},
                user("hello there"),
                {"role": "assistant", "content": "echo: HELLO THERE"},
                user("/think cats"),
            ],
        }
    )
    expected = [
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "thinking about: cats"},
                {"type": "text", "text": "echo: CATS"},
            ],
        }
    ]
    if mode == "none":
        assert first.status == 201
        assert list(first.body)[:3] == ["sessionId", "stopReason", "messages"]
    else:
        assert first.status == 200
        assert first.names[0] == "session_start" and first.ids[0] is None
        assert first.names[1] == "turn_start" and first.names[-1] == "turn_stop"
        assert ("thinking_delta" in first.names) == (mode == "delta")
        assert ("text" in first.names) == (mode == "message")
    session = first.session_id
    assert session.startswith("sess_")
    assert (first.stop_reason, first.messages) == ("end_turn", expected)

    # The next turn through /v2/, then one through /v1/: one conversation.
    second = v2.send_turn(session, {"stream": mode, "messages": [user("again")]})
    assert second.status == 200
    assert (second.stop_reason, second.messages) == (
        "end_turn",
        [{"role": "assistant", "content": [{"type": "text", "text": "echo: AGAIN"}]}],
    )
    if mode != "none":
        assert second.names[0] == "turn_start"
        assert second.body is None and "session_start" not in second.names
    else:
        assert "sessionId" not in second.body
    third = client.post(f"/v1/sessions/{session}/turns", {"messages": [user("from v3")]})
    assert third.status_code == 200 and third.json()["messages"][0]["content"][0]["text"] == "echo: FROM V3"

    full = assert_same_history_on_both_surfaces(v2, client, session)
    assert [m["role"] for m in full] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    info = v2.get_session(session)
    assert info["sessionId"] == session
    assert info["agent"] == {"name": "echo", "options": {"style": "upper"}}
    assert set(info["history"]) == {"compacted", "full"}
    assert client.get(f"/v1/sessions/{session}").json()["agent"] == info["agent"]

    deleted = v2.delete_session(session)
    assert deleted.status_code == 204
    assert client.get(f"/v1/sessions/{session}").status_code == 404
    gone = v2.http.get(f"/session/{session}")
    assert gone.status_code == 404 and "error" in gone.json()


def test_a_v1_session_is_continued_through_v2(v2, client):
    session = client.create_session("echo")
    assert client.post(f"/v1/sessions/{session}/turns", {"messages": [user("one")]}).status_code == 200
    answer = v2.send_turn(session, {"stream": "message", "messages": [user("two")]})
    assert answer.names == ["turn_start", "text", "turn_stop"]
    full = assert_same_history_on_both_surfaces(v2, client, session)
    assert [m.get("content") for m in full if m["role"] == "user"] == ["one", "two"]


# --- client tools, server tools, permissions ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_client_tool_declared_with_input_schema_is_called_and_answered(stack, v2, client, mode):
    first = v2.create_session(
        {
            "agent": {"name": "echo"},
            "stream": mode,
            "tools": [LOOKUP],
            "messages": [tool_command("lookup", {"q": "aap"})],
        }
    )
    assert first.stop_reason == "tool_use"
    [call] = first.tool_calls()
    assert (call["name"], call["input"]) == ("lookup", {"q": "aap"})
    if mode != "none":
        assert first.names[-2:] == ["tool_call", "turn_stop"]
    session = first.session_id
    assert v2.get_session(session)["tools"] == [LOOKUP]
    assert client.get(f"/v1/sessions/{session}").json()["tools"][0]["parameters"] == LOOKUP["inputSchema"]

    # The tool's answer carries an image, written as seed 001 writes images.
    answer = [{"type": "text", "text": "found"}, {"type": "image", "mimeType": "image/png", "data": PNG}]
    reply = v2.send_turn(
        session, {"stream": mode, "messages": [{"role": "tool", "toolCallId": call["toolCallId"], "content": answer}]}
    )
    assert reply.stop_reason == "end_turn"
    assert reply.messages == [
        {"role": "assistant", "content": [{"type": "text", "text": "tool lookup returned: found"}]}
    ]
    full = assert_same_history_on_both_surfaces(v2, client, session)
    assert {"role": "tool", "toolCallId": call["toolCallId"], "content": answer} in full
    stored = v1_history(client, session)
    assert {"type": "image", "url": f"data:image/png;base64,{PNG}"} in stored[-2]["content"]


@pytest.mark.parametrize("mode", MODES)
def test_a_trusted_server_tool_runs_inline_with_its_tool_result(stack, v2, client, mode):
    first = v2.create_session(
        {
            "agent": {"name": "echo", "tools": [{"name": "add", "trust": True}]},
            "stream": mode,
            "messages": [tool_command("add", {"a": 2, "b": 3})],
        }
    )
    assert first.stop_reason == "end_turn"
    [call] = first.tool_calls()
    assert first.messages[1:] == [
        {"role": "tool", "toolCallId": call["toolCallId"], "content": "5"},
        {"role": "assistant", "content": [{"type": "text", "text": "tool add returned: 5"}]},
    ]
    if mode != "none":
        result = next(e for e in first.events if e["event"] == "tool_result")
        assert result == {"event": "tool_result", "toolCallId": call["toolCallId"], "content": "5"}
    assert_same_history_on_both_surfaces(v2, client, first.session_id)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("granted", [True, False])
def test_an_untrusted_server_tool_waits_for_a_tool_permission_message(stack, v2, client, mode, granted):
    first = v2.create_session(
        {
            "agent": {"name": "echo", "tools": [{"name": "add", "trust": False}]},
            "stream": mode,
            "messages": [tool_command("add", {"a": 20, "b": 22})],
        }
    )
    assert first.stop_reason == "tool_use"
    [call] = first.tool_calls()
    permission = {"role": "tool_permission", "toolCallId": call["toolCallId"], "granted": granted}
    if not granted:
        permission["reason"] = "User declined"
    reply = v2.send_turn(first.session_id, {"stream": mode, "messages": [permission]})
    content = "42" if granted else "Tool call denied: User declined"
    assert reply.stop_reason == "end_turn"
    assert reply.messages == [
        {"role": "tool", "toolCallId": call["toolCallId"], "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": f"tool add returned: {content}"}]},
    ]
    full = assert_same_history_on_both_surfaces(v2, client, first.session_id)
    assert "tool_permission" not in [m["role"] for m in full]


def test_a_turn_changes_server_tools_options_and_client_tools_for_the_session(v2pg, demo):
    first = v2pg.create_session({"agent": {"name": "echo"}, "messages": [user("hi")]})
    session = first.session_id
    reply = v2pg.send_turn(
        session,
        {
            "agent": {"tools": [{"name": "add", "trust": True}], "options": {"signature": "S"}},
            "tools": [LOOKUP],
            "messages": [tool_command("add", {"a": 1, "b": 1})],
        },
    )
    assert reply.messages[-1]["content"][0]["text"] == "tool add returned: 2"
    info = v2pg.get_session(session)
    assert info["agent"] == {"name": "echo", "tools": [{"name": "add", "trust": True}], "options": {"signature": "S"}}
    assert info["tools"] == [LOOKUP]


# --- images -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_images_are_sent_and_read_back_as_mime_type_and_data(stack, v2, client, mode):
    content = [{"type": "text", "text": "look"}, {"type": "image", "mimeType": "image/png", "data": PNG}]
    first = v2.create_session({"agent": {"name": "echo"}, "stream": mode, "messages": [user(content)]})
    assert first.messages == [{"role": "assistant", "content": [{"type": "text", "text": "echo: look [images: 1]"}]}]
    assert v2.get_session(first.session_id)["history"]["full"][0] == user(content)
    assert v1_history(client, first.session_id)[0]["content"][1] == {
        "type": "image",
        "url": f"data:image/png;base64,{PNG}",
    }


# --- paging ---------------------------------------------------------------------------------------


def test_sessions_page_by_next_cursor_passed_back_as_after(pg_stack):
    token = pg_stack.manage("create_tenant", f"v2-paging-{uuid.uuid4().hex[:8]}").strip().splitlines()[-1]
    v2 = V2Client(pg_stack.base_url, token)
    try:
        created = [
            v2.create_session({"agent": {"name": "echo"}, "messages": [user(str(i))]}).session_id for i in range(5)
        ]
        seen, pages, after = [], 0, None
        while True:
            page = v2.list_sessions(limit=2, **({"after": after} if after else {}))
            seen += page["sessions"]
            pages += 1
            after = page.get("nextCursor")
            if after is None:
                break
        assert seen == created[::-1] and pages == 3
    finally:
        v2.close()


# --- errors, idempotency, re-attach, cancel ---------------------------------------------------------


def test_errors_are_json_with_a_sentence(v2pg):
    cases = [
        (v2pg.http.put("/session", content=b"{"), 400),
        (v2pg.http.put("/session", json={"agent": {"name": "nope"}, "messages": [user("x")]}), 400),
        (v2pg.http.post("/session/sess_missing", json={"messages": [user("x")]}), 404),
        (v2pg.http.get("/session/sess_missing"), 404),
        (v2pg.http.delete("/session/sess_missing"), 404),
        (httpx.get(str(v2pg.http.base_url).rstrip("/") + "/sessions"), 401),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert response.json()["error"].endswith((".", ")"))


def test_a_second_turn_while_one_runs_is_a_409(v2pg):
    started = v2pg.create_session({"agent": {"name": "echo"}, "messages": [user("hi")]})
    session = started.session_id
    with v2pg.http.stream(
        "POST", f"/session/{session}", json={"stream": "delta", "messages": [user("/slow 6 300")]}
    ) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("event: text_delta"))
        refused = v2pg.http.post(f"/session/{session}", json={"messages": [user("no")]})
        assert refused.status_code == 409 and "already running" in refused.json()["error"]
        for _ in lines:
            pass


def test_v2_paths_under_v1_answer_a_404_that_points_to_v2(pg_stack):
    response = httpx.put(
        pg_stack.base_url + "/v1/session", json={}, headers={"Authorization": f"Bearer {pg_stack.tokens['demo']}"}
    )
    assert response.status_code == 404
    assert "/v2/" in response.json()["error"]


def test_a_retried_put_with_its_idempotency_key_gets_the_same_session(v2pg, demo):
    key = str(uuid.uuid4())
    body = {"agent": {"name": "echo"}, "messages": [user("once")]}
    first = v2pg.create_session(body, **{"Idempotency-Key": key})
    again = v2pg.create_session(body, **{"Idempotency-Key": key})
    assert first.status == again.status == 201
    assert again.session_id == first.session_id
    assert again.headers["AAP-Turn-Id"] == first.headers["AAP-Turn-Id"]
    assert [m["content"] for m in v1_history(demo, first.session_id)] == [
        "once",
        [{"type": "text", "text": "echo: once"}],
    ]
    other = v2pg.http.put("/session", json={**body, "messages": [user("other")]}, headers={"Idempotency-Key": key})
    assert other.status_code == 422


def test_a_put_stream_is_reattached_and_cancelled_as_on_v1(v2pg, demo):
    first = v2pg.create_session(
        {
            "agent": {"name": "echo", "tools": [{"name": "add", "trust": True}]},
            "stream": "delta",
            "messages": [tool_command("add", {"a": 1, "b": 2})],
        }
    )
    session, turn = first.session_id, first.headers["AAP-Turn-Id"]
    # Re-attach after event 2: the rest of the turn, no session_start, ids as before.
    with v2pg.http.stream("GET", f"/session/{session}/turns/{turn}/events", headers={"Last-Event-ID": "2"}) as response:
        events, _ = parse_sse(response.read())
    assert [e.id for e in events] == first.ids[3:]
    assert [e.event for e in events] == first.names[3:]
    # The events ticket reads the turn without the token (a browser's EventSource).
    ticket = first.headers["AAP-Events-Ticket"]
    replay = httpx.get(
        f"{v2pg.http.base_url}session/{session}/turns/{turn}/events", params={"ticket": ticket, "after": "0"}
    )
    assert replay.status_code == 200 and "event: turn_stop" in replay.text
    # Cancel a running turn through /v2/.
    with v2pg.http.stream(
        "POST", f"/session/{session}", json={"stream": "delta", "messages": [user("/slow 30 300")]}
    ) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("event: text_delta"))
        turn = running.headers["AAP-Turn-Id"]
        cancel = v2pg.http.post(f"/session/{session}/turns/{turn}/cancel")
        assert cancel.status_code == 202 and cancel.json() == {"turnId": turn, "cancelling": True}
        rest = "\n".join(lines)
    assert "event: turn_stop" in rest and '"cancelled":true' in rest
