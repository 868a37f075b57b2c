"""Statements are prepared from their second run on a connection (hosting/settings.py,
DATABASE_PREPARED_STATEMENTS): PostgreSQL then stops parsing them, and after a few runs
planning them. A statement run once is never prepared."""

from __future__ import annotations

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db


def _prepared(cursor, marker: str) -> int:
    cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", [f"%{marker}%"])
    return cursor.fetchone()[0]


def test_a_statement_is_prepared_on_its_second_run():
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    marker = "prepared-on-second-run"
    probe = f"SELECT %s::int + 1 /* {marker} */"
    with connection.cursor() as cursor:
        cursor.execute(probe, [1])
        assert _prepared(cursor, marker) == 0  # run once: not prepared
        cursor.execute(probe, [2])
        assert _prepared(cursor, marker) == 1
        cursor.execute(probe, [3])
        assert cursor.fetchone()[0] == 4  # the prepared statement answers as the plain one did
        assert _prepared(cursor, marker) == 1
