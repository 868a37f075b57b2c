"""A second stack for the observability tests: Daphne + a Celery worker on the suite's
PostgreSQL test database, with metrics, traces or the /try/ page turned on by environment.

It uses a Redis database of its own (broker and events), so only its own worker runs its
turns and the suite's main stack never sees them."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

from ..support import Stack

METRICS_TOKEN = "metrics-token-for-the-suite-0123456789"


def observed_stack(pg_stack: Stack, log_dir, name: str, env: dict, *, redis_db: int) -> Stack:
    parts = urlsplit(pg_stack.env["REDIS_URL"])
    redis_url = urlunsplit(parts._replace(path=f"/{redis_db}"))
    # A Redis of its own, so a queue of its own too: the suite's worker never runs its turns.
    stack = Stack(name, {**pg_stack.env, "REDIS_URL": redis_url, "AAP_TURN_QUEUE": name, **env}, log_dir)
    stack.tokens = dict(pg_stack.tokens)
    try:
        stack.start_web()
        stack.start_worker()
    except BaseException:
        stack.stop()
        raise
    return stack


def new_tenant(stack: Stack) -> str:
    """A tenant of its own (so counts start at zero); returns its name and keeps its token."""
    name = f"t{uuid.uuid4().hex[:10]}"
    stack.tokens[name] = stack.manage("create_tenant", name).strip().splitlines()[-1]
    return name
