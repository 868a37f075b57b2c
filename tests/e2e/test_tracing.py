"""OpenTelemetry: with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an in-process collector, one
turn is one trace from the web request through the queue and the worker to the model call."""

from __future__ import annotations

import time

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.otlp_collector import OtlpCollector
from tests.support import llm_agent, side_redis_db

from .observed import observed_stack

pytestmark = pytest.mark.e2e

SECRET = "sk-traced-operator-key-0042"
SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # OTLP span kinds


@pytest.fixture(scope="module")
def collector():
    server = OtlpCollector().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake_llm():
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traced(pg_stack, log_dir, collector, fake_llm):
    pg_stack.apply_agents([llm_agent("traced-llm", fake_llm.url, api_key=SECRET)])
    stack = observed_stack(
        pg_stack,
        log_dir,
        "traced",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_SERVICE_NAME": "aap-hosting-test",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
        redis_db=side_redis_db(1),
    )
    yield stack
    stack.stop()


def trace_of(collector: OtlpCollector, turn_id: str, *, wanted: set[str], timeout: float = 20.0):
    """The spans of the trace whose web request started `turn_id`, once `wanted` names are in."""
    deadline = time.monotonic() + timeout
    while True:
        spans = collector.snapshot()
        roots = [s for s in spans if s.attributes.get("aap.turn_id") == turn_id and s.kind == SERVER]
        if roots:
            trace = [s for s in spans if s.trace_id == roots[0].trace_id]
            if wanted <= {s.name for s in trace}:
                return trace
        assert time.monotonic() < deadline, f"no complete trace for {turn_id}: {[(s.name, s.trace_id) for s in spans]}"
        time.sleep(0.2)


def test_one_turn_is_one_trace_across_web_and_worker(traced, collector, fake_llm):
    fake_llm.enqueue(FakeOpenAI.text("a traced answer", usage=(21, 4)))
    client = traced.client()
    try:
        session = client.create_session("traced-llm")
        result = client.turn(session, text="the private question", stream="delta")
    finally:
        client.close()
    assert result.stop_reason == "end_turn"
    turn_id = result.turn_id

    trace = trace_of(collector, turn_id, wanted={"aap.turn", "aap.model_call"})
    by_name = {s.name: s for s in trace}
    request = next(s for s in trace if s.kind == SERVER)
    assert request.name == "POST /v1/sessions/<id:session_id>/turns"
    assert request.parent_id == ""  # the trace starts at the web request
    assert request.attributes["http.response.status_code"] == 200
    turn = by_name["aap.turn"]
    model = by_name["aap.model_call"]
    # web -> (the turn's row in PostgreSQL) -> worker -> model call, each the parent of the next:
    # the turn carries its request's traceparent through the queue.
    assert turn.parent_id == request.span_id
    assert model.parent_id == turn.span_id
    # Two processes: the web request in Daphne, the rest in the worker.
    assert request.resource["process.pid"] == traced.web.pid
    assert turn.resource["process.pid"] == model.resource["process.pid"] == traced.worker.pid
    assert request.resource["service.name"] == "aap-hosting-test"
    # The turn id and what is safe to know; never the message, the answer or the secret.
    assert turn.attributes["aap.turn_id"] == turn_id
    assert (turn.attributes["aap.agent"], turn.attributes["aap.stop_reason"]) == ("traced-llm", "end_turn")
    assert (model.attributes["gen_ai.usage.input_tokens"], model.attributes["gen_ai.usage.output_tokens"]) == (21, 4)
    everything = repr([(s.name, s.attributes, s.resource) for s in collector.snapshot()])
    for leaked in ("the private question", "a traced answer", SECRET, traced.tokens["demo"]):
        assert leaked not in everything


PROBE = (
    "import sys, django; django.setup(); "
    "import hosting.urls, sessions_app.engine.host, agents.runtimes.openai; "
    "from hosting.asgi import application; "
    "print(sorted(m for m in ('opentelemetry.sdk.trace', 'opentelemetry.exporter.otlp.proto.http.trace_exporter', "
    "'opentelemetry.instrumentation.celery') if m in sys.modules))"
)


def test_without_an_otlp_endpoint_no_tracing_sdk_is_loaded(pg_stack, collector):
    """No exporter configured, no cost: a web process never imports the SDK or hooks Celery."""
    import subprocess
    import sys

    from ..support import ROOT

    env = {k: v for k, v in pg_stack.env.items() if not k.startswith("OTEL_")}
    plain = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip().splitlines()[-1] == "[]"
    traced = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**env, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert traced.returncode == 0, traced.stderr
    assert "opentelemetry.sdk.trace" in traced.stdout.strip().splitlines()[-1]
