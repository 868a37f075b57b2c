"""Prometheus metrics of web and worker processes (docs/observability.md).

`AAP_METRICS` decides where they are read: `off` (the default: no endpoint), `token`
(`/metrics` on the service's port, behind `Authorization: Bearer $AAP_METRICS_TOKEN`) or
`port` (an internal HTTP port, `AAP_METRICS_PORT`, with no authentication). When on, every
process writes its samples under `PROMETHEUS_MULTIPROC_DIR` (prometheus_client's
multiprocess mode), so one scrape of a web process also sums the workers on its host.

Instrumented code calls the small functions below (one line at each place); label values
that come from the registry (agent and tenant names) are capped per process.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import threading
import time
from pathlib import Path

from django.conf import settings

from .middleware_base import HybridMiddleware

# Read before prometheus_client is imported: settings put PROMETHEUS_MULTIPROC_DIR in place.
_MODE = settings.AAP_METRICS

from prometheus_client import (  # noqa: E402
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

logger = logging.getLogger(__name__)

# Label values past this many distinct ones per label become "other" (a bounded series count).
LABEL_CAP = 200
OTHER = "other"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
TURN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _Capped:
    """Keeps the first LABEL_CAP values of a label; later new values read as "other"."""

    def __init__(self, cap: int = LABEL_CAP):
        self.cap = cap
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, value) -> str:
        value = str(value or "")[:100] or "unknown"
        if value in self.seen:
            return value
        with self.lock:
            if len(self.seen) < self.cap:
                self.seen.add(value)
                return value
        return OTHER


_agent = _Capped()
_tenant = _Capped()
_route = _Capped()
_limit = _Capped(20)

HTTP_REQUESTS = Counter(
    "aap_http_requests", "HTTP requests answered, by route and status.", ["route", "method", "status"]
)
HTTP_LATENCY = Histogram(
    "aap_http_request_duration_seconds",
    "Time to the response head, by route.",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
)
RATE_LIMITED = Counter(
    "aap_rate_limited", "Requests refused with 429, by the limit that refused them (details.limit).", ["limit"]
)
TURNS_STARTED = Counter(
    "aap_turns_started", "Turns accepted, by agent, tenant and stream mode.", ["agent", "tenant", "stream"]
)
TURNS_FINISHED = Counter(
    "aap_turns_finished",
    "Turns run to their end by a worker, by agent, tenant and stop reason.",
    ["agent", "tenant", "stop_reason"],
)
TURNS_CANCELLED = Counter("aap_turns_cancelled", "Turns that ended by a cancel, by agent.", ["agent"])
TURN_DURATION = Histogram(
    "aap_turn_duration_seconds",
    "How long the agent ran a turn (worker side), by agent.",
    ["agent"],
    buckets=TURN_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "aap_turn_queue_wait_seconds", "From accepting a turn to a worker starting it.", buckets=TURN_BUCKETS
)
FIRST_EVENT = Histogram(
    "aap_turn_first_event_seconds",
    "From a turn's response head to its first agent event, as a streaming client sees it.",
    buckets=TURN_BUCKETS,
)
OPEN_STREAMS = Gauge(
    "aap_open_streams", "Turn responses being streamed right now (SSE and JSON).", ["mode"], multiprocess_mode="livesum"
)
EVENTS_RELAYED = Counter("aap_events_relayed", "AAP events written to clients, by stream mode.", ["mode"])
LLM_TOKENS = Counter(
    "aap_llm_tokens", "Model tokens used by turns, by agent, tenant and kind.", ["agent", "tenant", "kind"]
)
MODEL_CALLS = Counter("aap_llm_calls", "Model calls made by turns, by agent.", ["agent"])
LOST_TURNS = Counter("aap_lost_turns_recovered", "Lost turns ended with error, by what they were doing.", ["state"])
ACP_STARTED = Counter("aap_acp_processes_started", "ACP agent processes started.")
ACP_KILLED = Counter(
    "aap_acp_processes_killed", "ACP agent processes killed by the host (limits, timeouts, bad output)."
)
ACP_ALIVE = Gauge("aap_acp_processes_alive", "ACP agent processes running now.", multiprocess_mode="livesum")


# --- what instrumented code calls -----------------------------------------------------------


def turn_started(*, agent: str, tenant: str, stream: str) -> None:
    TURNS_STARTED.labels(_agent(agent), _tenant(tenant), stream).inc()


async def timed_turn(plan, coro):
    """Await a turn's execution (host.execute) and count its outcome, time and tokens."""
    started = time.monotonic()
    outcome = await coro
    try:
        agent, tenant = _agent(plan.agent_name), _tenant(plan.tenant)
        TURN_DURATION.labels(agent).observe(time.monotonic() - started)
        TURNS_FINISHED.labels(agent, tenant, outcome.stop_reason).inc()
        if outcome.cancelled:
            TURNS_CANCELLED.labels(agent).inc()
        if outcome.model_calls:
            MODEL_CALLS.labels(agent).inc(outcome.model_calls)
            LLM_TOKENS.labels(agent, tenant, "prompt").inc(outcome.prompt_tokens)
            LLM_TOKENS.labels(agent, tenant, "completion").inc(outcome.completion_tokens)
    except Exception:  # a metric must never cost a turn its outcome
        logger.warning("turn metrics failed", exc_info=True)
    return outcome


