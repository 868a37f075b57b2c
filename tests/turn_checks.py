"""What the turn tests share: checks of one turn against the history it produced, and a
streaming request read on a thread so a test can act while the turn runs."""

from __future__ import annotations

import itertools
import json
import threading
import time
from datetime import UTC, datetime, timedelta

import httpx

from .support import AAP, Event, Stack, TurnResult, fold_events, parse_sse

MODES = ("none", "delta", "message")
CLIENT_TOOL = {
    "name": "mytool",
    "description": "An application tool the test answers itself.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
}


def new_session(
    client: AAP,
    agent: str = "echo",
    *,
    options: dict | None = None,
    server_tools: list[dict] | None = None,
    tools: list[dict] | None = None,
) -> str:
    """Create a session with agent options, enabled server tools and client tools."""
    config: dict = {}
    if options is not None:
        config["options"] = options
    if server_tools is not None:
        config["tools"] = server_tools
    body = {"tools": tools} if tools is not None else {}
    return client.create_session(agent, agent=config, **body)


def text_reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def checked_turn(
    client: AAP, session: str, messages: list[dict], *, stream: str = "none", stored: list[dict] | None = None, **body
) -> TurnResult:
    """Run one turn and check the wire contract every turn keeps.

    SSE: an increasing `id:` on every event, `turn_start` first (its `_meta.turnId` is the
    `AAP-Turn-Id` header), `turn_stop` last. All modes: what `full` history gained is the
    stored incoming messages followed by exactly the turn's messages (the fold of its events).
    `stored` is the part of `messages` that lands in history (default: all of it).
    """
    before = client.history(session)
    result = client.turn(session, messages, stream=stream, **body)
    assert result.status == 200, result.body
    turn_id = result.turn_id
    assert turn_id.startswith("turn_")
    if stream == "none":
        assert result.body["_meta"]["turnId"] == turn_id
    else:
        assert_sse_shape(result.events, turn_id)
    after = client.history(session)
    assert after[: len(before)] == before, "a turn must never rewrite earlier full history"
    incoming = messages if stored is None else stored
    assert after[len(before) :] == incoming + result.messages
    return result


def assert_sse_shape(events: list[Event], turn_id: str | None = None, *, first_id: int = 1) -> None:
    ids = [int(event.id) for event in events]
    assert ids == list(range(first_id, first_id + len(events))), f"ids not consecutive: {ids}"
    if first_id == 1:
        assert events[0].event == "turn_start", [e.event for e in events]
        if turn_id is not None:
            assert events[0].data["_meta"]["turnId"] == turn_id
        assert "turn_start" not in [e.event for e in events[1:]]
    assert events[-1].event == "turn_stop", [e.event for e in events]
    assert "turn_stop" not in [e.event for e in events[:-1]]


def same_turn_in_every_mode(client: AAP, session: str, messages: list[dict], **body) -> dict[str, TurnResult]:
    """Run the same turn once per stream mode on one session; the three must fold alike."""
    results = {mode: checked_turn(client, session, messages, stream=mode, **body) for mode in MODES}
    none, delta, message = results["none"], results["delta"], results["message"]
    assert fold_events([e.as_dict() for e in delta.events]) == fold_events([e.as_dict() for e in message.events])
    assert delta.messages == message.messages == none.messages
    assert delta.stop_reason == message.stop_reason == none.stop_reason
    return results


def deltas(result: TurnResult, kind: str = "text") -> list[str]:
    return [e.data["delta"] for e in result.events if e.event == f"{kind}_delta"]


def assert_deltas(result: TurnResult, pieces: list[str], kind: str = "text") -> None:
    """The stream's deltas are `pieces`, one each; on a loaded machine the worker may join
    consecutive ones (its backpressure, sessions_app.engine.host._Publisher), never split, drop or
    reorder them."""
    got = deltas(result, kind)
    assert "".join(got) == "".join(pieces), (got, pieces)
    edges = set(itertools.accumulate(len(piece) for piece in pieces))
    assert set(itertools.accumulate(len(delta) for delta in got)) <= edges, (got, pieces)


def user(text) -> list[dict]:
    return [{"role": "user", "content": text}]


def numbered_calls(messages: list[dict]) -> list[dict]:
    """Messages with every toolCallId replaced by its order of appearance (ids are fresh per turn)."""
    names: dict[str, str] = {}

    def rename(call_id):
        return names.setdefault(call_id, f"call#{len(names)}")

    out = []
    for message in messages:
        message = dict(message)
        if "toolCallId" in message:
            message["toolCallId"] = rename(message["toolCallId"])
        if isinstance(message.get("content"), list):
            message["content"] = [
                {**b, "toolCallId": rename(b["toolCallId"])} if "toolCallId" in b else b for b in message["content"]
            ]
        out.append(message)
    return out


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.2, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


