"""Pooled PostgreSQL connections are checked only after sitting idle (infra/postgres)."""

from __future__ import annotations

import pytest

from infra.postgres import base


class Conn:
    """Stands for a psycopg connection (weak-referenceable, hashable)."""


IDLE = 1.0


@pytest.fixture(autouse=True)
def idle(monkeypatch):
    monkeypatch.setattr(base, "idle_seconds", lambda: IDLE)


@pytest.fixture
def checks(monkeypatch):
    calls: list = []
    from psycopg_pool import ConnectionPool

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(calls.append))
    return calls


def test_a_connection_never_returned_is_checked(checks):
    conn = Conn()
    base.check(conn)
    assert checks == [conn]


def test_a_connection_returned_moments_ago_is_not_checked(checks, monkeypatch):
    conn = Conn()
    monkeypatch.setattr(base.time, "monotonic", lambda: 100.0)
    base.returned(conn)
    monkeypatch.setattr(base.time, "monotonic", lambda: 100.0 + IDLE / 2)
    base.check(conn)
    assert checks == []


def test_a_connection_idle_for_a_while_is_checked_and_a_dead_one_raises(monkeypatch):
    from psycopg_pool import ConnectionPool

    conn = Conn()
    monkeypatch.setattr(base.time, "monotonic", lambda: 100.0)
    base.returned(conn)
    monkeypatch.setattr(base.time, "monotonic", lambda: 100.0 + IDLE + 0.1)

    def dead(c):
        raise OSError("server closed the connection")

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(dead))
    with pytest.raises(OSError):
        base.check(conn)


def test_the_backend_installs_its_check_and_no_reset_on_djangos_pool(monkeypatch):
    """Django builds the pool with its own check; the backend swaps in its check before the
    pool opens (the attribute names are psycopg_pool's: a library upgrade that renames them
    fails here, not in production). It sets no reset hook: with one, psycopg_pool returns
    every connection through its maintenance thread instead of inline."""
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(conninfo="", open=False, check=ConnectionPool.check_connection)
    assert hasattr(pool, "_check") and hasattr(pool, "_reset")
    monkeypatch.setattr(base.base.DatabaseWrapper, "pool", property(lambda self: pool))
    wrapper = base.DatabaseWrapper.__new__(base.DatabaseWrapper)
    assert wrapper.pool is pool
    assert pool._check is base.check and pool._reset is None


def test_a_connection_django_closes_is_recorded_before_it_goes_back_to_the_pool(checks, monkeypatch):
    """Django's close returns a pooled connection (`putconn`); the backend records it first,
    so the next checkout of that connection skips the check, even one by a thread that was
    waiting for it."""
    monkeypatch.setattr(base.time, "monotonic", lambda: 100.0)
    seen: list = []

    class Pool:
        def putconn(self, conn):
            seen.append(conn in base._returned_at)

    pool = Pool()
    monkeypatch.setitem(base.DatabaseWrapper._connection_pools, "pool-test", pool)
    settings = {
        "ENGINE": "infra.postgres",
        "NAME": "aap",
        "OPTIONS": {"pool": {"min_size": 1}},
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "TIME_ZONE": None,
        "AUTOCOMMIT": True,
        "ATOMIC_REQUESTS": False,
        "USER": "",
        "PASSWORD": "",
        "HOST": "",
        "PORT": "",
        "TEST": {},
    }
    wrapper = base.DatabaseWrapper(settings, alias="pool-test")
    conn = Conn()
    conn._pool = pool
    wrapper.connection = conn
    wrapper.close()
    assert seen == [True] and wrapper.connection is None
    base.check(conn)
    assert checks == []


def test_a_dead_connection_at_checkout_sweeps_the_pools_other_idle_ones_once(monkeypatch):
    """Connections die together (a restart, terminated backends): one found dead starts one
    check of every idle connection of its pool, on a thread, while the client backs off."""
    import threading

    from psycopg_pool import ConnectionPool

    swept = threading.Event()
    release = threading.Event()

    class Pool:
        calls = 0

        def check(self):
            Pool.calls += 1
            swept.set()
            release.wait(5)

    def dead(c):
        raise OSError("server closed the connection")

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(dead))
    first, second = Conn(), Conn()
    first._pool = second._pool = Pool()
    with pytest.raises(OSError):
        base.check(first)
    assert swept.wait(5)
    with pytest.raises(OSError):
        base.check(second)  # a sweep is at work already: no second one
    release.set()
    for _ in range(100):
        if not base._sweeping.locked():
            break
        threading.Event().wait(0.01)
    assert Pool.calls == 1 and not base._sweeping.locked()