def turn_lost(state: str) -> None:
    LOST_TURNS.labels(state if state in ("queued", "running") else OTHER).inc()


def acp_process_started() -> None:
    ACP_STARTED.inc()
    ACP_ALIVE.inc()


def acp_process_exited() -> None:
    ACP_ALIVE.dec()


def acp_process_killed() -> None:
    ACP_KILLED.inc()


def enabled() -> bool:
    """Metrics are read somewhere (AAP_METRICS is not `off`): only then is per-event work done
    for them."""
    return _MODE != "off"


async def relayed(body, *, mode: str, after: int):
    """Wrap a turn response's body (stream.TurnStreamHandoff): open streams, events
    written, and the time to the first agent event for a client attached from the start."""
    kind = "none" if mode == "none" else "sse"
    gauge = OPEN_STREAMS.labels(kind)
    gauge.inc()
    opened, seen = time.monotonic(), 0
    try:
        async for chunk in body:
            if kind == "sse" and chunk.startswith(b"id:"):
                seen += 1
                EVENTS_RELAYED.labels(mode).inc()
                if seen == 2 and after == 0:  # the first event after turn_start
                    FIRST_EVENT.observe(time.monotonic() - opened)
            yield chunk
    finally:
        gauge.dec()
        await body.aclose()  # the caller closes this wrapper; the turn's follower must close too


# --- the queue: wait time (at a turn's claim) and depth (at scrape time) ---------------------


def turn_claimed(waited_seconds: float) -> None:
    """A worker starts a turn accepted `waited_seconds` ago (in PostgreSQL, on the broker, or both)."""
    QUEUE_WAIT.observe(max(0.0, waited_seconds))


def _connect_celery_signals() -> None:
    from celery.signals import worker_ready

    worker_ready.connect(lambda **kw: start_serving(), weak=False)


#: Collectors the apps add to every scrape (sessions_app: the turn queue), read when scraped.
_app_collectors: list = []


def register_collector(collector) -> None:
    """Add `collector` (a prometheus_client custom collector) to every scrape of this process."""
    _app_collectors.append(collector)


# --- the registry and where it is served -------------------------------------------------------


def multiprocess_dir() -> Path | None:
    value = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(value) if value else None


def registry() -> CollectorRegistry:
    """What a scrape reads: every process's samples (multiprocess mode) plus the apps' collectors."""
    if multiprocess_dir() is None:
        scrape = CollectorRegistry()
        scrape.register(_ProcessLocal())
    else:
        scrape = CollectorRegistry()
        multiprocess.MultiProcessCollector(scrape)
    for collector in _app_collectors:
        scrape.register(collector)
    return scrape


