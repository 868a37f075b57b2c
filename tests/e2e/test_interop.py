"""Real AAP clients, unmodified: the headers the official TypeScript client sends, a browser's
EventSource and a cross-origin page in headless Chromium, a UI that submits every `/meta`
default, and a JSON client that wants the turn id before the answer."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import AAP, Stack, fold_events, parse_sse, serve_pages

from ..turn_checks import assert_sse_shape, text_reply, user
from .test_llm_agent import OPERATOR_KEY, llm_agent

# What @agentapplicationprotocol/client sends: JSON bodies, `Accept: text/event-stream` on
# streamed turns, and `Bearer ${apiKey}` even when the key is empty.
TS_HEADERS = {"Content-Type": "application/json"}
ACCEPTS = ["text/event-stream", "application/json", "text/event-stream, application/json", "*/*", None]


def _headers(token: str | None, accept: str | None) -> dict:
    headers = dict(TS_HEADERS)
    if token is not None:
        # fetch() trims header values, so an empty key goes out as "Bearer" (see raw_get for "Bearer ").
        headers["Authorization"] = f"Bearer {token}".strip()
    if accept is not None:
        headers["Accept"] = accept
    return headers


def _post_turn(stack: Stack, session: str, token: str | None, accept: str | None, stream: str, text: str = "hello"):
    body = {"stream": stream, "messages": user(text)}
    return httpx.post(
        f"{stack.base_url}/v1/sessions/{session}/turns", json=body, headers=_headers(token, accept), timeout=60
    )


# --- content negotiation -------------------------------------------------------------------


@pytest.mark.parametrize("accept", ACCEPTS, ids=lambda a: a or "no-accept")
@pytest.mark.parametrize("stream", ["delta", "message"])
def test_streamed_turn_answers_sse_whatever_accept_says(stack, client, accept, stream):
    session = client.create_session("echo")
    response = _post_turn(stack, session, stack.tokens["demo"], accept, stream)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events, _ = parse_sse(response.content)
    assert_sse_shape(events, response.headers["AAP-Turn-Id"])
    assert fold_events([e.as_dict() for e in events]) == text_reply("echo: hello")


@pytest.mark.parametrize("accept", ACCEPTS, ids=lambda a: a or "no-accept")
def test_json_turn_answers_json_whatever_accept_says(stack, client, accept):
    session = client.create_session("echo")
    response = _post_turn(stack, session, stack.tokens["demo"], accept, "none")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["messages"] == text_reply("echo: hello")
    assert client.history(session) == user("hello") + text_reply("echo: hello")


@pytest.mark.parametrize("accept", ACCEPTS, ids=lambda a: a or "no-accept")
def test_bad_token_and_unknown_session_come_before_negotiation(stack, client, accept):
    session = client.create_session("echo")
    for token in ("not-a-token", None, ""):
        refused = _post_turn(stack, session, token, accept, "delta")
        assert refused.status_code == 401, (token, refused.text)
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        assert refused.json()["error"]
    missing = _post_turn(stack, "sess_doesnotexist", stack.tokens["demo"], accept, "delta")
    assert missing.status_code == 404, missing.text
    assert "sess_doesnotexist" in missing.json()["error"]
    assert client.history(session) == [], "a refused turn stores nothing"


@pytest.mark.parametrize("accept", ACCEPTS, ids=lambda a: a or "no-accept")
def test_reattach_answers_sse_whatever_accept_says(stack, client, accept):
    session = client.create_session("echo")
    original = client.turn(session, text="again", stream="delta")
    path = f"{stack.base_url}/v1/sessions/{session}/turns/{original.turn_id}/events"
    replay = httpx.get(path, headers={**_headers(stack.tokens["demo"], accept), "Last-Event-ID": "1"}, timeout=60)
    assert replay.status_code == 200, replay.text
    assert replay.headers["content-type"].startswith("text/event-stream")
    events, _ = parse_sse(replay.content)
    assert [e.as_dict() for e in events] == [e.as_dict() for e in original.events[1:]]

    assert httpx.get(path, headers=_headers("not-a-token", accept), timeout=30).status_code == 401
    assert httpx.get(path, headers=_headers("", accept), timeout=30).status_code == 401
    gone = httpx.get(
        path.replace(original.turn_id, "turn_nope"), headers=_headers(stack.tokens["demo"], accept), timeout=30
    )
    assert gone.status_code == 404 and gone.json()["error"]


# --- empty bearer ------------------------------------------------------------------------------


def raw_get(stack: Stack, path: str, authorization: bytes) -> tuple[int, dict, bytes]:
    """GET with an Authorization value sent byte for byte (HTTP libraries trim or refuse
    trailing whitespace, but a hand-built header or another client may send it)."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as sock:
        sock.sendall(
            b"GET "
            + path.encode()
            + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
            + authorization
            + b"\r\nConnection: close\r\n\r\n"
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        decoded, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            decoded, rest = decoded + rest[: int(size, 16)], rest[int(size, 16) + 2 :]
        body = decoded
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("authorization", [b"Bearer ", b"Bearer", b"Bearer   "])
def test_empty_bearer_is_no_token(stack, authorization):
    anonymous = httpx.get(f"{stack.base_url}/v1/meta", timeout=30)
    status, _, body = raw_get(stack, "/v1/meta", authorization)
    assert anonymous.status_code == status == 200
    assert json.loads(body) == anonymous.json()
    for path in ("/v1/sessions", "/v1/sessions/sess_x", "/v1/sessions/sess_x/history?type=full"):
        status, headers, body = raw_get(stack, path, authorization)
        assert status == 401, (path, body)
        assert json.loads(body) == {"error": "An API token is required: send 'Authorization: Bearer <api token>'."}
        assert headers["www-authenticate"].startswith("Bearer")


# --- option defaults round-trip -------------------------------------------------------------------


def _meta_defaults(client: AAP, agent: str) -> dict:
    [info] = [a for a in client.meta()["agents"] if a["name"] == agent]
    return {option["name"]: option["default"] for option in info.get("options", [])}


@pytest.mark.parametrize("agent", ["echo", "echo-small"])
def test_a_session_created_with_every_meta_default_is_one_created_with_none(stack, client, agent):
    defaults = _meta_defaults(client, agent)
    assert defaults, f"{agent} declares options"
    plain = client.create_session(agent)
    prefilled = client.create_session(agent, agent={"options": defaults})
    for session in (plain, prefilled):
        info = client.get(f"/v1/sessions/{session}").json()
        assert info["agent"].get("options", {}) == {}, info
    # The agent sees the same values: echo's /whoami prints the effective options.
    said = [client.turn(s, text="/whoami").messages for s in (plain, prefilled)]
    assert said[0] == said[1]
    # On a turn, the advertised defaults and "***" change nothing either.
    again = client.turn(prefilled, text="/whoami", agent={"options": defaults})
    assert again.messages == said[0]


def test_sending_the_default_on_a_turn_returns_an_option_to_its_default(stack, client):
    session = client.create_session("echo", agent={"options": {"style": "upper"}})
    assert client.turn(session, text="hi").messages == text_reply("echo: HI")
    defaults = _meta_defaults(client, "echo")
    result = client.turn(session, text="hi", agent={"options": {"style": defaults["style"]}})
    assert result.messages == text_reply("echo: hi")
    assert client.get(f"/v1/sessions/{session}").json()["agent"].get("options", {}) == {}


@pytest.fixture(scope="module")
def fake_model(pg_stack, tmp_path_factory):
    server = FakeOpenAI().start()
    path = tmp_path_factory.mktemp("interop-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [llm_agent("llm-interop", server.url)]}))
    pg_stack.manage("apply_agents", str(path))
    yield server
    server.stop()


def test_base_url_equal_to_the_default_still_sends_the_operators_key(fake_model, demo):
    defaults = _meta_defaults(demo, "llm-interop")
    assert defaults["apiKey"] == "***" and defaults["baseUrl"] == fake_model.url
    for options in ({}, defaults, {"baseUrl": defaults["baseUrl"]}):
        fake_model.clear()
        fake_model.enqueue(FakeOpenAI.text("Hello from the model."))
        session = demo.create_session("llm-interop", agent={"options": options} if options else None)
        result = demo.turn(session, text="hi")
        assert result.stop_reason == "end_turn", (options, result.body)
        assert result.messages == text_reply("Hello from the model.")
        [request] = fake_model.chat_requests()
        assert request["headers"]["authorization"] == f"Bearer {OPERATOR_KEY}", options


def test_a_different_base_url_never_receives_the_operators_key(fake_model, demo):
    other_model = FakeOpenAI().start()
    try:
        other_model.enqueue(FakeOpenAI.text("Elsewhere."))
        session = demo.create_session("llm-interop", agent={"options": {"baseUrl": other_model.url}})
        demo.turn(session, text="hi")
        assert all(OPERATOR_KEY not in json.dumps(r["headers"]) for r in other_model.requests)
    finally:
        other_model.stop()


# --- what the application sent comes back as sent --------------------------------------------------


def test_client_tools_keep_their_key_order(stack, client):
    tool = {
        "name": "zeta_lookup",
        "title": "Zeta",
        "description": "Keys in an order no sorting would give.",
        "parameters": {
            "type": "object",
            "required": ["zz", "a"],
            "properties": {"zz": {"type": "string", "description": "last letter first"}, "a": {"type": "integer"}},
            "additionalProperties": False,
        },
    }
    session = client.create_session("echo", tools=[tool])
    raw = client.get(f"/v1/sessions/{session}").text
    sent = json.dumps(tool, separators=(",", ":"))
    echoed = json.dumps(json.loads(raw, object_pairs_hook=lambda pairs: dict(pairs))["tools"][0], separators=(",", ":"))
    assert echoed == sent
    # The same after a turn replaces the client tools.
    reordered = {**tool, "parameters": {"properties": tool["parameters"]["properties"], "type": "object"}}
    client.turn(session, text="hi", tools=[reordered])
    info = json.loads(client.get(f"/v1/sessions/{session}").text)
    assert json.dumps(info["tools"][0], separators=(",", ":")) == json.dumps(reordered, separators=(",", ":"))


# --- the turn id at once -----------------------------------------------------------------------------


def test_json_turn_sends_its_head_at_once_so_the_client_can_cancel(cors_web):
    # cors_web pings once a minute: a head that waited for the first body byte would come
    # after this 20 s turn had ended, too late to cancel it.
    stack, client = cors_web, cors_web.client()
    session = client.create_session("echo")
    url = f"{stack.base_url}/v1/sessions/{session}/turns"
    body = {"messages": user("/slow 40 500")}  # 20 s of output, stream "none"
    with httpx.stream(
        "POST",
        url,
        json=body,
        headers=_headers(stack.tokens["demo"], "application/json"),
        timeout=httpx.Timeout(60, read=60),
    ) as response:
        # The head arrives before any byte of the body: the turn is still running.
        turn_id = response.headers["AAP-Turn-Id"]
        assert turn_id.startswith("turn_")
        cancel = client.post(f"/v1/sessions/{session}/turns/{turn_id}/cancel")
        assert cancel.status_code == 202 and cancel.json()["cancelling"] is True
        result = json.loads(response.read())
    assert result["stopReason"] == "end_turn"
    assert result["_meta"]["cancelled"] is True
    client.close()


# --- a real browser -------------------------------------------------------------------------------

PAGE = """<!doctype html><meta charset="utf-8"><title>AAP interop</title>
<script>
function parseSSE(text) {
  return text.split("\\n\\n").filter(b => b.trim() && !b.startsWith(":")).map(block => {
    const e = {};
    for (const line of block.split("\\n")) {
      const i = line.indexOf(":");
      const k = line.slice(0, i), v = line.slice(i + 1).replace(/^ /, "");
      if (k === "data") e.data = JSON.parse(v); else if (k) e[k] = v;
    }
    return e;
  });
}
async function streamedTurn(api, token, sessionId, text) {
  const res = await fetch(`${api}/v1/sessions/${sessionId}/turns`, {
    method: "POST",
    headers: {"Authorization": `Bearer ${token}`, "Content-Type": "application/json", "Accept": "text/event-stream"},
    body: JSON.stringify({stream: "delta", messages: [{role: "user", content: text}]}),
  });
  return {status: res.status, turnId: res.headers.get("AAP-Turn-Id"),
          ticket: res.headers.get("AAP-Events-Ticket"), events: parseSSE(await res.text())};
}
function reattach(api, sessionId, turnId, ticket) {
  return new Promise((resolve, reject) => {
    const url = `${api}/v1/sessions/${sessionId}/turns/${turnId}/events?ticket=${encodeURIComponent(ticket)}`;
    const source = new EventSource(url);
    const events = [];
    const names = ["turn_start", "text_delta", "text", "thinking_delta", "thinking", "tool_call", "tool_result", "turn_stop"];
    for (const name of names) {
      source.addEventListener(name, (m) => {
        events.push({event: name, id: m.lastEventId, data: JSON.parse(m.data)});
        if (name === "turn_stop") { source.close(); resolve(events); }
      });
    }
    source.onerror = () => { if (source.readyState === EventSource.CLOSED) reject(new Error("EventSource closed")); };
  });
}
</script>"""


@pytest.fixture(scope="module")
def page_origin():
    # "localhost" and "127.0.0.1" are different origins: the API below is cross-origin.
    with serve_pages(
        {}, default=(PAGE.encode(), {"Content-Type": "text/html; charset=utf-8"}), host="localhost"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def cors_web(pg_stack, page_origin, log_dir):
    """A second Daphne of the production stack that allows the page's origin. Its keep-alives
    are a minute apart, so nothing but the head itself can reach a client early."""
    web = Stack("cors", {**pg_stack.env, "CORS_ALLOWED_ORIGINS": page_origin, "AAP_SSE_PING_SECONDS": "60"}, log_dir)
    web.tokens = dict(pg_stack.tokens)
    try:
        web.start_web()
        yield web
    finally:
        web.stop()


def in_page(chromium, origin: str, script: str, arg):
    """Evaluate `script` with `arg` in a fresh page loaded from `origin` (on the browser's thread)."""

    def run(browser):
        context = browser.new_context()
        try:
            tab = context.new_page()
            tab.goto(origin + "/")
            return tab.evaluate(script, arg)
        finally:
            context.close()

    return chromium.call(run)


@pytest.fixture
def page(chromium, page_origin):
    return lambda script, arg: in_page(chromium, page_origin, script, arg)


def test_browser_streams_a_turn_from_another_origin(cors_web, page):
    client = cors_web.client()
    session = client.create_session("echo")
    result = page(
        "([api, token, sid]) => streamedTurn(api, token, sid, 'hello from chromium')",
        [cors_web.base_url, cors_web.tokens["demo"], session],
    )
    assert result["status"] == 200
    assert result["turnId"].startswith("turn_") and result["ticket"]
    events = [{"event": e["event"], **e["data"]} for e in result["events"]]
    assert events[0]["event"] == "turn_start" and events[-1]["event"] == "turn_stop"
    assert fold_events(events) == text_reply("echo: hello from chromium")
    assert client.history(session) == user("hello from chromium") + text_reply("echo: hello from chromium")
    client.close()


def test_browser_eventsource_reattaches_with_the_events_ticket(cors_web, page):
    client = cors_web.client()
    session = client.create_session("echo")
    started = page(
        "([api, token, sid]) => streamedTurn(api, token, sid, '/slow 3 100')",
        [cors_web.base_url, cors_web.tokens["demo"], session],
    )
    replay = page(
        "([api, sid, tid, ticket]) => reattach(api, sid, tid, ticket)",
        [cors_web.base_url, session, started["turnId"], started["ticket"]],
    )
    assert [e["event"] for e in replay] == [e["event"] for e in started["events"]]
    assert [int(e["id"]) for e in replay] == list(range(1, len(replay) + 1))
    assert [e["data"] for e in replay] == [e["data"] for e in started["events"]]
    client.close()


def test_events_ticket_reads_only_its_own_turn(cors_web):
    client = cors_web.client()
    session = client.create_session("echo")
    first = client.turn(session, text="one", stream="delta")
    second = client.turn(session, text="two", stream="delta")
    ticket = first.headers["AAP-Events-Ticket"]
    base = f"{cors_web.base_url}/v1/sessions/{session}/turns"
    own = httpx.get(f"{base}/{first.turn_id}/events", params={"ticket": ticket}, timeout=30)
    assert own.status_code == 200
    assert [e.as_dict() for e in parse_sse(own.content)[0]] == [e.as_dict() for e in first.events]
    assert httpx.get(f"{base}/{second.turn_id}/events", params={"ticket": ticket}, timeout=30).status_code == 404
    assert (
        httpx.get(f"{cors_web.base_url}/v1/sessions/{session}", params={"ticket": ticket}, timeout=30).status_code
        == 401
    )
    forged = httpx.get(f"{base}/{first.turn_id}/events", params={"ticket": ticket[:-2] + "xx"}, timeout=30)
    assert forged.status_code == 401 and forged.json()["error"]
    client.close()


def test_cors_preflight_allows_the_configured_origin_only(cors_web, page_origin):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,accept,idempotency-key",
    }
    url = f"{cors_web.base_url}/v1/sessions/sess_x/turns"
    allowed = httpx.options(url, headers={**preflight, "Origin": page_origin}, timeout=30)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == page_origin
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = httpx.options(url, headers={**preflight, "Origin": "http://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in refused.headers
