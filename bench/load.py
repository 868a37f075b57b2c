"""The load generator: an async AAP client over real HTTP (aiohttp, whose C parser keeps the
client's own CPU per event low: it shares the machine with the stack), a closed-loop driver,
percentiles, and a monitor of the generator's own event-loop lag (so a slow client is
seen, not mistaken for a slow server)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp


def percentiles(values: list[float]) -> dict:
    """p50/p95/p99 (and max) of a sample; empty dict when there is nothing to summarise."""
    if not values:
        return {}
    if len(values) == 1:
        only = values[0]
        return {"p50": only, "p95": only, "p99": only, "max": only, "n": 1}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "max": max(values), "n": len(values)}


class Errors:
    """Counts failures and keeps a few distinct messages to show."""

    def __init__(self):
        self.count = 0
        self.samples: list[str] = []

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.samples) < 5 and message not in self.samples:
            self.samples.append(message[:300])

    def merge(self, other: Errors) -> None:
        self.count += other.count
        for sample in other.samples:
            if len(self.samples) < 5 and sample not in self.samples:
                self.samples.append(sample)


class ApiError(Exception):
    pass


@dataclass
class Received:
    """One SSE event as the client got it: when (epoch seconds), its name and its data."""

    at: float
    event: str
    data: dict


def _frames(buffer: bytes) -> tuple[list[bytes], bytes]:
    parts = buffer.split(b"\n\n")
    return parts[:-1], parts[-1]


def _parse_frame(frame: bytes) -> tuple[str, dict] | None:
    name, data = "message", None
    for line in frame.decode().split("\n"):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
    if data is None:
        return None  # a `: ping` comment
    return name, json.loads(data)


class Api:
    """An application with one bearer token, over one pooled async HTTP client."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 120.0):
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout = aiohttp.ClientTimeout(total=timeout, connect=30.0)
        self._http: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:  # made in the running event loop, on first use
            self._http = aiohttp.ClientSession(
                base_url=self.base_url,
                headers=self.headers,
                timeout=self.timeout,
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def create_session(
        self, agent: str = "echo", *, messages: list[dict] | None = None, options: dict | None = None
    ) -> str:
        body: dict = {"agent": {"name": agent}}
        if options:
            body["agent"]["options"] = options
        if messages is not None:
            body["messages"] = messages
        async with self.http.post("/v1/sessions", json=body) as response:
            if response.status != 201:
                raise ApiError(f"POST /v1/sessions -> {response.status}: {(await response.text())[:200]}")
            return (await response.json())["sessionId"]

    async def turn(self, session_id: str, text: str) -> dict:
        """A `stream: "none"` turn; returns the JSON body (raises unless it ended with end_turn)."""
        async with self.http.post(
            f"/v1/sessions/{session_id}/turns", json={"messages": [{"role": "user", "content": text}]}
        ) as response:
            if response.status != 200:
                raise ApiError(f"turn -> {response.status}: {(await response.text())[:200]}")
            body = await response.json()
        if body.get("stopReason") != "end_turn":
            raise ApiError(f"turn stopped with {body.get('stopReason')!r}: {json.dumps(body.get('_meta'))[:200]}")
        return body

    async def stream_turn(
        self, session_id: str, text: str, *, on_event: Callable[[Received], None] | None = None, mode: str = "delta"
    ) -> tuple[float, list[Received]]:
        """A streamed turn; returns (time the request was sent, events with their arrival time)."""
        received: list[Received] = []
        body = {"messages": [{"role": "user", "content": text}], "stream": mode}
        sent = time.time()
        async with self.http.post(f"/v1/sessions/{session_id}/turns", json=body) as response:
            if response.status != 200:
                raise ApiError(f"turn -> {response.status}: {(await response.text())[:200]}")
            buffer = b""
            async for chunk in response.content.iter_any():
                at = time.time()
                frames, buffer = _frames(buffer + chunk)
                for frame in frames:
                    parsed = _parse_frame(frame)
                    if parsed is None:
                        continue
                    item = Received(at, *parsed)
                    received.append(item)
                    if on_event is not None:
                        on_event(item)
        if not received or received[-1].event != "turn_stop":
            raise ApiError(f"the stream ended without turn_stop (after {len(received)} events)")
        if received[-1].data.get("stopReason") != "end_turn":
            raise ApiError(f"turn stopped with {received[-1].data.get('stopReason')!r}")
        return sent, received


@dataclass
class LoopResult:
    latencies: list[float] = field(default_factory=list)  # seconds, of operations finished in the window
    values: list = field(default_factory=list)  # what those operations returned (when not None)
    completed: int = 0
    window: float = 0.0
    errors: Errors = field(default_factory=Errors)

    @property
    def rate(self) -> float:
        return self.completed / self.window if self.window else 0.0


async def closed_loop(
    concurrency: int,
    seconds: float,
    operation: Callable[[int, object], Awaitable[object]],
    *,
    setup: Callable[[int], Awaitable[object]] | None = None,
    warmup: float = 0.5,
) -> LoopResult:
    """`concurrency` virtual clients, each repeating `operation(index, state)` back to back.

    Operations that finish inside the measured window (after `warmup`) count; the rate is
    their number over the window, and what they return is kept. Each client's state comes
    from `setup(index)`, which is not timed.
    """
    result = LoopResult()
    states = await asyncio.gather(*(setup(i) for i in range(concurrency))) if setup else [None] * concurrency
    start = time.perf_counter()
    begin, end = start + warmup, start + warmup + seconds

    async def client(index: int) -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            try:
                value = await operation(index, states[index])
            except Exception as exc:  # counted, reported, never fatal
                if begin <= time.perf_counter() <= end:
                    result.errors.add(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.05)
                continue
            t1 = time.perf_counter()
            if begin <= t1 <= end:
                result.completed += 1
                result.latencies.append(t1 - t0)
                if value is not None:
                    result.values.append(value)

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    result.window = seconds
    return result


class LoopLag:
    """Samples how late this process's event loop wakes up (the load generator's own delay)."""

    def __init__(self, period: float = 0.01):
        self.period = period
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period)
            self.samples.append(max(0.0, time.perf_counter() - t0 - self.period))

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> dict:
        return {k: round(v * 1000, 2) for k, v in percentiles(self.samples).items() if k != "n"}
