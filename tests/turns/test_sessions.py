"""Sessions over AAP v3: create (every validation rule), get, list with cursors, delete, tenancy."""

from __future__ import annotations

import base64
import copy
import itertools
import re
import uuid

import pytest

from ..support import committed

SESSION_ID = re.compile(r"^sess_([A-Za-z0-9_-]+)$")

CLIENT_TOOL = {
    "name": "lookup",
    "title": "Lookup",
    "description": "Looks a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


def assert_400(response, *fragments: str) -> None:
    assert response.status_code == 400, f"{response.status_code} {response.text}"
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error, str) and error.strip()
    for fragment in fragments:
        assert fragment.lower() in error.lower(), f"{fragment!r} not in {error!r}"


def assert_404(response) -> None:
    assert response.status_code == 404, f"{response.status_code} {response.text}"
    assert response.json()["error"].strip()


# --- create and get -----------------------------------------------------------------------


def test_session_ids_are_unguessable(demo, db_access):
    from sessions_app.models import Session

    ids = [demo.create_session("echo") for _ in range(5)]
    assert len(set(ids)) == len(ids)
    for session_id in ids:
        match = SESSION_ID.match(session_id)
        assert match, session_id
        suffix = match.group(1)
        random_bits = len(base64.urlsafe_b64decode(suffix + "=" * (-len(suffix) % 4))) * 8
        assert random_bits >= 128, f"{session_id} carries only {random_bits} bits"
        assert Session.objects.filter(public_id=session_id).exists()
    # Not sequential: no two ids share a long common prefix after "sess_".
    suffixes = sorted(SESSION_ID.match(i).group(1) for i in ids)
    assert all(a[:8] != b[:8] for a, b in itertools.pairwise(suffixes))


def test_created_session_reads_back_as_configured(demo):
    body = {
        "agent": {
            "name": "echo",
            "options": {"style": "upper", "signature": "-- sig"},
            "tools": [{"name": "clock", "trust": True}, {"name": "add"}],
            "_meta": {"ignored": True},
        },
        "tools": [CLIENT_TOOL],
        "_meta": {"ignored": True},
    }
    response = demo.post("/v1/sessions", body)
    assert response.status_code == 201, response.text
    assert response.headers["content-type"].startswith("application/json")
    session = response.json()["sessionId"]
    info = demo.get(f"/v1/sessions/{session}")
    assert info.status_code == 200
    assert info.json() == {
        "sessionId": session,
        "agent": {
            "name": "echo",
            "tools": [{"name": "clock", "trust": True}, {"name": "add", "trust": False}],
            "options": {"style": "upper", "signature": "-- sig"},
        },
        "tools": [CLIENT_TOOL],
    }


def test_minimal_session_has_only_its_agent_name(demo):
    session = demo.create_session("echo-bare")
    assert demo.get(f"/v1/sessions/{session}").json() == {"sessionId": session, "agent": {"name": "echo-bare"}}


def test_seed_messages_are_the_history_exactly(demo):
    messages = [
        {"role": "system", "content": "Be brief. Ünïcödé ✓ 日本語"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "  spaced  "}, {"type": "image", "url": "https://example.com/a.png"}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "text", "text": "calling"},
                {
                    "type": "tool_use",
                    "toolCallId": "call_1",
                    "name": "lookup",
                    "input": {"word": "x", "nested": {"n": [1, 2.5, None]}},
                },
            ],
            "_meta": {"kept": "as sent"},
        },
        {"role": "tool", "toolCallId": "call_1", "content": "found"},
        {"role": "assistant", "content": "done"},
    ]
    session = demo.create_session("echo", messages=messages, tools=[CLIENT_TOOL])
    assert demo.history(session, "full") == messages
    assert demo.history(session, "compacted") == messages


