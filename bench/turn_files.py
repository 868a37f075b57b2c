"""How many of the project's files one echo turn runs code from (`python -m bench.turn_files`).

One process, driven through the ASGI application: a session, a first turn (warm: imports and
caches), then the turn that is counted, a short `delta` stream from POST to `turn_stop`. A
profile hook on every thread (set before any thread of the web or the engine starts) records
the file of every function called while that turn runs; module bodies (imports) are not
counted. Prints the counts and the files.

Two modes. By default the embedded mode (SQLite, no Redis: the turn runs on the web
process's own worker, its events in memory). With `--database-url` (a PostgreSQL server; a
database of its own is made there and dropped) and `--redis-url`, the production path: the
web's code and a `Worker` built by the Celery worker's entry point (`start_worker`), in this
one process, woken by PostgreSQL's notification, its events in Redis.

Two counts: every project file, and the turn's own path, which leaves out what the turn calls
but does not own: the cross-cutting platform package (`infra/`: the ASGI handler,
middleware, errors, limits, logs, metrics, tracing, crypto, Redis connections), the AAP SDK
(`sdk/`, its own package: wire types and SSE encoding) and the bearer-token authentication
every endpoint runs before its view (`tenancy/authentication.py`). `--max N` exits 1 when the
turn's own path passes N files (issue 28 set 15).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
import tempfile
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent

# Cross-cutting: what the turn calls but does not own (see the module's text).
CROSS_CUTTING = ("infra/", "sdk/", "tenancy/authentication.py")


def own_path(files: set[str]) -> list[str]:
    return sorted(name for name in files if not name.startswith(CROSS_CUTTING))


@contextmanager
def own_database(server_url: str):
    """A database of its own on the PostgreSQL server of `server_url`, dropped at the end."""
    import psycopg

    name = f"aap_turn_files_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = urlunsplit(urlsplit(server_url)._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max", type=int, default=None, help="exit 1 when the turn's own path passes this many files")
    parser.add_argument("--database-url", default="", help="a PostgreSQL server: count the production path")
    parser.add_argument("--redis-url", default="", help="the Redis of the production path (never flushed)")
    args = parser.parse_args(argv)
    if bool(args.database_url) != bool(args.redis_url):
        parser.error("the production path needs both --database-url and --redis-url")
    if not args.database_url:
        return count(database_url="", redis_url="", max_files=args.max)
    with own_database(args.database_url) as database_url:
        return count(database_url=database_url, redis_url=args.redis_url, max_files=args.max)


def count(*, database_url: str, redis_url: str, max_files: int | None) -> int:
    var = tempfile.mkdtemp(prefix="aap-turn-files-")
    os.environ.update(
        DJANGO_SETTINGS_MODULE="hosting.settings",
        SECRET_KEY=os.environ.get("SECRET_KEY", "bench-only-secret-key-" + "x" * 40),
        HOSTING_VAR_DIR=var,
        DEBUG="0",
        REDIS_URL=redis_url,
        DATABASE_URL=database_url,
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    out = io.StringIO()
    call_command("seed_demo", stdout=out)
    token = out.getvalue().strip().splitlines()[-1]

    import httpx

    from hosting.asgi import application

    root = f"{ROOT}/"
    seen: set[str] = set()
    recording = False

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if (
            recording
            and name.startswith(root)
            and "/.venv/" not in name
            and "/bench/" not in name
            and frame.f_code.co_name != "<module>"
        ):
            seen.add(name[len(root) :])

    threading.setprofile(hook)
    sys.setprofile(hook)
    worker = None
    if redis_url:
        from sessions_app.engine import worker

        # As a Celery worker's `worker_ready` signal does; its sweep and heartbeat round come
        # every 10 s, after the turns counted here.
        worker.start_worker("turn-files", 2)

    async def turns() -> str:
        nonlocal recording
        transport = httpx.ASGITransport(app=application)
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", headers=headers) as client:
            session = (await client.post("/v1/sessions", json={"agent": {"name": "echo"}})).json()["sessionId"]
            body = {"messages": [{"role": "user", "content": "warm"}], "stream": "delta"}
            await client.post(f"/v1/sessions/{session}/turns", json=body)
            recording = True
            body = {"messages": [{"role": "user", "content": "hello"}], "stream": "delta"}
            response = await client.post(f"/v1/sessions/{session}/turns", json=body)
            recording = False
            return response.text

    try:
        text = asyncio.run(turns())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        if worker is not None:
            worker.stop_worker()
            worker.drain_worker()
            # its wake-up listener lets go of its connection before the database is dropped
            for thread in threading.enumerate():
                if thread.name == "aap-wake-listener":
                    thread.join(5)
    if "turn_stop" not in text:
        print(f"the counted turn did not end: {text[-300:]}", file=sys.stderr)
        return 1
    own = own_path(seen)
    mode = "PostgreSQL, Redis and a worker" if redis_url else "embedded"
    print(
        f"{len(own)} files on the turn's own path ({len(seen)} project files in all) run code for one echo turn ({mode}):"
    )
    for name in own:
        print(f"  {name}")
    print(f"cross-cutting ({', '.join(CROSS_CUTTING)}):")
    for name in sorted(seen.difference(own)):
        print(f"  {name}")
    if max_files is not None and len(own) > max_files:
        print(f"the turn's own path runs through {len(own)} files, more than {max_files}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
