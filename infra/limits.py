"""Tenant limits: their effective values, rate windows, the 429 they answer, and the
`RateLimit-Policy` / `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers) on every
API response.

Rates are fixed windows counted in Redis (shared by every web process; in memory in the
embedded mode, which has one process). Concurrency (running and queued turns, sessions)
is counted in PostgreSQL by sessions_app.api.admission, where the rows it counts live, so a
lost Redis never lets a tenant past its limits nor locks it out.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import cache

from django.conf import settings

from .middleware_base import HybridMiddleware
from .outages import REDIS_ERRORS
from .service_errors import TooManyRequests

logger = logging.getLogger(__name__)

TURNS_WINDOW_SECONDS = 60
AUTH_WINDOW_SECONDS = 60


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's effective limits; 0 means no limit."""

    max_running_turns: int
    max_queued_turns: int
    turns_per_minute: int
    max_sessions: int
    tokens_per_day: int


def limits_for(tenant) -> TenantLimits:
    """The tenant's own limits where set, the settings' defaults elsewhere."""

    def pick(field: str, default: int) -> int:
        value = getattr(tenant, field, None)
        return default if value is None else int(value)

    return TenantLimits(
        max_running_turns=pick("max_running_turns", settings.AAP_TENANT_MAX_RUNNING_TURNS),
        max_queued_turns=pick("max_queued_turns", settings.AAP_TENANT_MAX_QUEUED_TURNS),
        turns_per_minute=pick("turns_per_minute", settings.AAP_TENANT_TURNS_PER_MINUTE),
        max_sessions=pick("max_sessions", settings.AAP_TENANT_MAX_SESSIONS),
        tokens_per_day=pick("tokens_per_day", settings.AAP_TENANT_TOKENS_PER_DAY),
    )


# --- fixed windows -------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One window's state: how many were counted, and seconds until it resets."""

    count: int
    reset: float


# Count one unless the window is full; the window starts with its first hit.
_TAKE = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n < tonumber(ARGV[1]) then
  n = redis.call('INCR', KEYS[1])
  if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  return {1, n, redis.call('PTTL', KEYS[1])}
end
return {0, n, redis.call('PTTL', KEYS[1])}
"""


class RedisWindows:
    def __init__(self, url: str):
        import redis

        from .redis_connections import retry_policy

        self.client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=5,
            max_connections=settings.REDIS_POOL_MAX,
            **retry_policy(asyncio_client=False),
        )
        self._take = self.client.register_script(_TAKE)

    def take(self, key: str, limit: int, window: float) -> tuple[bool, Window]:
        taken, count, ttl = self._take(keys=[key], args=[limit, int(window * 1000)])
        return bool(taken), Window(int(count), _seconds(ttl, window))

    def hit(self, key: str, window: float) -> Window:
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(key)
        pipe.pexpire(key, int(window * 1000), nx=True)
        pipe.pttl(key)
        count, _, ttl = pipe.execute()
        return Window(int(count), _seconds(ttl, window))

    def peek(self, key: str, window: float) -> Window:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        count, ttl = pipe.execute()
        return Window(int(count or 0), _seconds(ttl, window))


def _seconds(ttl_ms, window: float) -> float:
    return ttl_ms / 1000 if ttl_ms and ttl_ms > 0 else float(window)


class MemoryWindows:
    """The embedded mode's windows: one process, so a dict under a lock is the truth."""

    def __init__(self):
        self._windows: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def _current(self, key: str, window: float) -> tuple[int, float]:
        now = time.monotonic()
        count, ends = self._windows.get(key, (0, 0.0))
        if ends <= now:
            count, ends = 0, now + window
            if len(self._windows) > 10000:  # forget ended windows now and then
                self._windows = {k: v for k, v in self._windows.items() if v[1] > now}
        return count, ends

    def take(self, key: str, limit: int, window: float) -> tuple[bool, Window]:
        with self._lock:
            count, ends = self._current(key, window)
            taken = count < limit
            if taken:
                count += 1
                self._windows[key] = (count, ends)
            return taken, Window(count, ends - time.monotonic())

    def hit(self, key: str, window: float) -> Window:
        with self._lock:
            count, ends = self._current(key, window)
            self._windows[key] = (count + 1, ends)
            return Window(count + 1, ends - time.monotonic())

    def peek(self, key: str, window: float) -> Window:
        with self._lock:
            count, ends = self._current(key, window)
            return Window(count, ends - time.monotonic())