def test_restricted_agent_is_usable_by_its_tenant_only(demo, other):
    assert_400(demo.post("/v1/sessions", {"agent": {"name": "echo-private"}}), "echo-private")
    session = other.create_session("echo-private")
    assert other.get(f"/v1/sessions/{session}").json()["agent"]["name"] == "echo-private"


# --- every 400 rule of POST /v1/sessions ------------------------------------------------------

VALID = {
    "agent": {
        "name": "echo",
        "options": {"style": "plain", "signature": "s"},
        "tools": [{"name": "clock", "trust": True}],
    },
    "messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "toolCallId": "c1", "name": "lookup", "input": {"word": "w"}}],
        },
        {"role": "tool", "toolCallId": "c1", "content": "ok"},
    ],
    "tools": [CLIENT_TOOL],
}


def mutate(path: str, value=None, *, delete: bool = False) -> dict:
    """VALID with one value replaced (or deleted) at a dotted path ("messages.1.content")."""
    body = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    target = body
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    key = int(last) if isinstance(target, list) else last
    if delete:
        del target[key]
    else:
        target[key] = value
    return body


def tool(**changes) -> dict:
    spec = {**CLIENT_TOOL, **changes}
    return {k: v for k, v in spec.items() if v is not _DROP}


_DROP = object()

