"""The README's backup and restore, run as written against the suite's PostgreSQL.

The commands are read from the README (what follows `docker compose exec -T postgres`), with
only the connection changed: the suite's server instead of compose's `-U aap`, the test
database as the deployment to back up, and a throwaway database, unique to this run, as the
fresh deployment to restore into — first empty (not migrated), then again once populated.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import uuid
from urllib.parse import urlsplit

import psycopg
import pytest

from tests.support import ROOT

PREFIX = "docker compose exec -T postgres "


def pg_binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        pytest.skip(f"{name} is not installed (PostgreSQL's client programs): the backup test needs it")
    return found


def readme_command(program: str) -> tuple[list[str], str]:
    """The README's `program ...` arguments and the file it redirects to or from."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(re.escape(PREFIX + program) + r" (.+?) ([<>]) (\S.*)$", readme, re.M)
    assert match, f"the README gives no `{PREFIX}{program}` command"
    return shlex.split(match.group(1)), match.group(3)


def connection_args() -> tuple[list[str], str]:
    url = urlsplit(os.environ["DATABASE_URL"])
    args = ["-h", url.hostname or "127.0.0.1", "-p", str(url.port or 5432), "-U", url.username or "postgres"]
    return args, url.password or ""


def localised(args: list[str], database: str) -> list[str]:
    """The README's arguments with compose's role and database (`-U aap`, `aap`) replaced."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "-U":
            skip = True
        elif arg == "-d":
            out += ["-d", database]
            skip = True
        elif arg == "aap" and args[i - 1] != "-d":
            out.append(database)
        else:
            out.append(arg)
    return out


def server(database: str = "postgres") -> psycopg.Connection:
    url = urlsplit(os.environ["DATABASE_URL"])
    return psycopg.connect(
        host=url.hostname or "127.0.0.1",
        port=url.port or 5432,
        user=url.username or "postgres",
        password=url.password,
        dbname=database,
        autocommit=True,
    )


@pytest.fixture
def fresh_database():
    name = f"aap_restore_{uuid.uuid4().hex[:12]}"
    with server() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with server() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def kept_tenant():
    """A tenant committed to the test database (pg_dump reads committed rows only), written
    on a connection of its own and deleted after: the test database is shared with the pg
    stack's processes, so it is never flushed (a transactional test would flush it)."""
    from django.db import connection

    source = connection.settings_dict["NAME"]
    name = f"kept-by-the-backup-{uuid.uuid4().hex[:8]}"
    with server(source) as conn:
        conn.execute(
            "INSERT INTO hosting_tenant (name, title, is_active, created_at, max_running_turns, max_queued_turns,"
            " turns_per_minute, max_sessions, tokens_per_day) VALUES (%s, '', true, now(), NULL, NULL, NULL, NULL, NULL)",
            [name],
        )
    try:
        yield source, name
    finally:
        with server(source) as conn:
            conn.execute("DELETE FROM hosting_tenant WHERE name = %s", [name])


def test_the_readme_backup_restores_into_a_fresh_and_into_a_migrated_database(kept_tenant, fresh_database, tmp_path):
    source, tenant = kept_tenant
    conn_args, password = connection_args()
    env = {**os.environ, "PGPASSWORD": password}

    dump_args, dump_target = readme_command("pg_dump")
    assert dump_target.startswith("backups/"), "the README's backup must go to backups/ (ignored by git and docker)"
    restore_args, restore_source = readme_command("pg_restore")
    assert restore_source.startswith("backups/")

    backups = tmp_path / "backups"
    backups.mkdir()
    dump = backups / "aap.dump"
    with dump.open("wb") as out:
        done = subprocess.run(
            [pg_binary("pg_dump"), *conn_args, *localised(dump_args, source)],
            stdout=out,
            stderr=subprocess.PIPE,
            env=env,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr.decode()

    def restore() -> subprocess.CompletedProcess:
        with dump.open("rb") as source_file:
            return subprocess.run(
                [pg_binary("pg_restore"), *conn_args, *localised(restore_args, fresh_database)],
                stdin=source_file,
                capture_output=True,
                env=env,
                timeout=120,
            )

    for state in ("empty, not migrated", "populated by the first restore"):
        done = restore()
        assert done.returncode == 0 and not done.stderr, f"restore into a database {state}: {done.stderr.decode()}"
        with server(fresh_database) as restored, server(source) as original:
            tenants = restored.execute("SELECT name FROM hosting_tenant").fetchall()
            assert (tenant,) in tenants
            migrations = "SELECT app, name FROM django_migrations ORDER BY app, name"
            assert restored.execute(migrations).fetchall() == original.execute(migrations).fetchall()
