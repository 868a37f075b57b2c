"""A live stream ends when the token that opened it is revoked, while its turn goes on (the
token's other checks are tests/turns/test_auth.py). On the real stack: the stream stays open
across Daphne and the worker while the token is revoked by another process."""

from __future__ import annotations

import threading
import time

import httpx

from ..support import parse_sse


def _stream_until_closed(base_url: str, token: str, path: str, body: dict, seen: list, done: threading.Event):
    try:
        with httpx.stream(
            "POST", base_url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as response:
            seen.append(response.status_code)
            for chunk in response.iter_raw():
                seen.append(chunk)
    except httpx.HTTPError as exc:
        seen.append(type(exc).__name__)
    finally:
        done.set()


def test_revoking_a_token_ends_the_streams_opened_with_it(pg_stack, demo):
    out = pg_stack.manage("create_token", "demo", "--name", "short-lived")
    token = out.strip().splitlines()[-1]
    prefix = out.split("Created token ", 1)[1].split(" ", 1)[0]
    client = pg_stack.client("demo")
    session = client.create_session("echo")
    seen: list = []
    done = threading.Event()
    body = {"stream": "delta", "messages": [{"role": "user", "content": "/slow 20 1000"}]}
    threading.Thread(
        target=_stream_until_closed,
        args=(pg_stack.base_url, token, f"/v1/sessions/{session}/turns", body, seen, done),
        daemon=True,
    ).start()
    deadline = time.monotonic() + 30
    while b"tick 2" not in b"".join(c for c in seen if isinstance(c, bytes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    pg_stack.manage("revoke_token", prefix)
    assert done.wait(20), "the stream of a revoked token was not closed"
    raw = b"".join(c for c in seen if isinstance(c, bytes))
    events, _ = parse_sse(raw)
    assert seen[0] == 200 and events[0].event == "turn_start"
    assert "turn_stop" not in [e.event for e in events], "closed before the turn ended"
    assert b"revoked" in raw
    # The turn itself goes on: a valid token re-attaches and sees it end.
    turn_id = events[0].data["_meta"]["turnId"]
    assert (
        httpx.get(pg_stack.base_url + "/v1/sessions", headers={"Authorization": f"Bearer {token}"}).status_code == 401
    )
    rest = client.reattach(session, turn_id, int(events[-1].id))
    assert rest.events[-1].event == "turn_stop" and rest.events[-1].data["stopReason"] == "end_turn"
    client.close()
