"""The errors that mean a dependency is away, by name, for `except` clauses that tolerate an
outage: anything else (a TypeError from a code bug) propagates to the request, task or
thread boundary, which logs it with its traceback (infra/logs.py).

- `DB_ERRORS`: PostgreSQL unreachable, restarting or its connection lost (Django's wrappers
  and psycopg's own, which the pool raises before Django wraps them).
- `REDIS_ERRORS`: Redis unreachable, full, read-only or timing out (redis-py's errors and the
  socket errors beneath them).
"""

from __future__ import annotations

import psycopg
from django import db

DB_ERRORS: tuple[type[BaseException], ...] = (
    db.OperationalError,
    db.InterfaceError,
    psycopg.OperationalError,
    psycopg.InterfaceError,
    OSError,
)

try:
    from redis.exceptions import RedisError
except ImportError:  # the embedded mode runs without redis-py
    REDIS_ERRORS: tuple[type[BaseException], ...] = (OSError,)
else:
    REDIS_ERRORS = (RedisError, OSError)

#: Either store away: PostgreSQL or Redis (the event backends use one or the other).
OUTAGE_ERRORS: tuple[type[BaseException], ...] = DB_ERRORS + REDIS_ERRORS
