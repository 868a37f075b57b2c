"""`manage.py check_database [--wait SECONDS]`: one sentence when the database cannot be used.

Run before `migrate` by `make run` and the container entrypoint: instead of the connection
pool's 30 s of retries and a traceback, the operator reads what is wrong and what to do.
"""

import time

from django.core.management.base import BaseCommand, CommandError
from django.db import connection


def _problem(exc: Exception, where: str, name: str, user: str) -> tuple[bool, str]:
    """(final, sentence): a final problem is not cured by waiting."""
    text = str(exc)
    if f'database "{name}" does not exist' in text:
        return True, (
            f"PostgreSQL at {where} has no database '{name}': create it "
            f"(createdb -h {where.rsplit(':', 1)[0]} -p {where.rsplit(':', 1)[1]} -U {user} {name}) "
            "or fix DATABASE_URL."
        )
    if "password authentication failed" in text or (f'role "{user}" does not exist' in text):
        return True, f"PostgreSQL at {where} refused user '{user}' (wrong user or password): fix DATABASE_URL."
    if "no pg_hba.conf entry" in text:
        return True, f"PostgreSQL at {where} does not accept connections from here for '{user}' (pg_hba.conf)."
    reason = (
        "connection refused"
        if "refused" in text.lower()
        else "no answer"
        if "timeout" in text.lower()
        else "unreachable"
    )
    return (
        False,
        f"PostgreSQL at {where} cannot be reached ({reason}): start it, or fix the host and port in DATABASE_URL.",
    )


class Command(BaseCommand):
    help = "Check that the database in DATABASE_URL accepts connections (waiting up to --wait seconds)."
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument(
            "--wait",
            type=float,
            default=0.0,
            help="keep trying this many seconds while the server is not up yet (e.g. in a container)",
        )

    def handle(self, *args, wait, **options):
        params = connection.settings_dict
        if connection.vendor != "postgresql":
            self.stdout.write(f"Database: {params['ENGINE'].rsplit('.', 1)[-1]} at {params['NAME']}.")
            return
        import psycopg

        host, port = params.get("HOST") or "localhost", params.get("PORT") or 5432
        name, user = params.get("NAME") or "", params.get("USER") or ""
        where = f"{host}:{port}"
        deadline = time.monotonic() + wait
        while True:
            try:
                # Straight to the server (not the pool, which retries for DATABASE_POOL_TIMEOUT).
                psycopg.connect(
                    host=host,
                    port=port,
                    dbname=name,
                    user=user,
                    password=params.get("PASSWORD") or None,
                    connect_timeout=5,
                ).close()
            except psycopg.Error as exc:
                final, sentence = _problem(exc, where, name, user)
                if final or time.monotonic() >= deadline:
                    raise CommandError(sentence) from None
                time.sleep(1)
            else:
                self.stdout.write(f"Database: PostgreSQL database '{name}' at {where} answers.")
                return
