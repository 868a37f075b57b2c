"""A tenant that sends bodies near the size limit, one after another: each is refused with its
400, and the web process gives the memory back instead of keeping a copy of each body in
the heap of the view thread that read it (infra/webserver.py `return_large_blocks`)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .faults import history, new_sessions, request, rss

pytestmark = pytest.mark.timeout(300)

MESSAGES = 200_000  # about 7 MB, under AAP_MAX_BODY_BYTES: refused by its count
BODIES = 24


def _refused(chaos, session: str, body: bytes) -> None:
    outcome = request(
        chaos,
        "POST",
        f"/v1/sessions/{session}/turns",
        headers={"Content-Type": "application/json"},
        content=body,
    )
    assert outcome.status == 400, (outcome.status, outcome.raw[:300])
    assert b"at most" in outcome.raw and b"AAP_MAX_TURN_MESSAGES" in outcome.raw, outcome.raw[:300]


def test_bodies_near_the_limit_leave_the_web_process_its_size(chaos):
    chaos.ensure_up()
    session_id = new_sessions(chaos, 1)[0]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * MESSAGES}).encode()
    web = chaos.web.pid

    # Every view thread of the web process starts (a burst of small requests), as under load.
    with ThreadPoolExecutor(48) as pool:
        for _ in range(4):
            outcomes = list(pool.map(lambda _: request(chaos, "GET", "/v1/sessions"), range(48)))
            assert all(o.status == 200 for o in outcomes), {o.status for o in outcomes}
    _refused(chaos, session_id, body)  # what a refusal imports and caches, before measuring
    before = rss(web)

    # Two at a time: the bodies land on different view threads.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: _refused(chaos, session_id, body), range(BODIES)))
    time.sleep(1.0)
    after = rss(web)
    growth = after - before
    print(f"web process: {before / 2**20:.0f} MiB, {after / 2**20:.0f} MiB after {BODIES} bodies of 7 MB")
    # With glibc's rising threshold the process kept 150-330 MiB more: a few copies of a body
    # in the heap of each view thread a refusal ran on.
    assert growth < 96 * 2**20, f"the web process kept {growth / 2**20:.0f} MiB after {BODIES} refused bodies"

    # The service still answers, and the session took no turn.
    assert history(chaos, session_id) == []