CREATE_RULES = {
    "agent missing": (mutate("agent", delete=True), ["agent"]),
    "agent name missing": (mutate("agent.name", delete=True), ["name"]),
    "unknown agent": (mutate("agent.name", "no-such-agent"), ["no-such-agent"]),
    "agent of another tenant": (mutate("agent.name", "echo-private"), ["echo-private"]),
    "disabled agent": (mutate("agent.name", "echo-off"), ["echo-off"]),
    "unknown option": (mutate("agent.options.colour", "red"), ["colour"]),
    "option value is a number": (mutate("agent.options.signature", 5), ["signature"]),
    "option value is a boolean": (mutate("agent.options.signature", True), ["signature"]),
    "option value is null": (mutate("agent.options.signature", None), ["signature"]),
    "option value is an object": (mutate("agent.options.signature", {"a": "b"}), ["signature"]),
    "option value is a list": (mutate("agent.options.signature", ["s"]), ["signature"]),
    "options is a list": (mutate("agent.options", ["style"]), ["options"]),
    "select value not a choice": (mutate("agent.options.style", "bold"), ["style", "plain", "upper"]),
    "server tool not exposed": (mutate("agent.tools", [{"name": "weather"}]), ["weather"]),
    "server tool listed twice": (mutate("agent.tools", [{"name": "clock"}, {"name": "clock"}]), ["clock"]),
    "server tool trust not boolean": (mutate("agent.tools", [{"name": "clock", "trust": "yes"}]), ["trust"]),
    "server tool without name": (mutate("agent.tools", [{"trust": True}]), ["name"]),
    "client tools without application.tools": (mutate("agent", {"name": "echo-bare"}), ["echo-bare", "client tools"]),
    "client tool name with a space": (mutate("tools", [tool(name="look up")]), ["name"]),
    "client tool name empty": (mutate("tools", [tool(name="")]), ["name"]),
    "client tool name too long": (mutate("tools", [tool(name="x" * 65)]), ["name"]),
    "client tool name not a string": (mutate("tools", [tool(name=7)]), ["name"]),
    "client tool without description": (mutate("tools", [tool(description=_DROP)]), ["description"]),
    "client tool without parameters": (mutate("tools", [tool(parameters=_DROP)]), ["parameters"]),
    "parameters is a string": (mutate("tools", [tool(parameters="object")]), ["parameters"]),
    "parameters is a list": (mutate("tools", [tool(parameters=[{"type": "object"}])]), ["parameters"]),
    "parameters with an unknown type": (
        mutate("tools", [tool(parameters={"type": "nonsense"})]),
        ["parameters", "schema"],
    ),
    "parameters with a bad nested schema": (
        mutate("tools", [tool(parameters={"type": "object", "properties": {"a": {"type": 5}}})]),
        ["parameters", "schema"],
    ),
    "parameters with required not a list": (
        mutate("tools", [tool(parameters={"type": "object", "required": "word"})]),
        ["schema"],
    ),
    "tools is an object": (mutate("tools", CLIENT_TOOL), ["tools"]),
    "client tool collides with an enabled server tool": (mutate("tools", [tool(name="clock")]), ["clock", "collision"]),
    "client tool names repeated": (mutate("tools", [CLIENT_TOOL, tool(description="again")]), ["lookup"]),
    "messages is an object": (mutate("messages", {"role": "user", "content": "hi"}), ["messages"]),
    "message is a string": (mutate("messages.0", "hello"), ["messages"]),
    "message without role": (mutate("messages.0.role", delete=True), ["role"]),
    "unknown role": (mutate("messages.0.role", "robot"), ["role"]),
    "tool_permission is not history": (
        mutate("messages.3", {"role": "tool_permission", "toolCallId": "c1", "granted": True}),
        ["role"],
    ),
    "content is a number": (mutate("messages.1.content", 42), ["content"]),
    "content is null": (mutate("messages.1.content", None), ["content"]),
    "content missing": (mutate("messages.1.content", delete=True), ["content"]),
    "system content is blocks": (mutate("messages.0.content", [{"type": "text", "text": "x"}]), ["content"]),
    "user content holds thinking": (mutate("messages.1.content", [{"type": "thinking", "thinking": "x"}]), ["content"]),
    "user content holds tool_use": (
        mutate("messages.1.content", [{"type": "tool_use", "toolCallId": "c", "name": "n", "input": {}}]),
        ["content"],
    ),
    "assistant content holds an image": (
        mutate("messages.2.content", [{"type": "image", "url": "https://example.com/a.png"}]),
        ["content"],
    ),
    "block without type": (mutate("messages.1.content", [{"text": "x"}]), ["content"]),
    "text block without text": (mutate("messages.1.content", [{"type": "text"}]), ["text"]),
    "text block text is a number": (mutate("messages.1.content", [{"type": "text", "text": 1}]), ["text"]),
    "tool_use input is a list": (
        mutate("messages.2.content", [{"type": "tool_use", "toolCallId": "c1", "name": "lookup", "input": []}]),
        ["input"],
    ),
    "tool_use without toolCallId": (
        mutate("messages.2.content", [{"type": "tool_use", "name": "lookup", "input": {}}]),
        ["toolCallId"],
    ),
    "tool message without toolCallId": (mutate("messages.3.toolCallId", delete=True), ["toolCallId"]),
    "tool message toolCallId is a number": (mutate("messages.3.toolCallId", 1), ["toolCallId"]),
    "image url is not https or data": (
        mutate("messages.1.content", [{"type": "image", "url": "ftp://example.com/a.png"}]),
        ["url"],
    ),
    "image url is plain http": (
        mutate("messages.1.content", [{"type": "image", "url": "http://example.com/a.png"}]),
        ["url"],
    ),
}


def test_the_valid_body_of_the_rule_table_is_accepted(demo):
    """Every case below breaks exactly one thing of this body."""
    assert demo.post("/v1/sessions", VALID).status_code == 201


@pytest.mark.parametrize("case", list(CREATE_RULES))
def test_create_session_refuses(demo, db_access, case):
    from sessions_app.models import Session

    body, fragments = CREATE_RULES[case]
    before = Session.objects.filter(tenant__name="demo").count()
    assert_400(demo.post("/v1/sessions", body), *fragments)
    assert Session.objects.filter(tenant__name="demo").count() == before, "a refused request stores nothing"


IMAGE_HTTP = {"type": "image", "url": "https://example.com/cat.png"}
IMAGE_DATA = {"type": "image", "url": "data:image/png;base64,iVBORw0KGgo="}


