"""What the fault tests share: turns run on threads with a bound on silence, the outcome of a
turn as its client finally sees it, and direct reads of the chaos stack's database."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg

from ..support import AAP, fold_events, parse_sse

# Pings come every second on this stack: a response silent this long is hanging.
SILENCE_SECONDS = 15.0


def ticks(n: int) -> list[dict]:
    """What `/slow N MS` produces: one text block of N ticks."""
    return [
        {"role": "assistant", "content": [{"type": "text", "text": "".join(f"tick {i} " for i in range(1, n + 1))}]}
    ]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def client(stack, **kw) -> AAP:
    aap = AAP(stack.base_url, stack.tokens["demo"])
    aap.http.timeout = httpx.Timeout(SILENCE_SECONDS, connect=5.0)
    return aap


class Outcome:
    """One request's response as its client saw it; `error` is the transport failure, if any."""

    def __init__(self):
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.raw = b""
        self.error: BaseException | None = None
        self.done = threading.Event()

    @property
    def turn_id(self) -> str:
        return self.headers["AAP-Turn-Id"]

    @property
    def events(self):
        return parse_sse(self.raw)[0]

    @property
    def body(self) -> dict | None:
        try:
            return json.loads(self.raw)
        except ValueError:
            return None

    def stop(self) -> dict | None:
        """The turn_stop (SSE) or the JSON body's ending, if the response carried one."""
        if self.headers is not None and self.headers.get("content-type", "").startswith("text/event-stream"):
            stops = [e for e in self.events if e.event == "turn_stop"]
            return stops[-1].data if stops else None
        body = self.body
        return body if body and "stopReason" in body else None


def request(stack, method: str, path: str, *, json_body=None, headers=None, content: bytes | None = None) -> Outcome:
    """Send a request (`json_body`, or the bytes `content`) and read its whole response, on the
    calling thread."""
    outcome = Outcome()
    aap = client(stack)
    try:
        with aap.http.stream(method, path, json=json_body, content=content, headers=headers) as response:
            outcome.status, outcome.headers = response.status_code, response.headers
            for chunk in response.iter_bytes():
                outcome.raw += chunk
    except BaseException as exc:
        outcome.error = exc
    finally:
        aap.close()
        outcome.done.set()
    return outcome


def post_turn(stack, session: str, text: str, *, stream: str = "none", key: str | None = None) -> Outcome:
    headers = {"Idempotency-Key": key} if key else None
    return request(
        stack,
        "POST",
        f"/v1/sessions/{session}/turns",
        json_body={"messages": user(text), "stream": stream},
        headers=headers,
    )


def in_background(pool: ThreadPoolExecutor, function, *args, **kw):
    return pool.submit(function, *args, **kw)


def final_stop(stack, session: str, turn_id: str, timeout: float = 90.0) -> dict:
    """Re-attach to a turn (as a client whose stream closed does) until its turn_stop."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = request(stack, "GET", f"/v1/sessions/{session}/turns/{turn_id}/events")
        if last.status == 200 and last.error is None:
            stops = [e for e in last.events if e.event == "turn_stop"]
            if stops:
                return stops[-1].data
        elif last.status == 204:
            raise AssertionError("204 for a reader that has no event of the turn")
        assert last.status in (None, 200, 503), (last.status, last.raw[-500:])
        time.sleep(1.0)
    raise AssertionError(f"no turn_stop for {turn_id} within {timeout}s (last: {last.status} {last.raw[-300:]!r})")


def history(stack, session: str, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        outcome = request(stack, "GET", f"/v1/sessions/{session}/history?type=full")
        if outcome.status == 200:
            return json.loads(outcome.raw)["history"]["full"]
        assert outcome.status in (None, 503), (outcome.status, outcome.raw)
        if time.monotonic() > deadline:
            raise AssertionError(f"history of {session} unreadable: {outcome.status} {outcome.error!r}")
        time.sleep(0.5)


def new_sessions(stack, count: int) -> list[str]:
    aap = client(stack)
    try:
        return [aap.create_session("echo") for _ in range(count)]
    finally:
        aap.close()


def next_turn_works(stack, session: str, text: str, timeout: float = 60.0) -> Outcome:
    """The session takes a new turn again (409 only while its last turn still runs)."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = post_turn(stack, session, text)
        if outcome.status == 200 and outcome.error is None:
            return outcome
        assert outcome.status in (409, 503, None), (outcome.status, outcome.raw[-500:])
        if time.monotonic() > deadline:
            raise AssertionError(f"session {session} takes no turn: {outcome.status} {outcome.raw[-300:]!r}")
        time.sleep(1.0)


def no_server_errors(outcomes: list[Outcome]) -> None:
    bad = [(o.status, o.raw[-300:]) for o in outcomes if o.status is not None and o.status >= 500 and o.status != 503]
    assert not bad, f"server errors: {bad}"
    for outcome in outcomes:
        if outcome.status == 503:
            assert outcome.headers.get("Retry-After"), "a 503 says when to retry"
            assert json.loads(outcome.raw)["error"]


def new_key() -> str:
    return str(uuid.uuid4())


def folded(outcome: Outcome) -> list[dict]:
    if outcome.stop() is not None and outcome.body is not None:
        return outcome.body["messages"]
    return fold_events([e.as_dict() for e in outcome.events])


class Database:
    """Reads of the chaos stack's PostgreSQL, as an operator's psql would."""

    def __init__(self, url: str):
        self.url = url.replace("postgres://", "postgresql://", 1)

    def turn_statuses(self, turn_ids: list[str]) -> dict[str, tuple[str, str]]:
        from psycopg.rows import dict_row

        with psycopg.connect(self.url, connect_timeout=5, row_factory=dict_row) as conn:
            rows = conn.execute("SELECT * FROM sessions_app_turn WHERE id = ANY(%s)", [turn_ids]).fetchall()
        # `partial`: the output checkpoint (absent from schemas before durable turns)
        return {row["id"]: (row["status"], row.get("partial", "-")) for row in rows}


def rss(pid: int) -> int:
    """A process's resident memory, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
