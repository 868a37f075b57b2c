"""Scenarios 9–12: the `openai` runtime at scale, against the fake model shaped by model name
(tests/fakes/openai_server.py `--by-model`: `tokens-N-delay-M` streams N tokens M ms apart,
each token's text the time it was sent, so every token's lateness is measured end to end).

 9  turn latency by turn index over one long session (200 turns quick, 1,000 FULL)
10  short LLM turns (`delta`, 5 tokens, no delay) at c = 1/8/32/64, with the first text delta
    after the model sent its first token
11  K concurrent `delta` turns at 10 tokens/s: started together, and held all open
12  a conversation: create a session, a turn that calls a trusted tool, an answer turn

Each reports the CPU per operation of every process of the stack (bench/cpu.py).

Longer than ~400 lines on purpose: four scenarios that share one fixture (the fake model,
the sessions, the CPU readings) read best side by side, one method each.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import tempfile
import time

from .cpu import CpuMeter, describe
from .load import ApiError, Errors, LoopLag, closed_loop, percentiles
from .report import Row
from .scenarios import latency_row

MS = 1000.0
AGENT = "bench-llm-shaped"
SHORT = "tokens-5-delay-0"


def stamps(text: str) -> list[float]:
    """The send times the fake model wrote as token text."""
    values = []
    for word in text.split():
        try:
            values.append(float(word))
        except ValueError:
            continue
    return values


class LlmScenarios:
    def __init__(self, bench):
        self.bench = bench
        self.p = bench.p
        self.cpu = CpuMeter(bench.stack)
        self.ready = False

    @property
    def api(self):
        return self.bench.api

    def add(self, row: Row) -> Row:
        return self.bench.add(row)

    def setup(self) -> None:
        """Start the shaped fake model and register the agent that talks to it (once)."""
        if self.ready:
            return
        url = self.bench.stack.start_fake_openai(5, 0, by_model=True)
        agents = {
            "agents": [
                {
                    "name": AGENT,
                    "title": "openai runtime against the fake model shaped by model name",
                    "version": "1.0.0",
                    "runtime": {"kind": "openai", "config": {}},
                    "options": [
                        {"type": "text", "name": "model", "default": SHORT},
                        {"type": "secret", "name": "apiKey", "default": "sk-bench-fake-key"},
                        {"type": "text", "name": "baseUrl", "default": url},
                    ],
                    "tools": [
                        {"name": "add", "title": "Add", "description": "Returns a + b.", "implementation": "add"}
                    ],
                    "capabilities": {
                        "history": {"compacted": {}, "full": {}},
                        "stream": {"delta": {}, "message": {}, "none": {}},
                    },
                }
            ]
        }
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump(agents, handle)
        try:
            self.bench.stack.manage("apply_agents", handle.name)
        finally:
            os.unlink(handle.name)
        self.ready = True

    async def session(self, model: str = SHORT, *, tools: list[dict] | None = None) -> str:
        body: dict = {"agent": {"name": AGENT, "options": {"model": model}}}
        if tools:
            body["agent"]["tools"] = tools
        async with self.api.http.post("/v1/sessions", json=body) as response:
            if response.status != 201:
                raise ApiError(f"POST /v1/sessions -> {response.status}: {(await response.text())[:200]}")
            return (await response.json())["sessionId"]

    async def sessions(self, count: int, model: str) -> list[str]:
        made: list[str] = []
        gate = asyncio.Semaphore(16)

        async def one():
            async with gate:
                for _attempt in range(3):
                    try:
                        made.append(await self.session(model))
                        return
                    except Exception:
                        await asyncio.sleep(0.2)

        await asyncio.gather(*(one() for _ in range(count)))
        return made

    async def warm(self) -> None:
        """Each worker imports the runtime on its first turn: not part of any figure."""
        sids = await self.sessions(2 * self.p.workers, SHORT)
        await asyncio.gather(*(self.api.stream_turn(sid, "hello") for sid in sids), return_exceptions=True)

    # --- 9 -------------------------------------------------------------------------------------

    async def session_length(self) -> None:
        self.setup()
        await self.warm()
        n, errors = self.p.llm_session_turns, Errors()
        block = max(10, n // 10)
        sid = await self.session()
        times: list[float] = []
        costs = {}
        for index in range(n):
            if index in (0, n - block):
                before = self.cpu.snapshot()
            took = await self._timed_turn(sid, f"question {index}: hello world", errors, f"turn {index + 1}")
            if took is None:
                continue
            times.append(took)
            if index in (block - 1, n - 1):
                costs[index] = self.cpu.per_operation(before, self.cpu.snapshot(), block)
        first, last = times[1 : block + 1], times[-block:]
        self.bench.details["llm_session_length_ms"] = [round(t * MS, 2) for t in times]
        self.add(
            Row(
                "9",
                f"LLM session: turns 2–{block + 1} (stream none, 5 tokens)",
                "ms",
                **_stats(first),
                errors=errors.count,
                error_samples=errors.samples,
                note=describe(costs.get(block - 1, {})) + f" (turns 1–{block})",
            )
        )
        self.add(
            Row(
                "9",
                f"LLM session: turns {n - block + 1}–{n}",
                "ms",
                **_stats(last),
                note=describe(costs.get(n - 1, {})),
            )
        )
        if first and last:
            ratio = percentiles(last)["p50"] / percentiles(first)["p50"]
            self.add(
                Row(
                    "9",
                    f"LLM session: p50 of the last {block} turns ÷ p50 of turns 2–{block + 1}",
                    "x",
                    value=ratio,
                    target="≤ 1.2",
                    met=ratio <= 1.2,
                    note=f"{n} turns in one session (FULL: 1,000); minutes apart, so the machine's drift is in it",
                )
            )
        await self._paired(sid, n, block)

    async def _timed_turn(self, sid: str, text: str, errors: Errors, what: str) -> float | None:
        """Seconds one `stream: "none"` turn took; None (and the error counted) if it failed."""
        t0 = time.perf_counter()
        try:
            await self.api.turn(sid, text)
        except Exception as exc:
            errors.add(f"{what}: {type(exc).__name__}: {exc}")
            return None
        return time.perf_counter() - t0

    async def _paired(self, long_sid: str, n: int, block: int) -> None:
        """The long session's next turns against turns 2–11 of new sessions, in alternating
        groups of 10 within the same seconds: what the session's length costs, without the
        drift of a shared machine between the first and the last turns above."""
        group, errors = 10, Errors()
        times: dict[str, list[float]] = {"long": [], "short": []}
        spent: dict[str, dict[str, float]] = {"long": {}, "short": {}}
        turn_of_long = n
        for _ in range(max(1, block // group)):
            short_sid = await self.session()
            await self.api.turn(short_sid, "question 1: hello world")  # its first turn here: not measured
            for kind in ("long", "short"):
                before = self.cpu.snapshot()
                for index in range(group):
                    if kind == "long":
                        turn_of_long += 1
                    sid, number = (long_sid, turn_of_long) if kind == "long" else (short_sid, index + 2)
                    took = await self._timed_turn(sid, f"question {number}: hello world", errors, f"paired {kind} turn")
                    if took is not None:
                        times[kind].append(took)
                cost = self.cpu.per_operation(before, self.cpu.snapshot(), group)
                for key, value in cost.items():
                    spent[kind][key] = spent[kind].get(key, 0.0) + value / max(1, block // group)
        long_stats, short_stats = percentiles(times["long"]), percentiles(times["short"])
        if not long_stats or not short_stats:
            return
        ratio = long_stats["p50"] / short_stats["p50"]
        self.add(
            Row(
                "9",
                f"LLM session, paired: turns after the {n}th ÷ turns 2–11 of new sessions, same seconds",
                "x",
                value=ratio,
                n=len(times["long"]),
                errors=errors.count,
                error_samples=errors.samples,
                target="≤ 1.2",
                met=ratio <= 1.2,
                note=f"p50 {long_stats['p50'] * MS:.1f} vs {short_stats['p50'] * MS:.1f} ms; long: "
                f"{describe(spent['long'])}; short: {describe(spent['short'])}",
            )
        )

    # --- 10 ------------------------------------------------------------------------------------

    async def short_turns(self) -> None:
        self.setup()
        await self.warm()
        await self.bench.statements("10", AGENT, "delta", "short LLM turn (delta, 5 tokens)")
        for c in self.p.llm_concurrency:
            name = f"short LLM turns (delta, 5 tokens), c={c}"
            why = await self.bench.too_big(c)
            if why:
                self.add(Row("10", name, "ms", skipped=why))
                continue
            done = 0

            async def turn(i, sid):
                nonlocal done
                _, events = await self.api.stream_turn(sid, "hello world")
                done += 1
                first = next((e for e in events if e.event == "text_delta"), None)
                sent = stamps(first.data.get("delta", "")) if first else []
                return first.at - sent[0] if sent else None

            sids = await asyncio.gather(*(self.session() for _ in range(c)))
            before = self.cpu.snapshot()
            result = await closed_loop(
                c, self.p.turn_seconds, turn, setup=lambda i, sids=sids: _value(sids[i]), warmup=self.p.warmup
            )
            cost = self.cpu.per_operation(before, self.cpu.snapshot(), done)
            self.bench.details.setdefault("llm_short_cpu_ms", {})[c] = cost
            self.add(
                latency_row(
                    "10",
                    name + ": request → turn_stop",
                    result.latencies,
                    errors=result.errors,
                    rate=result.rate,
                    target="≥ 300 turns/s" if c == 32 else "",
                    met=(result.rate >= 300) if c == 32 else None,
                    note="rate in turns/s; " + describe(cost),
                )
            )
            if c == 32 and cost:
                self.add(
                    Row(
                        "10",
                        "CPU per short LLM turn, all service processes, c=32",
                        "ms",
                        value=cost["service"],
                        target="≤ 6 ms",
                        met=cost["service"] <= 6,
                        note=describe(cost),
                    )
                )
            if c == 1:
                stats = percentiles(result.values)
                self.add(
                    latency_row(
                        "10",
                        "first text delta received − the model's send time of its first token, c=1",
                        result.values,
                        errors=Errors(),
                        target="p50 ≤ 5 ms",
                        met=(stats["p50"] * MS <= 5) if stats else None,
                    )
                )

    # --- 11 ------------------------------------------------------------------------------------

    async def concurrent_streams(self) -> None:
        self.setup()
        largest = max(max(self.p.llm_burst_steps, default=0), max(self.p.llm_held_steps, default=0))
        # A turn holds a worker thread for its whole life (a waiting turn holds no DB connection).
        self.bench.stack.start_workers(self.p.workers, math.ceil(largest / self.p.workers) + 4)
        await self.warm()
        for k in self.p.llm_burst_steps:
            if time.monotonic() + 30 + k / 50 > self.bench.deadline:
                self.add(Row("11", f"K={k} started together", "", skipped="time budget"))
                continue
            await self._burst(k)
        for k in self.p.llm_held_steps:
            if time.monotonic() + 40 + k / 25 > self.bench.deadline:
                self.add(Row("11", f"K={k} held all open", "", skipped="time budget"))
                continue
            await self._held(k)

    async def _run_streams(self, sids: list[str], gate: asyncio.Semaphore | None):
        """One delta turn per session; returns per stream (sent, first delta at, [(stamp, at)])."""
        out: list[tuple[float, float | None, list[tuple[float, float]]]] = [(0.0, None, [])] * len(sids)
        errors = Errors()

        async def one(i: int) -> None:
            released = gate is None
            if gate is not None:
                await gate.acquire()
            tokens: list[tuple[float, float]] = []
            first: list[float] = []

            def on_event(ev):
                nonlocal released
                if ev.event == "turn_start" and not released:
                    released = True
                    gate.release()
                elif ev.event == "text_delta":
                    if not first:
                        first.append(ev.at)
                    tokens.extend((sent, ev.at) for sent in stamps(ev.data.get("delta", "")))

            try:
                sent, _ = await self.api.stream_turn(sids[i], "hello", on_event=on_event)
                out[i] = (sent, first[0] if first else None, tokens)
            except Exception as exc:
                errors.add(f"{type(exc).__name__}: {exc}")
            finally:
                if not released:
                    gate.release()

        gc.disable()  # the client's own collections must not stall its loop and count as lateness
        try:
            with LoopLag() as lag:
                await asyncio.gather(*(one(i) for i in range(len(sids))))
        finally:
            gc.enable()
            gc.collect()
        return out, errors, lag.summary()

    async def _burst(self, k: int) -> None:
        tokens, tick = 50, 100
        sids = await self.sessions(k, f"tokens-{tokens}-delay-{tick}")
        before = self.cpu.snapshot()
        out, errors, lag = await self._run_streams(sids, None)
        cost = self.cpu.per_operation(before, self.cpu.snapshot(), k)
        first = [f - s for s, f, _ in out if f is not None]
        late = [at - sent for _, _, ts in out for sent, at in ts]
        short = sum(1 for _, _, ts in out if len(ts) != tokens)
        if short:
            errors.add(f"{short} stream(s) did not deliver all {tokens} tokens")
        target = k == 1000
        fs, ls = percentiles(first), percentiles(late)
        self.add(
            latency_row(
                "11",
                f"K={k} delta turns started together ({tokens} tokens × {tick} ms): first text delta",
                first,
                errors=errors,
                target="p99 ≤ 1 s" if target else "",
                met=(fs["p99"] <= 1.0 and not errors.count) if target and fs else None,
                note=f"{describe(cost)} per turn; client loop lag p99 {lag.get('p99', 0)} ms",
            )
        )
        self.add(
            latency_row(
                "11",
                f"K={k} started together: token lateness (received − model's send time)",
                late,
                errors=Errors(),
                target="p99 ≤ 100 ms" if target else "",
                met=(ls["p99"] <= 0.1) if target and ls else None,
            )
        )

    async def _held(self, k: int) -> None:
        tick = 0.1
        ramp = k / 40  # streams open 64 at a time; a turn start costs the stack tens of ms of CPU
        window = self.p.stream_window
        tokens = math.ceil((ramp + 1.0 + window + 1.0) / tick)
        sids = await self.sessions(k, f"tokens-{tokens}-delay-{int(tick * 1000)}")
        out, errors, lag = await self._run_streams(sids, asyncio.Semaphore(self.p.stream_open_parallel))
        starts = [s for s, f, _ in out if f is not None]
        opened = max((f for _, f, _ in out if f is not None), default=0.0)
        begin, end = opened + 1.0, opened + 1.0 + window
        late = [at - sent for _, _, ts in out for sent, at in ts if begin <= sent <= end]
        judged = sum(1 for _, _, ts in out if any(begin <= sent <= end for sent, _ in ts))
        if judged < k:
            errors.add(f"only {judged} of {k} streams sent tokens inside the window (they were not all open)")
        stats = percentiles(late)
        target = "p99 ≤ 20 ms" if k == 250 else ""
        self.add(
            latency_row(
                "11",
                f"K={k} delta turns held all open (10 tokens/s): token lateness in a {window:g} s window",
                late,
                errors=errors,
                target=target,
                met=(stats["p99"] <= 0.02 and not errors.count) if target and stats else None,
                note=f"all open {opened - min(starts, default=opened):.1f} s after the first; client loop lag p99 "
                f"{lag.get('p99', 0)} ms",
            )
        )

    # --- 12 ------------------------------------------------------------------------------------

    async def conversation(self) -> None:
        self.setup()
        await self.warm()
        c = 8
        why = await self.bench.too_big(c)
        name = f"conversation: create + trusted-tool turn + answer turn, c={c}"
        if why:
            self.add(Row("12", name, "ms", skipped=why))
            return
        done = 0

        async def conversation(i, state):
            nonlocal done
            sid = await self.session("tool-add", tools=[{"name": "add", "trust": True}])
            first = await self.api.turn(sid, "please add 2 and 3")
            said = json.dumps(first.get("messages"))
            if '"5"' not in said or '"tool"' not in said:
                raise ApiError(f"the tool turn did not run the tool: {said[:200]}")
            await self.api.turn(sid, "thanks")
            done += 1

        before = self.cpu.snapshot()
        result = await closed_loop(c, self.p.turn_seconds, conversation, warmup=self.p.warmup)
        cost = self.cpu.per_operation(before, self.cpu.snapshot(), done)
        self.add(
            latency_row(
                "12",
                name,
                result.latencies,
                errors=result.errors,
                rate=result.rate,
                target="≥ 116/s (the reference server's)",
                met=result.rate >= 116 if result.latencies else None,
                note="rate in conversations/s; " + describe(cost) + " per conversation",
            )
        )


async def _value(value):
    return value


def _stats(seconds: list[float]) -> dict:
    stats = percentiles(seconds)
    if not stats:
        return {}
    return {
        "p50": stats["p50"] * MS,
        "p95": stats["p95"] * MS,
        "p99": stats["p99"] * MS,
        "max": stats["max"] * MS,
        "n": stats["n"],
    }
