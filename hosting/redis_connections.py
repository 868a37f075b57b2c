"""This process's Redis connections (REDIS_URL): one blocking pool for synchronous callers
and one asyncio client per event loop, shared by everything that talks to Redis here (the
live event stream, the ACP routing keys, the health check). None in embedded mode."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

from django.conf import settings


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
                )
            ),
        )


@cache
def connections() -> RedisConnections | None:
    """The process's connections to REDIS_URL; None without it (embedded mode)."""
    return RedisConnections(settings.REDIS_URL) if settings.REDIS_URL else None
