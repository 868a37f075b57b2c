"""Django's PostgreSQL backend, with health checks of pooled connections that cost nothing
on the hot path.

Django checks every pooled connection before handing it out (`CONN_HEALTH_CHECKS`): a
round trip per checkout, two or three per turn. Here a connection is checked only when it
has sat unused in the pool for `AAP_DB_CHECK_IDLE_SECONDS`: one that came back moments ago
was working moments ago. After a PostgreSQL restart a connection checked out within that
window fails once; the pool discards a broken connection when it comes back, web requests
answer 503 with Retry-After (infra/errors.py) and workers retry their database work
(`AAP_DB_RETRY_SECONDS`).

A connection found dead at checkout rarely died alone (a restart, a failover, backends
terminated together): the pool's idle connections are then all checked at once, on a
thread of their own (`ConnectionPool.check`), and the dead replaced. Without that, each
client finds one corpse per try, between backoff pauses, and a pool full of them outlasts
its timeout.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from django.db.backends.postgresql import base

logger = logging.getLogger(__name__)

_returned_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_sweeping = threading.Lock()  # one sweep of the idle connections at a time


def returned(conn) -> None:
    """The connection is going back to the pool, and it worked (`DatabaseWrapper.close`)."""
    _returned_at[conn] = time.monotonic()


def idle_seconds() -> float:
    from django.conf import settings

    return settings.AAP_DB_CHECK_IDLE_SECONDS


def check(conn) -> None:
    """psycopg_pool `check` hook: raises when a connection that sat idle is dead (and starts
    a sweep of the pool's other idle connections, `sweep`)."""
    last = _returned_at.get(conn)
    if last is not None and time.monotonic() - last < idle_seconds():
        return
    from psycopg_pool import ConnectionPool

    try:
        ConnectionPool.check_connection(conn)
    except Exception:
        pool = getattr(conn, "_pool", None)
        if pool is not None and _sweeping.acquire(blocking=False):
            threading.Thread(target=sweep, args=(pool,), name="aap-db-sweep", daemon=True).start()
        raise


def sweep(pool) -> None:
    """Check every idle connection of `pool`, replacing the dead (psycopg_pool's own check);
    releases the sweep lock taken by `check`."""
    try:
        pool.check()
    except Exception:  # the sweep thread's boundary
        logger.warning("the pool's idle connections could not be checked", exc_info=True)
    finally:
        _sweeping.release()


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self):
        pool = super().pool
        # Django builds the pool with its own check (or none); ours replaces it before the
        # pool opens (Django opens it on the first connection, after this property).
        if pool is not None and getattr(pool, "_check", None) is not check:
            pool._check = check
        return pool

    def close(self) -> None:
        # The return time is taken here rather than in a psycopg_pool `reset` hook: with
        # any reset hook the pool hands every returned connection to its maintenance
        # thread, a thread switch and a lock round per return (several per turn); without
        # one the connection goes back inline, on the returning thread.
        # Taken before the return, so that a thread waiting for a connection never gets
        # this one unrecorded (and checks it for nothing).
        if self.connection is not None and not self.closed_in_transaction and self.pool is not None:
            returned(self.connection)
        super().close()
