"""OpenTelemetry traces of a turn: web request -> queue -> worker -> runtime -> model call.

Opt-in with the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_BSP_*`, ...): settings.AAP_TRACING is true only when an OTLP
endpoint is given. Otherwise no SDK is set up and every helper here is a pass-through.

Spans carry ids (turn, session is left out), agent names, stop reasons and token counts —
never message content, option values or secrets. The context crosses Celery in the task
message's headers (opentelemetry-instrumentation-celery) and is carried onto the runtime loop
explicitly, since a coroutine handed to another thread's loop does not inherit it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading

from django.conf import settings

from .middleware_base import HybridMiddleware

logger = logging.getLogger(__name__)

_setup_lock = threading.Lock()
_setup_pid: int | None = None


def enabled() -> bool:
    return bool(settings.AAP_TRACING)


def setup() -> None:
    """Once per process (again after a fork): the SDK, the OTLP/HTTP exporter, Celery hooks."""
    global _setup_pid
    if not enabled():
        return
    with _setup_lock:
        if _setup_pid == os.getpid():
            return
        _setup_pid = os.getpid()
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES over this default.
        resource = Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME") or "aap-hosting", "process.pid": os.getpid()}
        )
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        instrumentor = CeleryInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)
        logger.info("OpenTelemetry traces exported over OTLP/HTTP")


def _tracer():
    from opentelemetry import trace

    return trace.get_tracer("aap-hosting")


def trace_parent() -> str:
    """The W3C traceparent of the current span ("" when tracing is off): what a turn stored
    now carries to the worker that runs it (`continued`)."""
    if not enabled():
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


@contextlib.contextmanager
def continued(parent: str):
    """What runs inside continues the trace `parent` (a traceparent from `trace_parent`: the
    request that accepted a turn), or starts a trace of its own when there is none."""
    if not enabled():
        yield
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carried = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else context.Context()
    token = context.attach(carried)
    try:
        yield
    finally:
        context.detach(token)


def carry(plan, coro):
    """Run a turn's execution (host.execute) in an `aap.turn` span whose parent is the calling
    thread's context (the request that accepted the turn, `continued`), though the coroutine
    runs on the runtime loop."""
    if not enabled():
        return coro
    from opentelemetry import context

    return _turn_span(plan, coro, context.get_current())


async def _turn_span(plan, coro, parent):
    attributes = {
        "aap.turn_id": plan.turn_id,
        "aap.agent": plan.agent_name,
        "aap.runtime": plan.runtime_kind,
        "aap.stream": plan.stream,
    }
    with _tracer().start_as_current_span("aap.turn", context=parent, attributes=attributes) as span:
        outcome = await coro
        span.set_attribute("aap.stop_reason", outcome.stop_reason)
        span.set_attribute("aap.model_calls", outcome.model_calls)
        return outcome


def model_call(method):
    """Decorator of a runtime's model call `(self, turn, ...)`: an `aap.model_call` span with
    the model name and the tokens it used."""

    @functools.wraps(method)
    async def traced(self, turn, *args, **kwargs):
        if not enabled():
            return await method(self, turn, *args, **kwargs)
        with _tracer().start_as_current_span(
            "aap.model_call", attributes={"gen_ai.request.model": str(getattr(turn, "model", ""))}
        ) as span:
            reply = await method(self, turn, *args, **kwargs)
            usage = getattr(reply, "usage", None)
            if usage:
                span.set_attribute("gen_ai.usage.input_tokens", int(usage[0]))
                span.set_attribute("gen_ai.usage.output_tokens", int(usage[1]))
            return reply

    return traced


class TracingMiddleware(HybridMiddleware):
    """A server span per request, continuing a caller's `traceparent`; the turn id of a turn
    response becomes an attribute. Route patterns name spans (no ids, no query strings)."""

    def __init__(self, get_response):
        super().__init__(get_response)
        setup()

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        with self._span(request) as span:
            response = self.get_response(request)
            self._finish(span, request, response)
            return response

    async def _acall(self, request):
        with self._span(request) as span:
            response = await self.get_response(request)
            self._finish(span, request, response)
            return response

    def _span(self, request):
        from opentelemetry import trace
        from opentelemetry.propagate import extract

        return _tracer().start_as_current_span(
            request.method,
            context=extract(dict(request.headers)),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": request.method},
        )

    @staticmethod
    def _finish(span, request, response) -> None:
        match = getattr(request, "resolver_match", None)
        if match is not None and match.route:
            span.update_name(f"{request.method} /{match.route}")
            span.set_attribute("http.route", "/" + match.route)
        span.set_attribute("http.response.status_code", response.status_code)
        turn_id = response.get("AAP-Turn-Id") if hasattr(response, "get") else None
        if turn_id:
            span.set_attribute("aap.turn_id", turn_id)


def _connect_celery_signals() -> None:
    from celery.signals import worker_process_init

    worker_process_init.connect(lambda **kwargs: setup(), weak=False)  # a prefork child


# A worker (or any process running turns) sets up at import; web processes in TracingMiddleware.
_connect_celery_signals()
setup()
