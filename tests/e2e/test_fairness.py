"""No tenant takes the service from the others: a tenant saturating the workers gets 429s
for its excess (never errors) while another tenant's short turns take the next free slot,
not a place behind the backlog; a turn waiting for a worker says so; and one huge turn
neither holds the worker's shared loop nor fills Redis."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from ..support import fold_events, parse_sse
from ..turn_checks import LiveTurn, text_reply, user
from .test_limits import limited_tenant

A_TURN = "/slow 15 200"  # about 3 s on a worker thread
WORKER_THREADS = 16  # the stack's worker (tests/support.py)
# B's wait may pass A's longest single turn by this share of it (dispatch, HTTP, a busy
# machine); waiting behind A's backlog (two turns of A per slot) would take twice as long.
MARGIN_SHARE = 0.25


def timed_turn(stack, tenant: str, session: str, text: str) -> dict:
    """One streamed turn: its status, stop reason, time to first content and duration, its
    raw body."""
    http = httpx.Client(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {stack.tokens[tenant]}"}, timeout=120
    )
    started = time.monotonic()
    first = None
    raw = b""
    try:
        with http.stream(
            "POST", f"/v1/sessions/{session}/turns", json={"messages": user(text), "stream": "delta"}
        ) as response:
            if response.status_code != 200:
                return {"status": response.status_code, "body": response.read()}
            for chunk in response.iter_bytes():
                raw += chunk
                if first is None and b"event: text_delta" in raw:
                    first = time.monotonic() - started
    finally:
        http.close()
    events, _ = parse_sse(raw)
    return {
        "status": 200,
        "stop": events[-1].data.get("stopReason"),
        "error": events[-1].data.get("_meta", {}).get("error"),
        "first": first,
        "duration": time.monotonic() - started,
        "events": events,
        "raw": raw,
    }


def noisy_neighbour(stack, tmp_path, slots: int) -> None:
    """Tenant A keeps every one of the workers' `slots` threads busy and twice as many turns
    waiting; tenant B's short turns must each wait no longer than A's longest single turn (plus
    a margin), never behind A's backlog; A's excess gets 429s, nothing fails. Run here on one
    worker and by the chaos suite on two."""
    a_name, a_client = limited_tenant(
        stack, tmp_path, maxRunningTurns=slots, maxQueuedTurns=2 * slots, turnsPerMinute=0
    )
    b_name, b_client = limited_tenant(stack, tmp_path)
    a_sessions = [a_client.create_session("echo") for _ in range(4 * slots)]
    b_session = b_client.create_session("echo")
    stop = threading.Event()
    a_results: list[dict] = []

    def saturate(session):
        while not stop.is_set():
            result = timed_turn(stack, a_name, session, A_TURN)
            a_results.append(result)
            if result["status"] == 429:
                time.sleep(0.5)

    with ThreadPoolExecutor(len(a_sessions)) as pool:
        for session in a_sessions:
            pool.submit(saturate, session)
        try:
            time.sleep(5)  # A has filled its places: every slot running, twice as many waiting
            b_results = [timed_turn(stack, b_name, b_session, f"short {i}") for i in range(8)]
        finally:
            stop.set()
    a_client.close()
    b_client.close()

    accepted = [r for r in a_results if r["status"] == 200]
    refused = [r for r in a_results if r["status"] == 429]
    assert refused, "A's excess must be refused at the door"
    assert {r["status"] for r in a_results} == {200, 429}, [r for r in a_results if r["status"] not in (200, 429)]
    assert all(r["stop"] == "end_turn" for r in accepted), [r for r in accepted if r["stop"] != "end_turn"][:3]
    longest_a = max(r["duration"] - r["first"] for r in accepted)  # one turn, from its start to its end
    assert all(r["status"] == 200 and r["stop"] == "end_turn" for r in b_results), b_results
    waits = [r["first"] for r in b_results]
    assert max(waits) <= longest_a * (1 + MARGIN_SHARE), (waits, longest_a)
    # A really queued: some of its turns waited for a slot, and said so.
    assert any(r["events"][0].data["_meta"].get("queued") for r in accepted)


def test_a_saturating_tenant_gets_429s_while_another_tenants_short_turns_take_the_next_free_slot(pg_stack, tmp_path):
    noisy_neighbour(pg_stack, tmp_path, WORKER_THREADS)


def test_a_turn_waiting_for_a_worker_says_so_until_it_starts(pg_stack, demo, other):
    # Every thread of the worker busy for about 8 s.
    busy = [demo.create_session("echo") for _ in range(WORKER_THREADS)]
    with ThreadPoolExecutor(WORKER_THREADS) as pool:
        running = [pool.submit(timed_turn, pg_stack, "demo", session, "/slow 40 200") for session in busy]
        time.sleep(2)
        waiting = timed_turn(pg_stack, "other", other.create_session("echo"), "after the queue")
        assert all(f.result()["stop"] == "end_turn" for f in running)

    assert waiting["stop"] == "end_turn"
    start = waiting["events"][0]
    assert start.event == "turn_start" and start.data["_meta"]["queued"] == {"position": 1}
    raw = waiting["raw"]
    first_content = raw.index(b"event: text_delta")
    heartbeats = [line for line in raw[:first_content].split(b"\n") if line.startswith(b": queued ")]
    assert heartbeats, raw[:first_content]  # it waited about 6 s: at least one heartbeat (every 5 s)
    assert all(json.loads(line[len(b": queued ") :]) == {"position": 1} for line in heartbeats)
    assert b": queued" not in raw[first_content:]  # once it runs, waiting is over
    assert fold_events([e.as_dict() for e in waiting["events"]]) == text_reply("echo: after the queue")


def test_the_embedded_mode_queues_turns_beyond_its_threads_and_runs_them_all(embedded_stack):
    client = embedded_stack.client("demo")
    try:
        sessions = [client.create_session("echo") for _ in range(12)]
    finally:
        client.close()
    with ThreadPoolExecutor(12) as pool:  # more turns than the web process's 8 threads
        results = list(pool.map(lambda s: timed_turn(embedded_stack, "demo", s, "/slow 10 100"), sessions))
    assert [r["stop"] for r in results] == ["end_turn"] * 12, results
    assert any(r["events"][0].data["_meta"].get("queued") for r in results)


def test_a_one_mib_turn_of_words_neither_stalls_another_tenants_turn_nor_fills_redis(pg_stack, demo, other):
    text = "a " * 524288  # 1 MiB of one-word deltas
    big_session = demo.create_session("echo")
    big = LiveTurn.turn(pg_stack, big_session, text, stream="delta")
    big.wait_events(3)
    small_session = other.create_session("echo")
    small = other.turn(small_session, text="/slow 20 50", stream="delta")
    big.wait_end(timeout=180)

    # The other tenant's turn ran on the same worker at its own pace, to its end.
    assert small.stop_reason == "end_turn"
    assert small.messages == text_reply("".join(f"tick {i} " for i in range(1, 21)))
    emitted = [e.data["_meta"]["emittedAt"] for e in small.events if e.event == "text_delta"]
    gaps = [b - a for a, b in itertools.pairwise(emitted)]
    assert max(gaps) < 1.0, gaps  # 50 ms apart; the shared loop was never held for long
    assert emitted[0] < big.finished_at, "the other turn must have run while the big one was still streaming"

    # The big turn is whole, in its stream and in history, and its Redis stream stays small.
    result = big.result()
    assert result.stop_reason == "end_turn"
    assert result.messages == text_reply("echo: " + text)
    assert fold_events([e.as_dict() for e in result.events]) == demo.history(big_session)[1:]
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        entries = client.xlen(f"aap:ev:{big.turn_id}")
        footprint = client.memory_usage(f"aap:ev:{big.turn_id}")
    finally:
        client.close()
    assert len(result.events) == entries
    assert entries <= 5000, entries  # 524,290 entries (32 MB) when every word was one
    assert footprint < 4 * 1024 * 1024, footprint
