"""The same echo turn without HTTP and without the queue, in this process (scenario 2's reference).

    python -m bench.inproc host SECONDS      sessions_app.engine.host.execute(plan) on an in-memory event
                                             stream: the runtime plus the host's own work
                                             (publishing, stream-mode shaping, fold, lease, cancel check)
    python -m bench.inproc services SECONDS  turns.turn_start + worker.turn_execute against
                                             PostgreSQL and Redis (persistence included), queue bypassed

    python -m bench.inproc statements TURNS AGENT STREAM
                                             the SQL statements and transactions of a turn, web
                                             side and worker side: TURNS turns of AGENT, one after
                                             the other in one session, through the ASGI application
                                             Daphne serves and a Worker's slot thread, in this process

Prints one JSON object: turns, seconds, rate, latency percentiles (seconds), errors; or, for
`statements`, the counts per turn. Run by the bench as a subprocess with the stack's
environment (the `host` mode without REDIS_URL, so the event stream is the in-memory one;
`services` and `statements` with a turn queue of their own, AAP_TURN_QUEUE, so that only
they claim their turns; `statements` with the demo tenant's token in BENCH_TOKEN).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter

WARMUP_SECONDS = 0.3
# Turns run before statements are counted: caches filled, statements prepared.
WARMUP_TURNS = 5
# The threads of a Worker that run SQL (sessions_app.engine.worker); every
# other thread is the web side's (the ASGI application's, its views' thread pool).
WORKER_THREADS = ("aap-turn-", "aap-heartbeat", "aap-lease", "aap-worker-beat", "aap-sweep")


def _history(turns: int) -> list[dict]:
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"hello {i}"})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"echo: hello {i}"}]})
    return messages


def _timed(run_one, seconds: float) -> dict:
    from bench.load import percentiles

    latencies, errors, samples = [], 0, []
    start = time.perf_counter()
    begin, end = start + WARMUP_SECONDS, start + WARMUP_SECONDS + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            run_one()
        except Exception as exc:
            errors += 1
            if len(samples) < 3:
                samples.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        t1 = time.perf_counter()
        if t1 >= begin:
            latencies.append(t1 - t0)
    return {
        "turns": len(latencies),
        "seconds": seconds,
        "rate": len(latencies) / seconds,
        "latency": percentiles(latencies),
        "errors": errors,
        "errorSamples": samples,
    }


def run_host(seconds: float) -> dict:
    from agents.runtimes.echo import EchoRuntime
    from sessions_app.engine import events, host

    backend = events.backend()
    loop = asyncio.new_event_loop()
    history = _history(9)

    def one() -> None:
        turn_id = uuid.uuid4().hex
        incoming = [{"role": "user", "content": "hello world"}]
        plan = host.TurnPlan(
            turn_id=turn_id,
            session_id="bench",
            tenant="demo",
            agent_name="echo",
            runtime_kind="echo",
            config={"window": 20},
            options={"style": "plain", "signature": "", "apiKey": ""},
            server_tools={},
            client_tools={},
            history=history + incoming,
            incoming=incoming,
            permissions=[],
            stream="none",
            capabilities={},
            options_set=frozenset(),
        )
        outcome = loop.run_until_complete(host.execute(plan))
        if outcome.stop_reason != "end_turn":
            raise RuntimeError(f"stop reason {outcome.stop_reason}")
        # What store.publish_stop adds after persistence.
        backend.publish_sync(
            turn_id, outcome.last_seq + 1, {"event": "turn_stop", "stopReason": "end_turn"}, final=True
        )

    assert EchoRuntime.kind == "echo"
    try:
        return _timed(one, seconds)
    finally:
        loop.close()


def run_services(seconds: float) -> dict:
    from datetime import timedelta

    from django.conf import settings
    from django.utils import timezone

    from sessions_app.api.services import sessions, turns
    from sessions_app.engine import queue
    from sessions_app.engine.worker import Worker, turn_execute
    from tenancy.models import Tenant

    # A queue of its own: the stack's workers neither hear of these turns nor claim them; each
    # is claimed and run here, by a worker without slot threads.
    settings.AAP_TURN_QUEUE = "bench-in-process"
    worker = Worker("bench", 0, beats=False)
    worker.start()
    tenant = Tenant.objects.get(name="demo")
    session = sessions.session_create(tenant=tenant, agent_config={"name": "echo"}, messages=None, tools=None)

    def one() -> None:
        turns.turn_start(
            tenant=tenant,
            session_id=session.public_id,
            data={"messages": [{"role": "user", "content": "hello world"}], "stream": "none"},
        )
        turn_id, claimed = queue.claim_next("bench", 0, timezone.now() - timedelta(seconds=30))
        # As a slot thread runs it (Worker.run), with its failures raised: they are counted.
        turn_execute(turn_id, claimed, liveness=worker.liveness, running=worker.running, histories=worker.histories)

    return _timed(one, seconds)


class StatementCounter:
    """Counts the SQL of this process by side (web or worker, from the thread's name), through
    Django's connections: every statement (`execute_wrappers`, installed on each connection as
    it opens), and every transaction: a statement outside an atomic block commits alone, an
    atomic block that ran statements commits them together."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.on = False
        self._open: set[int] = set()  # connections inside an atomic block that ran a statement
        self._lock = threading.Lock()

    @staticmethod
    def side() -> str:
        return "worker" if threading.current_thread().name.startswith(WORKER_THREADS) else "web"

    def __call__(self, execute, sql, params, many, context):
        if self.on:
            wrapper = context["connection"]
            with self._lock:
                self.counts[self.side(), "statements"] += 1
                if wrapper.in_atomic_block:
                    self._open.add(id(wrapper))
                else:
                    self.counts[self.side(), "transactions"] += 1
        return execute(sql, params, many, context)

    def install(self) -> None:
        from django.db.backends.base.base import BaseDatabaseWrapper
        from django.db.backends.signals import connection_created

        def connected(sender, connection, **kwargs) -> None:
            if self not in connection.execute_wrappers:
                connection.execute_wrappers.append(self)

        connection_created.connect(connected, weak=False)
        commit = BaseDatabaseWrapper.commit

        def counted_commit(wrapper):
            with self._lock:
                if id(wrapper) in self._open:
                    self._open.discard(id(wrapper))
                    if self.on:
                        self.counts[self.side(), "transactions"] += 1
            return commit(wrapper)

        BaseDatabaseWrapper.commit = counted_commit

    def per_turn(self, turns: int) -> dict:
        return {
            side: {kind: self.counts[side, kind] / turns for kind in ("statements", "transactions")}
            for side in ("web", "worker")
        }


