"""This process's Redis connections (REDIS_URL): one blocking pool for synchronous callers
and one asyncio client per event loop, shared by everything that talks to Redis here (the
live event stream, the ACP routing keys, the health check). None in embedded mode.

Every pooled connection retries a command (or a pipeline) once, after a short backoff, when
its connection fails: after a Redis restart each pooled connection is stale, and without the
retry the first command on each fails although Redis is back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

from django.conf import settings

# One retry, 50-500 ms later: enough for a stale connection to reconnect, short enough that a
# Redis that is really down is reported at once (callers have their own, longer retries).
RETRY_BACKOFF_BASE = 0.05
RETRY_BACKOFF_CAP = 0.5


def retry_policy(*, asyncio_client: bool) -> dict[str, Any]:
    """Connection kwargs: retry once on a connection error or timeout (a fresh list each
    time: redis-py's asyncio connection appends to the one it is given)."""
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.exceptions import ConnectionError, TimeoutError
    from redis.retry import AbstractRetry

    backoff = ExponentialWithJitterBackoff(cap=RETRY_BACKOFF_CAP, base=RETRY_BACKOFF_BASE)
    retry: AbstractRetry
    if asyncio_client:
        from redis.asyncio.retry import Retry as AsyncioRetry

        retry = AsyncioRetry(backoff, 1)
    else:
        from redis.retry import Retry

        retry = Retry(backoff, 1)
    return {"retry": retry, "retry_on_error": [ConnectionError, TimeoutError]}


class RedisConnections:
    def __init__(self, url: str):
        import redis

        self.url = url
        # Blocking pools: a burst of turns waits for a free connection instead of failing.
        self.sync = redis.Redis(
            connection_pool=redis.BlockingConnectionPool.from_url(
                url,
                max_connections=settings.REDIS_POOL_MAX,
                timeout=30,
                decode_responses=True,
                socket_timeout=30,
                socket_connect_timeout=5,
                health_check_interval=5,
                **retry_policy(asyncio_client=False),
            )
        )
        self._async: dict[asyncio.AbstractEventLoop, Any] = {}
        self._lock = threading.Lock()

    def per_loop(self, registry: dict, make: Callable[[], Any]) -> Any:
        """This loop's entry of `registry`, made once (asyncio objects belong to one loop)."""
        loop = asyncio.get_running_loop()
        item = registry.get(loop)
        if item is None:
            made = make()  # outside the lock: making an entry may take aclient()
            with self._lock:
                item = registry.setdefault(loop, made)
        return item

    def aclient(self):
        """The asyncio client of the running loop (redis-py asyncio clients are per loop)."""
        import redis.asyncio as aredis

        # No read timeout: redis-py 8 would otherwise give up on a read after 5 s.
        return self.per_loop(
            self._async,
            lambda: aredis.Redis(
                connection_pool=aredis.BlockingConnectionPool.from_url(
                    self.url,
                    max_connections=settings.REDIS_POOL_MAX,
                    timeout=30,
                    decode_responses=True,
                    socket_timeout=None,
                    socket_connect_timeout=5,
                    health_check_interval=5,
                    **retry_policy(asyncio_client=True),
                )
            ),
        )


@cache
def connections() -> RedisConnections | None:
    """The process's connections to REDIS_URL; None without it (embedded mode)."""
    return RedisConnections(settings.REDIS_URL) if settings.REDIS_URL else None
