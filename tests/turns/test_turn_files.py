"""One echo turn runs through at most 15 files of its own path (issue 28; bench/turn_files.py
says how they are counted), in the embedded mode and on the production path (PostgreSQL,
Redis and a worker): a change that spreads the turn over more files fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import _require
from ..support import ROOT

LIMIT = 15


@pytest.mark.parametrize("mode", ["embedded", "production"])
def test_one_echo_turn_stays_within_its_files(mode):
    command = [sys.executable, "-m", "bench.turn_files", "--max", str(LIMIT)]
    if mode == "production":
        # a database of its own on the suite's server; the suite's (this xdist worker's) Redis
        command += ["--database-url", _require("DATABASE_URL"), "--redis-url", _require("REDIS_URL")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    head = result.stdout.splitlines()[0]
    own = int(head.split()[0])
    assert 0 < own <= LIMIT, head
    # the files are those the turn ran: its runtime, its engine, its view and its events
    for name in (
        "agents/runtimes/echo.py",
        "sessions_app/engine/worker.py",
        "sessions_app/api/views.py",
        "sessions_app/engine/events.py",
    ):
        assert f"  {name}\n" in result.stdout, result.stdout
    if mode == "production":
        assert "infra/redis_connections.py" in result.stdout, result.stdout  # it did run with Redis