@cache
def windows() -> RedisWindows | MemoryWindows:
    return RedisWindows(settings.REDIS_URL) if settings.REDIS_URL else MemoryWindows()


# --- turns per minute, and the headers that describe it -------------------------------------


@dataclass(frozen=True)
class RateState:
    """What the `RateLimit` headers say: the policy's quota, what remains, when it resets."""

    policy: str
    quota: int
    window: int
    remaining: int
    reset: float


def _turns_key(tenant) -> str:
    return f"aap:rl:turns:{tenant.pk}"


def turns_rate_state(tenant) -> RateState | None:
    """The tenant's turns-per-minute window as it stands (one Redis round trip)."""
    quota = limits_for(tenant).turns_per_minute
    if not quota:
        return None
    try:
        state = windows().peek(_turns_key(tenant), TURNS_WINDOW_SECONDS)
    except REDIS_ERRORS:  # headers are advice: a Redis hiccup must not fail the request
        logger.warning("turns-per-minute window unreadable; no rate headers", exc_info=True)
        return None
    return RateState("turns", quota, TURNS_WINDOW_SECONDS, max(0, quota - state.count), state.reset)


def take_turn(tenant) -> None:
    """Count one turn against the tenant's turns per minute, or raise TooManyRequests."""
    quota = limits_for(tenant).turns_per_minute
    if not quota:
        return
    try:
        taken, state = windows().take(_turns_key(tenant), quota, TURNS_WINDOW_SECONDS)
    except REDIS_ERRORS:  # Redis is briefly away: admit (running turns stay bounded in PostgreSQL)
        logger.warning("turns-per-minute window unavailable; turn admitted", exc_info=True)
        return
    tenant._aap_rate_state = RateState("turns", quota, TURNS_WINDOW_SECONDS, max(0, quota - state.count), state.reset)
    if not taken:
        raise TooManyRequests(
            f"This tenant's limit of {quota} turns per minute is reached; retry in {int(state.reset + 0.999)} seconds.",
            retry_after=state.reset,
            limit="turnsPerMinute",
        )


def ratelimit_headers(state: RateState) -> dict[str, str]:
    return {
        "RateLimit-Policy": f'"{state.policy}";q={state.quota};w={state.window}',
        "RateLimit": f'"{state.policy}";r={state.remaining};t={max(0, int(state.reset + 0.999))}',
    }


class RateLimitHeadersMiddleware(HybridMiddleware):
    """Adds `RateLimit-Policy` / `RateLimit` to every response of an authenticated tenant.

    No I/O here (it runs on the event loop): authentication read the window on the view's
    thread and left it on the tenant (`_aap_rate_state`); a turn start updates it."""

    @staticmethod
    def _decorate(request, response):
        tenant = getattr(getattr(request, "user", None), "tenant", None)
        state = getattr(tenant, "_aap_rate_state", None)
        if state is not None:
            for name, value in ratelimit_headers(state).items():
                response[name] = value
        return response

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        return self._decorate(request, self.get_response(request))

    async def _acall(self, request):
        return self._decorate(request, await self.get_response(request))


# --- failed bearer tokens per client address --------------------------------------------------

_blocked: dict[str, float] = {}  # address -> monotonic time its block ends (this process)


def client_address(request) -> str:
    return request.META.get("REMOTE_ADDR") or "unknown"


def check_auth_failures(address: str) -> None:
    """Raise TooManyRequests while this address is blocked. No I/O: the block is known here."""
    ends = _blocked.get(address)
    if ends is None:
        return
    left = ends - time.monotonic()
    if left <= 0:
        _blocked.pop(address, None)
        return
    raise TooManyRequests(
        f"Too many unknown API tokens were sent from this address; retry in {int(left + 0.999)} seconds "
        "with a valid token.",
        retry_after=left,
        limit="authFailuresPerMinute",
    )


def record_auth_failure(address: str) -> None:
    """Count a failed token (shared between processes); past the limit, block the address here."""
    limit = settings.AAP_AUTH_FAILURES_PER_MINUTE
    if not limit:
        return
    try:
        state = windows().hit(f"aap:rl:authfail:{address}", AUTH_WINDOW_SECONDS)
    except REDIS_ERRORS:  # counting is a defence, not a dependency
        logger.warning("failed sign-ins could not be counted", exc_info=True)
        return
    if state.count >= limit:
        if len(_blocked) > 10000:
            _blocked.clear()
        _blocked[address] = time.monotonic() + state.reset