def run_statements(turns: int, agent: str, stream: str) -> dict:
    """TURNS turns of AGENT as the stack runs them: each request through the ASGI application
    (authentication, validation, turn_start, the stream hand-off), each turn claimed and run by
    a Worker's slot thread; the statements of both sides counted (StatementCounter). A
    worker's periodic statements (its heartbeat row, the sweep, looks on a timer) are not a
    turn's: this Worker makes none (`beats=False`; woken by each turn, as in the embedded mode)."""
    import httpx
    from django.db import transaction

    from hosting.asgi import application
    from sessions_app.engine import queue
    from sessions_app.engine.worker import Worker

    counter = StatementCounter()
    counter.install()
    worker = Worker(f"bench-statements-{os.getpid()}", 1, beats=False)
    # No listener: this process's Worker is woken at each turn's commit instead of by NOTIFY.
    queue.wake_after_commit = lambda node=None: transaction.on_commit(worker.wake)
    worker.start()
    worker.round()  # its heartbeat row, once: its slot counts in the capacity turns are admitted against
    body = {"messages": [{"role": "user", "content": "hello world"}], "stream": stream}
    errors: list[str] = []

    async def go() -> None:
        transport = httpx.ASGITransport(app=application, client=("127.0.0.1", 40000))
        headers = {"Authorization": f"Bearer {os.environ['BENCH_TOKEN']}"}
        base_url = "http://127.0.0.1"  # a host the stack's ALLOWED_HOSTS accepts
        async with httpx.AsyncClient(transport=transport, base_url=base_url, headers=headers, timeout=60) as http:
            created = await http.post("/v1/sessions", json={"agent": {"name": agent}})
            if created.status_code != 201:
                raise RuntimeError(f"POST /v1/sessions -> {created.status_code}: {created.text[:300]}")
            path = f"/v1/sessions/{created.json()['sessionId']}/turns"
            for index in range(WARMUP_TURNS + turns):
                counter.on = index >= WARMUP_TURNS
                response = await http.post(path, json=body)
                if response.status_code != 200 or "end_turn" not in response.text:
                    errors.append(f"turn {index}: {response.status_code} {response.text[-200:]}")
                while worker.liveness.tracked():  # its slot thread finishes after the stop is sent
                    await asyncio.sleep(0.001)
            counter.on = False

    started = time.perf_counter()
    asyncio.run(go())
    seconds = time.perf_counter() - started
    worker.stop()
    worker.drain(timeout=30)
    queue.worker_gone(worker.node)
    return {
        "turns": turns,
        "agent": agent,
        "stream": stream,
        "seconds": seconds,
        "perTurn": counter.per_turn(turns),
        "errors": len(errors),
        "errorSamples": errors[:3],
    }


def main() -> None:
    import django

    mode = sys.argv[1]
    django.setup()
    if mode == "statements":
        result = run_statements(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        seconds = float(sys.argv[2])
        result = run_host(seconds) if mode == "host" else run_services(seconds)
    print(json.dumps({"mode": mode, **result}))


if __name__ == "__main__":
    main()