@pytest.mark.parametrize("agent", ["echo-small", "echo-bare"])
@pytest.mark.parametrize("image", [IMAGE_HTTP, IMAGE_DATA], ids=["https", "data"])
def test_images_an_agent_does_not_accept_are_refused(demo, agent, image):
    for role, extra in (("user", {}), ("tool", {"toolCallId": "c1"})):
        messages = [{"role": role, "content": [{"type": "text", "text": "look"}, image], **extra}]
        label = "https://" if image is IMAGE_HTTP else "data:"
        assert_400(demo.post("/v1/sessions", {"agent": {"name": agent}, "messages": messages}), agent, label)


def test_images_an_agent_accepts_are_stored(demo):
    messages = [{"role": "user", "content": [IMAGE_HTTP, IMAGE_DATA]}]
    session = demo.create_session("echo", messages=messages)
    assert demo.history(session) == messages


# --- tenant isolation -------------------------------------------------------------------------


def test_another_tenants_session_does_not_exist_for_you(demo, other):
    session = demo.create_session("echo", messages=[{"role": "user", "content": "mine"}])
    missing = "sess_" + "A" * 32
    for session_id in (session, missing):
        assert_404(other.get(f"/v1/sessions/{session_id}"))
        assert_404(other.delete(f"/v1/sessions/{session_id}"))
        for kind in ("full", "compacted"):
            assert_404(other.get(f"/v1/sessions/{session_id}/history", params={"type": kind}))
        assert_404(other.post(f"/v1/sessions/{session_id}/turns", {"messages": [{"role": "user", "content": "hi"}]}))
        assert_404(other.get(f"/v1/sessions/{session_id}/turns/turn_x/events"))
        assert_404(other.post(f"/v1/sessions/{session_id}/turns/turn_x/cancel"))
    # The same answer as for a session that does not exist: no existence oracle.
    assert other.get(f"/v1/sessions/{session}").json()["error"].replace(session, "ID") == other.get(
        f"/v1/sessions/{missing}"
    ).json()["error"].replace(missing, "ID")
    listed = all_session_ids(other)
    assert session not in listed
    # The owner still has it, untouched.
    assert demo.get(f"/v1/sessions/{session}").status_code == 200
    assert demo.history(session) == [{"role": "user", "content": "mine"}]


def test_tokens_of_one_tenant_share_its_sessions(engine, demo, db_access):
    from tenancy.models import Tenant
    from tenancy.services import token_create

    _, raw = committed(lambda: token_create(tenant=Tenant.objects.get(name="demo"), name="second"))
    second = engine.client_with(raw)
    session = second.create_session("echo")
    assert demo.get(f"/v1/sessions/{session}").status_code == 200
    assert session in all_session_ids(demo, limit=100)
    second.close()


# --- listing with cursors -----------------------------------------------------------------------


