"""How long and how large each scenario runs: `quick` (make bench, about 6 minutes on 2 cores),
`full` (FULL=1) and `smoke` (--smoke: a second or two each, to check the harness itself)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    warmup: float = 0.5
    # 1: session create
    create_concurrency: tuple[int, ...] = (1, 8, 32)
    create_seconds: float = 3.0
    # 2: echo turns, stream none
    turn_concurrency: tuple[int, ...] = (1, 8, 32, 64)
    turn_seconds: float = 4.0
    inproc_seconds: float = 2.0
    statement_turns: int = 50  # 2 and 10: turns whose SQL statements are counted (bench/inproc.py)
    workers: int = 2
    # Threads per worker: each keeps a PostgreSQL connection, and the server may be shared.
    worker_concurrency: int = int(os.environ.get("BENCH_WORKER_CONCURRENCY", "6"))
    # 3: time to first byte
    ttfb_clients: int = 32
    ttfb_seconds: float = 4.0
    # 4: relay latency
    relay_clients: int = 8
    relay_seconds: float = 4.0
    relay_ticks: int = 20
    relay_tick_ms: int = 25
    # 5: open streams
    stream_steps: tuple[int, ...] = (250, 500, 1000)
    stream_tick_ms: int = 500
    stream_window: float = 5.0
    stream_budget: float = 60.0
    stream_open_parallel: int = 64
    # 6: history growth
    history_lengths: tuple[int, ...] = (10, 1000, 10000)
    history_turns: int = 30  # a p50 of 8 samples moved ±15 % between identical runs
    # 7: openai runtime against the fake server
    llm_turns: int = 5
    llm_tokens: int = 200
    llm_delay_ms: float = 5.0
    # 9–12: the openai runtime against the fake model shaped by model name (bench/llm.py)
    llm_session_turns: int = 200
    llm_concurrency: tuple[int, ...] = (1, 8, 32, 64)
    llm_burst_steps: tuple[int, ...] = (250, 1000)
    llm_held_steps: tuple[int, ...] = (250,)
    # 8: fair share between tenants (each half: B alone, then B beside a saturating A)
    fair_seconds: float = 5.0
    # 13: a turn of 200,000 tiny messages refused by count
    oversize_requests: int = 20


QUICK = Profile("quick")

FULL = replace(
    QUICK,
    name="full",
    warmup=1.0,
    create_seconds=10.0,
    turn_seconds=15.0,
    inproc_seconds=8.0,
    ttfb_seconds=15.0,
    relay_clients=16,
    relay_seconds=15.0,
    stream_steps=(250, 500, 1000, 2000, 3000, 4000, 5000),
    stream_window=15.0,
    stream_budget=600.0,
    history_turns=30,
    llm_turns=20,
    fair_seconds=15.0,
    llm_session_turns=1000,
    llm_burst_steps=(250, 500, 1000),
    llm_held_steps=(250, 500, 1000),
    oversize_requests=50,
)

SMOKE = replace(
    QUICK,
    name="smoke",
    warmup=0.2,
    create_concurrency=(1, 8),
    create_seconds=1.0,
    turn_concurrency=(1, 8),
    turn_seconds=1.0,
    inproc_seconds=0.5,
    statement_turns=5,
    ttfb_clients=8,
    ttfb_seconds=1.0,
    relay_clients=2,
    relay_seconds=1.0,
    relay_ticks=5,
    relay_tick_ms=20,
    stream_steps=(20, 50),
    stream_window=2.0,
    stream_budget=30.0,
    history_lengths=(10, 100, 1000),
    history_turns=2,
    llm_turns=2,
    fair_seconds=1.0,
    llm_session_turns=20,
    llm_concurrency=(1, 8),
    llm_burst_steps=(20,),
    llm_held_steps=(20,),
    oversize_requests=3,
)

PROFILES = {p.name: p for p in (QUICK, FULL, SMOKE)}
