"""The same echo turn without HTTP and without the queue, in this process (scenario 2's reference).

    python -m bench.inproc host SECONDS      sessions_app.engine.host.execute(plan) on an in-memory event
                                             stream: the runtime plus the host's own work
                                             (publishing, stream-mode shaping, fold, lease, cancel check)
    python -m bench.inproc services SECONDS  turns.turn_start + execution.turn_execute against
                                             PostgreSQL and Redis (persistence included), queue bypassed

Prints one JSON object: turns, seconds, rate, latency percentiles (seconds), errors.
Run by the bench as a subprocess with the stack's environment (the `host` mode without
REDIS_URL, so the event stream is the in-memory one).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

WARMUP_SECONDS = 0.3


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
        # What endings.publish_stop adds after persistence.
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
    from sessions_app.engine import execution, schedule_store
    from tenancy.models import Tenant

    # A queue of its own: the stack's workers neither hear of these turns nor claim them; each
    # is claimed and run here.
    settings.AAP_TURN_QUEUE = "bench-in-process"
    tenant = Tenant.objects.get(name="demo")
    session = sessions.session_create(tenant=tenant, agent_config={"name": "echo"}, messages=None, tools=None)

    def one() -> None:
        turns.turn_start(
            tenant=tenant,
            session_id=session.public_id,
            data={"messages": [{"role": "user", "content": "hello world"}], "stream": "none"},
        )
        turn_id, claimed = schedule_store.claim_next("bench", 0, timezone.now() - timedelta(seconds=30))
        execution.turn_execute(turn_id, claimed)

    return _timed(one, seconds)


def main() -> None:
    import django

    mode, seconds = sys.argv[1], float(sys.argv[2])
    django.setup()
    result = run_host(seconds) if mode == "host" else run_services(seconds)
    print(json.dumps({"mode": mode, **result}))


if __name__ == "__main__":
    main()