class LiveTurn:
    """A streaming request (a turn, or a re-attach) read on its own thread and connection."""

    def __init__(
        self,
        stack: Stack,
        method: str,
        path: str,
        *,
        tenant: str = "demo",
        json: dict | None = None,
        headers: dict | None = None,
    ):
        self.http = httpx.Client(
            base_url=stack.base_url, headers={"Authorization": f"Bearer {stack.tokens[tenant]}"}, timeout=60.0
        )
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.raw = b""
        self.error: BaseException | None = None
        self._changed = threading.Condition()
        self._close = threading.Event()
        self.finished = threading.Event()
        self.finished_at: float | None = None  # time.time() when the response ended
        self._thread = threading.Thread(target=self._read, args=(method, path, json, headers), daemon=True)
        self._thread.start()

    @classmethod
    def turn(cls, stack: Stack, session: str, text: str, *, stream: str = "delta", tenant: str = "demo") -> LiveTurn:
        body = {"messages": user(text), "stream": stream}
        return cls(stack, "POST", f"/v1/sessions/{session}/turns", tenant=tenant, json=body)

    def _read(self, method, path, json, headers):
        try:
            with self.http.stream(method, path, json=json, headers=headers) as response:
                with self._changed:
                    self.status, self.headers = response.status_code, response.headers
                    self._changed.notify_all()
                for chunk in response.iter_bytes():
                    with self._changed:
                        self.raw += chunk
                        self._changed.notify_all()
                    if self._close.is_set():
                        break  # leaving the block drops the connection mid-stream
        except BaseException as exc:  # surfaced by the waits below
            self.error = exc
        finally:
            self.http.close()
            with self._changed:
                self.finished_at = time.time()
                self.finished.set()
                self._changed.notify_all()

    @property
    def events(self) -> list[Event]:
        complete = self.raw[: self.raw.rfind(b"\n\n") + 2] if b"\n\n" in self.raw else b""
        return parse_sse(complete)[0]

    @property
    def turn_id(self) -> str:
        return self.headers["AAP-Turn-Id"]

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "events"):
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                if self.status is not None and predicate(self):
                    return self
                if self.finished.is_set():
                    raise AssertionError(f"stream ended before {what}: error={self.error!r} raw={self.raw[-2000:]!r}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout}s waiting for {what}; raw={self.raw[-2000:]!r}")
                self._changed.wait(remaining)

    def wait_events(self, count: int, timeout: float = 60.0) -> LiveTurn:
        return self.wait_for(lambda live: len(live.events) >= count, timeout, f"{count} events")

    def wait_end(self, timeout: float = 90.0) -> LiveTurn:
        if not self.finished.wait(timeout):
            raise AssertionError(f"stream did not end within {timeout}s; raw={self.raw[-2000:]!r}")
        if self.error is not None:
            raise AssertionError(f"stream failed: {self.error!r}")
        return self

    def close(self, timeout: float = 60.0) -> None:
        """Disconnect like a client that goes away (takes effect on the next chunk)."""
        self._close.set()
        self.finished.wait(timeout)

    def result(self) -> TurnResult:
        events, pings = parse_sse(self.raw)
        return TurnResult(self.status, self.headers, events=events, pings=pings, raw=self.raw)


def tool_command(name: str, arguments: dict) -> list[dict]:
    return user(f"/tool {name} {json.dumps(arguments)}")


def tools_command(*calls: tuple[str, dict]) -> list[dict]:
    return user("/tools " + json.dumps([{"name": name, "input": arguments} for name, arguments in calls]))


def tool_answer(call_id: str, content) -> dict:
    return {"role": "tool", "toolCallId": call_id, "content": content}


def permission(call_id: str, granted: bool, reason: str | None = None) -> dict:
    answer = {"role": "tool_permission", "toolCallId": call_id, "granted": granted}
    if reason is not None:
        answer["reason"] = reason
    return answer


def tool_use_message(*calls: tuple[str, str, dict]) -> dict:
    return {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "toolCallId": call_id, "name": name, "input": arguments}
            for call_id, name, arguments in calls
        ],
    }


def assert_iso_utc_now(value: str) -> None:
    moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    assert moment.utcoffset() == timedelta(0), value
    assert abs(datetime.now(UTC) - moment) < timedelta(minutes=10), value
