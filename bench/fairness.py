"""Scenario 8, fair share: tenant B's time to first content alone, then while tenant A keeps
four times the workers' threads of turns coming (honouring 429 + Retry-After).

A may run on all but HEADROOM of the worker threads (its running-turns limit, which the
dispatcher enforces) and keep twice the threads waiting beyond; every slot that frees goes
to the tenant with the fewest turns in flight (sessions_app.engine.queue), so B's turn finds a
free thread instead of a place behind A's backlog. Target: B's p50 and p99 under load at
most twice its unloaded values."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections import Counter

from .load import Api, closed_loop, percentiles
from .report import Row

MS = 1000.0
NOISY, QUIET = "bench-noisy", "bench-quiet"
NOISY_TURN = "/slow 10 100"  # about 1 s on a worker thread
BACKLOG = 2  # turns the noisy tenant keeps waiting per worker thread
HEADROOM = 4  # worker threads the noisy tenant may never take (its running-turns limit)


async def fair_share(bench) -> None:
    from .scenarios import latency_row

    p = bench.p
    slots = p.workers * p.worker_concurrency
    noisy_running = max(1, slots - HEADROOM)
    why = await bench.too_big(noisy_running + 2)
    if why:
        bench.add(Row("8", "fair share: B's first content with A saturating", "ms", skipped=why))
        return
    tokens = {name: bench.stack.manage("create_tenant", name).strip().splitlines()[-1] for name in (NOISY, QUIET)}
    limits = {
        "tenants": [
            {
                "name": NOISY,
                "limits": {"maxRunningTurns": noisy_running, "maxQueuedTurns": BACKLOG * slots, "turnsPerMinute": 0},
            },
            {"name": QUIET, "limits": {"maxRunningTurns": 0, "turnsPerMinute": 0}},
        ]
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(limits, handle)
        handle.flush()
        bench.stack.manage("apply_agents", handle.name)
    noisy, quiet = Api(bench.stack.base_url, tokens[NOISY]), Api(bench.stack.base_url, tokens[QUIET])

    async def first_content(i, session):
        sent, events = await quiet.stream_turn(session, "hello world")
        return next(e.at - sent for e in events if e.event == "text_delta")

    try:
        alone = await closed_loop(
            1, p.fair_seconds, first_content, setup=lambda i: quiet.create_session(), warmup=p.warmup
        )
        outcomes: Counter = Counter()
        stop = asyncio.Event()

        async def saturate(i: int) -> None:
            session = await noisy.create_session()
            body = {"messages": [{"role": "user", "content": NOISY_TURN}]}
            while not stop.is_set():
                async with noisy.http.post(f"/v1/sessions/{session}/turns", json=body) as response:
                    if response.status == 429:
                        outcomes["429"] += 1
                        await asyncio.sleep(min(float(response.headers.get("Retry-After", "1")), 2.0))
                        continue
                    outcomes[
                        (await response.json()).get("stopReason") if response.status == 200 else str(response.status)
                    ] += 1

        clients = [asyncio.create_task(saturate(i)) for i in range(4 * slots)]
        await asyncio.sleep(2.0)  # A fills every thread and its backlog
        loaded = await closed_loop(
            1, p.fair_seconds, first_content, setup=lambda i: quiet.create_session(), warmup=p.warmup
        )
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    finally:
        await noisy.close()
        await quiet.close()

    base, under = percentiles(alone.values), percentiles(loaded.values)
    bench.add(latency_row("8", "fair share: B's time to first content, alone", alone.values, errors=alone.errors))
    met = bool(base and under) and under["p50"] <= 2 * base["p50"] and under["p99"] <= 2 * base["p99"]
    bench.add(
        latency_row(
            "8",
            f"fair share: B's time to first content, A saturating ({4 * slots} clients, {slots} threads)",
            loaded.values,
            errors=loaded.errors,
            target="p50, p99 ≤ 2× alone",
            met=met if base and under else None,
        )
    )
    refused, failed = outcomes["429"], sum(n for k, n in outcomes.items() if k not in ("429", "end_turn"))
    bench.add(
        Row(
            "8",
            f"fair share: A's turns ({noisy_running} running + {BACKLOG * slots} waiting at most)",
            "turns",
            value=outcomes["end_turn"],
            errors=failed,
            error_samples=[k for k in outcomes if k not in ("429", "end_turn")],
            note=f"{outcomes['end_turn']} ended end_turn, {refused} refused with 429, {failed} failed",
        )
    )