class _ProcessLocal:
    def collect(self):
        yield from REGISTRY.collect()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_processes() -> None:
    """Remove the files of processes that are gone (a restarted service starts clean; their
    counters read as a reset, which Prometheus' rate() expects)."""
    directory = multiprocess_dir()
    if directory is None or not directory.is_dir():
        return
    for path in directory.glob("*.db"):
        match = re.search(r"_(\d+)\.db$", path.name)
        if match and int(match.group(1)) != os.getpid() and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


_served_lock = threading.Lock()
_served_pid: int | None = None


def start_serving() -> None:
    """Once per process: clean the files of dead processes and, in `port` mode, serve the
    registry on AAP_METRICS_PORT (the first process of a host to bind it serves them all)."""
    global _served_pid
    if _MODE == "off":
        return
    with _served_lock:
        if _served_pid == os.getpid():
            return
        _served_pid = os.getpid()
    sweep_dead_processes()
    if _MODE == "port":
        from prometheus_client import start_http_server

        try:
            start_http_server(settings.AAP_METRICS_PORT, addr=settings.AAP_METRICS_ADDR, registry=registry())
            logger.info("metrics served on %s:%s", settings.AAP_METRICS_ADDR, settings.AAP_METRICS_PORT)
        except OSError:
            logger.info("metrics port %s is taken (another process of this host serves it)", settings.AAP_METRICS_PORT)


def _csrf_exempt(view):
    view.csrf_exempt = True  # a bearer-token endpoint: no cookies, so no CSRF
    return view


@_csrf_exempt
def metrics_view(request):
    """`GET /metrics` in `token` mode: the Prometheus text format behind a bearer token."""
    from django.http import HttpResponse, JsonResponse

    if _MODE != "token":
        return JsonResponse({"error": "Metrics are not served here (AAP_METRICS is not 'token')."}, status=404)
    if request.method != "GET":
        return JsonResponse({"error": "Use GET to read the metrics."}, status=405, headers={"Allow": "GET"})
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), settings.AAP_METRICS_TOKEN.encode()
    ):
        return JsonResponse(
            {"error": "Send the metrics token (AAP_METRICS_TOKEN) as 'Authorization: Bearer <token>'."},
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


# --- HTTP requests ---------------------------------------------------------------------------


def _policy_name(response) -> str:
    """The limit a 429 names: its body's `details.limit`, else its RateLimit-Policy's name."""
    data = getattr(response, "data", None)
    details = data.get("details") if isinstance(data, dict) else None
    if isinstance(details, dict) and isinstance(details.get("limit"), str):
        return _limit(details["limit"])
    # RateLimit-Policy: "turns";q=10;w=60 -> turns
    policy = response.get("RateLimit-Policy", "") if hasattr(response, "get") else ""
    match = re.match(r'\s*"?([A-Za-z0-9_.-]+)', policy or "")
    return _limit(match.group(1)) if match else "unknown"


class RequestMetricsMiddleware(HybridMiddleware):
    """Counts requests and times their response head, by route (the URL pattern, bounded)."""

    def __init__(self, get_response):
        super().__init__(get_response)
        start_serving()

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        started = time.monotonic()
        response = self.get_response(request)
        self._observe(request, response, started)
        return response

    async def _acall(self, request):
        started = time.monotonic()
        response = await self.get_response(request)
        self._observe(request, response, started)
        return response

    @staticmethod
    def _observe(request, response, started: float) -> None:
        match = getattr(request, "resolver_match", None)
        route = _route("/" + match.route if match is not None and match.route else "unmatched")
        method = (
            request.method if request.method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS") else OTHER
        )
        HTTP_REQUESTS.labels(route, method, str(response.status_code)).inc()
        HTTP_LATENCY.labels(route, method).observe(time.monotonic() - started)
        if response.status_code == 429:
            RATE_LIMITED.labels(_policy_name(response)).inc()


_connect_celery_signals()
