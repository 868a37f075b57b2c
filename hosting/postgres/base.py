"""Django's PostgreSQL backend, with health checks of pooled connections that cost nothing
on the hot path.

Django checks every pooled connection before handing it out (`CONN_HEALTH_CHECKS`): a
round trip per checkout, two or three per turn. Here a connection is checked only when it
has sat unused in the pool for `AAP_DB_CHECK_IDLE_SECONDS`: one that came back moments ago
was working moments ago. After a PostgreSQL restart a connection checked out within that
window fails once; the pool discards a broken connection when it comes back, web requests
answer 503 with Retry-After (hosting/errors.py) and workers retry their database work
(`AAP_DB_RETRY_SECONDS`).
"""

from __future__ import annotations

import time
import weakref

from django.db.backends.postgresql import base

_returned_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def returned(conn) -> None:
    """psycopg_pool `reset` hook: the connection is back in the pool, and it worked."""
    _returned_at[conn] = time.monotonic()


def idle_seconds() -> float:
    from django.conf import settings

    return settings.AAP_DB_CHECK_IDLE_SECONDS


def check(conn) -> None:
    """psycopg_pool `check` hook: raises when a connection that sat idle is dead."""
    last = _returned_at.get(conn)
    if last is not None and time.monotonic() - last < idle_seconds():
        return
    from psycopg_pool import ConnectionPool

    ConnectionPool.check_connection(conn)


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self):
        pool = super().pool
        # Django builds the pool with its own check (or none); ours replaces it before the
        # pool opens (Django opens it on the first connection, after this property).
        if pool is not None and getattr(pool, "_check", None) is not check:
            pool._check = check
            pool._reset = returned
        return pool