def all_session_ids(client, limit: int = 100) -> list[str]:
    ids, after = [], None
    while True:
        params = {"limit": limit, **({"after": after} if after else {})}
        response = client.get("/v1/sessions", params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        ids += [s["sessionId"] for s in page["sessions"]]
        after = page.get("next")
        if after is None:
            return ids


@pytest.fixture
def fresh(engine, django_db_blocker):
    """A client of a tenant of its own, so a listing holds exactly what the test created."""
    from tenancy.services import tenant_create

    with django_db_blocker.unblock():
        _, raw = committed(lambda: tenant_create(name=f"t2-list-{uuid.uuid4().hex[:8]}"))
    client = engine.client_with(raw)
    yield client
    client.close()


def test_pages_are_newest_first_and_stable_while_sessions_are_added(fresh):
    assert fresh.get("/v1/sessions").json() == {"sessions": []}
    created = [fresh.create_session("echo") for _ in range(7)]
    newest_first = created[::-1]

    seen, pages, after = [], [], None
    added = []
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = fresh.get("/v1/sessions", params=params).json()
        pages.append([s["sessionId"] for s in page["sessions"]])
        seen += pages[-1]
        after = page.get("next")
        if after is None:
            break
        added.append(fresh.create_session("echo-small"))  # inserted between page fetches
    assert pages == [newest_first[0:3], newest_first[3:6], newest_first[6:7]]
    assert len(seen) == len(set(seen)) == 7
    assert "next" not in page
    # A new listing starts with what was added meanwhile, newest first.
    assert all_session_ids(fresh, limit=4) == added[::-1] + newest_first


def test_list_entries_are_session_infos(fresh):
    body = {
        "agent": {"name": "echo", "options": {"style": "upper"}, "tools": [{"name": "add"}]},
        "tools": [CLIENT_TOOL],
    }
    fresh.create_session("echo")  # an older one, after the first page
    session = fresh.post("/v1/sessions", body).json()["sessionId"]
    first = fresh.get("/v1/sessions", params={"limit": 1}).json()
    assert first["sessions"] == [fresh.get(f"/v1/sessions/{session}").json()]
    assert "next" in first


def test_a_page_that_ends_exactly_at_the_last_session_has_no_next(fresh):
    for _ in range(3):
        fresh.create_session("echo")
    total = len(all_session_ids(fresh))
    assert total == 3
    page = fresh.get("/v1/sessions", params={"limit": total}).json()
    assert len(page["sessions"]) == total and "next" not in page
    assert fresh.get("/v1/sessions", params={"limit": total - 1}).json().get("next")


@pytest.mark.parametrize("limit", ["1", "100"])
def test_limit_bounds_are_accepted(demo, limit):
    demo.create_session("echo")
    response = demo.get("/v1/sessions", params={"limit": limit})
    assert response.status_code == 200
    assert 1 <= len(response.json()["sessions"]) <= int(limit)


@pytest.mark.parametrize("limit", ["0", "101", "-1", "abc", "2.5", "1e2", "99999999999999999999999"])
def test_limit_outside_1_to_100_is_refused(demo, limit):
    assert_400(demo.get("/v1/sessions", params={"limit": limit}), "limit")


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor",
    [
        "garbage",
        "!!!",
        "czE6",
        _b64("s1:abc"),
        _b64("s2:5"),
        _b64("s1:-3"),
        _b64("5"),
        "A" * 5000,
        "\u00e9\u00e9",
    ],
)
def test_a_cursor_the_server_did_not_issue_is_refused(demo, cursor):
    assert_400(demo.get("/v1/sessions", params={"after": cursor}), "after")


# --- delete ---------------------------------------------------------------------------------------


def test_delete_removes_the_session_and_all_its_history(demo, db_access):
    from sessions_app.models import Message, Session, Turn

    session = demo.create_session(
        "echo", messages=[{"role": "user", "content": "seed"}, {"role": "assistant", "content": "ok"}]
    )
    assert demo.turn(session, text="hello").status == 200
    row = Session.objects.get(public_id=session)
    assert Message.objects.filter(session=row).count() > 0 and Turn.objects.filter(session=row).count() == 1

    response = demo.delete(f"/v1/sessions/{session}")
    assert response.status_code == 204 and response.content == b""
    assert_404(demo.get(f"/v1/sessions/{session}"))
    for kind in ("full", "compacted"):
        assert_404(demo.get(f"/v1/sessions/{session}/history", params={"type": kind}))
    assert_404(demo.post(f"/v1/sessions/{session}/turns", {"messages": [{"role": "user", "content": "again"}]}))
    assert_404(demo.delete(f"/v1/sessions/{session}"))
    assert session not in all_session_ids(demo)
    assert not Session.objects.filter(pk=row.pk).exists()
    assert Message.objects.filter(session_id=row.pk).count() == 0
    assert Turn.objects.filter(session_id=row.pk).count() == 0
