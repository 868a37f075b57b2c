"""`manage.py grant_worker_role`: the PostgreSQL role the Celery workers log in as.

The workers run turns, and ACP agents beside them: a worker writes sessions, turns, messages and
its own heartbeat row (the tables of `sessions_app`), reads agents and tenants, and never changes
either. Its own role makes that a rule of the database rather than of the code: a worker that
runs something it should not still cannot rewrite an agent's definition (its command, its
sandbox settings, its secrets) or a tenant's limits, nor read API token hashes or admin accounts.

The role is the user of AAP_WORKER_DATABASE_URL (its password too); this command, run with the
owner's DATABASE_URL, creates it or sets its password and attributes, then grants exactly:

    CONNECT on the database, USAGE on the schema
    SELECT, INSERT, UPDATE, DELETE   the tables of sessions_app, and agents' McpToolList
    SELECT                           the other tables of hosting and agents, except API tokens
    UPDATE (updated_at)              agents_agent: that column only

McpToolList holds what an agent's MCP servers answered to `tools/list`, which the workers
ask them (the web never starts a server: agents.mcp_registry); nothing of the agent's
definition is in it. When a server says its list changed, the worker stores the new one and
moves the agent's `updated_at` (its revision, which every process's cache of the agent
follows): a timestamp, nothing of the definition.

and revokes everything else on the schema's tables, so it is safe to run again (the container
entrypoint's `init` runs it after every `migrate`, which covers tables a release adds). Without
AAP_WORKER_DATABASE_URL, or when it names the owner itself, it does nothing.
"""

import os

import dj_database_url
from django.apps import apps
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection, transaction

# The apps whose tables a worker writes, and those it only reads; every other table (Django's
# auth, admin, sessions, axes) is out of its reach.
WRITES = ("sessions_app",)
READS = ("hosting", "agents")
HIDDEN = {"hosting.ApiToken"}  # token hashes: only the web authenticates
WRITTEN = {"agents.McpToolList"}  # of the read-only apps, the tables a worker writes too
# Of the read-only tables, the columns a worker updates: an agent's revision (agents.mcp_registry).
COLUMNS_WRITTEN = {"agents.Agent": ("updated_at",)}


def tables(labels) -> list[str]:
    names = set()
    for label in labels:
        for model in apps.get_app_config(label).get_models(include_auto_created=True):
            if model._meta.managed and not model._meta.proxy and model._meta.label not in HIDDEN:
                names.add(model._meta.db_table)
    return sorted(names)


def written_tables() -> list[str]:
    """Every table a worker writes: those of WRITES, and WRITTEN."""
    return sorted({*tables(WRITES), *(apps.get_model(label)._meta.db_table for label in WRITTEN)})


def read_tables() -> list[str]:
    """The tables a worker only reads."""
    return [name for name in tables(READS) if name not in written_tables()]


class Command(BaseCommand):
    help = "Create or update the workers' database role (AAP_WORKER_DATABASE_URL) and grant what a worker needs."
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument(
            "--url",
            default=os.environ.get("AAP_WORKER_DATABASE_URL", ""),
            help="the workers' database URL (default: $AAP_WORKER_DATABASE_URL)",
        )

    def handle(self, *args, url, **options):
        if not url:
            self.stdout.write("Workers use DATABASE_URL (no AAP_WORKER_DATABASE_URL): no role to grant.")
            return
        if connection.vendor != "postgresql":
            raise CommandError("AAP_WORKER_DATABASE_URL needs PostgreSQL (DATABASE_URL names another database).")
        worker = dj_database_url.parse(url)
        owner = connection.settings_dict
        role, password = worker.get("USER") or "", worker.get("PASSWORD") or ""
        if worker.get("NAME") != owner.get("NAME"):
            raise CommandError(
                f"AAP_WORKER_DATABASE_URL names database '{worker.get('NAME')}', DATABASE_URL '{owner.get('NAME')}': "
                "they must be the same."
            )
        if not role or role == owner.get("USER"):
            self.stdout.write(f"Workers log in as the owner '{owner.get('USER')}': no role to grant.")
            return
        if not password:
            raise CommandError("AAP_WORKER_DATABASE_URL has no password: set one (POSTGRES_WORKER_PASSWORD in .env).")

        from psycopg import errors, sql

        connection.ensure_connection()
        raw = connection.connection
        # Only the SCRAM verifier reaches the server (never the password, e.g. in its statement log).
        verifier = raw.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256").decode()
        writes, reads = written_tables(), read_tables()
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_schema(), current_database()")
            schema, database = cursor.fetchone()
            existing = set(connection.introspection.table_names(cursor))
            writes = [t for t in writes if t in existing]
            reads = [t for t in reads if t in existing]

            def run(statement: sql.SQL, **names) -> None:
                cursor.execute(statement.format(**names).as_string(raw))

            who, in_schema = sql.Identifier(role), sql.Identifier(schema)
            try:
                with transaction.atomic():
                    cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
                    made = cursor.fetchone() is None
                    run(
                        sql.SQL(
                            "{verb} {who} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS "
                            "PASSWORD {password}"
                        ),
                        verb=sql.SQL("CREATE ROLE" if made else "ALTER ROLE"),
                        who=who,
                        password=sql.Literal(verifier),
                    )
                    run(sql.SQL("GRANT CONNECT ON DATABASE {db} TO {who}"), db=sql.Identifier(database), who=who)
                    run(sql.SQL("GRANT USAGE ON SCHEMA {schema} TO {who}"), schema=in_schema, who=who)
                    # Whatever an earlier release granted goes first: only the lists below remain.
                    run(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {who}"), schema=in_schema, who=who)
                    run(sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {who}"), schema=in_schema, who=who)
                    if reads:
                        run(sql.SQL("GRANT SELECT ON {tables} TO {who}"), tables=_list(reads), who=who)
                    if writes:
                        run(
                            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {tables} TO {who}"),
                            tables=_list(writes),
                            who=who,
                        )
                    for label, columns in COLUMNS_WRITTEN.items():
                        table = apps.get_model(label)._meta.db_table
                        if table in existing:
                            run(
                                sql.SQL("GRANT UPDATE ({columns}) ON {table} TO {who}"),
                                columns=_list(columns),
                                table=sql.Identifier(table),
                                who=who,
                            )
            except DatabaseError as exc:
                if not isinstance(exc.__cause__, errors.InsufficientPrivilege):
                    raise
                raise CommandError(
                    f"The owner '{owner.get('USER')}' may not manage role '{role}' ({str(exc).strip()}): "
                    "create the role as a superuser, or give the owner CREATEROLE."
                ) from None
        self.stdout.write(
            f"Worker role '{role}' {'created' if made else 'updated'}: writes {len(writes)} tables "
            f"({', '.join(writes)}), reads {len(reads)}."
        )


def _list(names):
    from psycopg import sql

    return sql.SQL(", ").join(sql.Identifier(name) for name in names)
