"""The fault-injection suite's stack: its own PostgreSQL and Redis servers (so tests may
stop, kill and restart them), a Daphne, two Celery workers and a beat, all real processes.

Run by `make chaos` (AAP_CHAOS=1); `make test` does not collect these tests. Each test
leaves the stack as it found it (`chaos.ensure_up()` at the start restarts whatever a
previous test left down).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import _seed
from ..support import BIN, Stack, free_port

if os.environ.get("AAP_CHAOS") != "1":
    # Faults take minutes and their own servers: only `make chaos` runs them.
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    # The suite runs without pytest-django (it has no test database); tests/conftest.py marks every item.
    config.addinivalue_line("markers", "django_db: unused here (tests/conftest.py marks every test)")


CHAOS_ENV = {
    "AAP_SSE_PING_SECONDS": "1",
    "AAP_TURN_LEASE_SECONDS": "3",
    "AAP_STREAM_RETRY_SECONDS": "20",
    "AAP_WORKER_POLL_SECONDS": "1",
    "AAP_DB_RETRY_SECONDS": "60",
    "DATABASE_POOL_TIMEOUT": "10",
    # Faults, not fair share: the tenant's limits would refuse the burst with 429 at the door.
    "AAP_TENANT_MAX_RUNNING_TURNS": "0",
    "AAP_TENANT_TURNS_PER_MINUTE": "0",
    # A client that reads nothing is dropped after this (test_slow_readers).
    "AAP_RESPONSE_STALL_SECONDS": "5",
    "LOG_LEVEL": "INFO",
    "DEBUG": "0",
    "PYTHONUNBUFFERED": "1",
}


def _pg_bindir() -> Path:
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "initdb").exists():
            return candidate
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) are not installed: apt-get install postgresql")


class Postgres:
    """A throwaway PostgreSQL server on a fixed port (it keeps its port across restarts).
    As root it runs as the `postgres` user (or nobody), like scripts/services.sh does."""

    def __init__(self, root: Path):
        self.bindir = _pg_bindir()
        self.root = root
        self.data = root / "pg"
        self.sockets = root / "pgrun"
        self.log = root / "postgres.log"
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/aap"
        self.runas: list[str] = []
        if os.geteuid() == 0:
            user = os.environ.get("AAP_SERVICES_USER") or ("postgres" if _user_exists("postgres") else "nobody")
            self.runas = ["runuser", "-u", user, "--"]

    def _run(self, *argv: str, timeout: float = 90) -> None:
        result = subprocess.run([*self.runas, *argv], cwd=self.root, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed: {result.stdout}{result.stderr}{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def init(self) -> None:
        self.data.mkdir()
        self.sockets.mkdir()
        self.log.touch()
        if self.runas:
            user = self.runas[2]
            shutil.chown(self.data, user)
            shutil.chown(self.sockets, user)
            shutil.chown(self.log, user)
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.sockets}'\nmax_connections = 200\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
            )
        self.start()
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE aap")

    def start(self) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def restart_fast(self) -> None:
        """What a failover or an operator's `pg_ctl restart -m fast` does: every connection dies."""
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-m",
            "fast",
            "-w",
            "-t",
            "60",
            "restart",
        )

    def _pids(self) -> list[int]:
        """The postmaster and every process it started (backends, checkpointer, ...)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
        return [postmaster, *map(int, children)]

    def freeze(self) -> list[int]:
        """A stall (a saturated disk, a paused VM): every PostgreSQL process stops where it
        is. Connections stay open and statements hang; nothing fails. Returns the pids."""
        pids = self._pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def thaw(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def running(self) -> bool:
        result = subprocess.run(
            [*self.runas, str(self.bindir / "pg_ctl"), "-D", str(self.data), "status"],
            capture_output=True,
            cwd=self.root,
        )
        return result.returncode == 0

    def stop(self) -> None:
        if self.data.exists() and self.running():
            subprocess.run(
                [
                    *self.runas,
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(self.data),
                    "-m",
                    "immediate",
                    "-w",
                    "-t",
                    "30",
                    "stop",
                ],
                capture_output=True,
                cwd=self.root,
            )


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


class RedisServer:
    """A throwaway redis-server on a fixed port, without persistence (a restart loses its data)."""

    def __init__(self, root: Path):
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.root = root
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root),
                "--logfile",
                str(self.root / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        import redis

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=1).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 20 s")

    def stop(self) -> None:
        """SIGKILL: the server is gone at once, with everything it held."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ChaosStack(Stack):
    """The service on its own servers: Daphne, workers `a` and `b` (4 threads each), beat."""

    WORKER_THREADS = 4

    def __init__(self, root: Path, log_dir: Path):
        self.pg = Postgres(root)
        self.redis = RedisServer(root)
        from cryptography.fernet import Fernet

        env = {
            **CHAOS_ENV,
            "DATABASE_URL": self.pg.url,
            "REDIS_URL": self.redis.url,
            "SECRET_KEY": "chaos-only-secret-key-not-for-production-0123456789abcdefghijklmnop",
            "HOSTING_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
            "HOSTING_VAR_DIR": str(root / "var"),
            "AAP_WORKSPACE_ROOT": str(root / "workspaces"),
        }
        super().__init__("chaos", env, log_dir)
        self.workers: dict[str, subprocess.Popen] = {}
        self.beat: subprocess.Popen | None = None
        self.root = root

    # --- processes ---------------------------------------------------------------------------

    def start_named_worker(self, label: str) -> subprocess.Popen:
        proc = self.spawn_worker(f"worker-{label}", self.WORKER_THREADS)
        self.workers[label] = proc
        return proc

    def worker_alive(self, label: str) -> bool:
        proc = self.workers.get(label)
        return proc is not None and proc.poll() is None

    def signal_worker(self, label: str, sig: int) -> subprocess.Popen:
        proc = self.workers[label]
        os.killpg(proc.pid, sig)
        return proc

    def stop_worker(self, label: str, timeout: float = 60) -> None:
        """A warm shutdown (SIGTERM), waited for."""
        proc = self.workers.get(label)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)

    def kill_web(self) -> None:
        os.killpg(self.web.pid, signal.SIGKILL)
        self.web.wait(10)

    def start_beat(self) -> None:
        self.beat = self._spawn(
            "beat",
            [
                str(BIN / "celery"),
                "-A",
                "hosting",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(self.root / "celerybeat-schedule"),
            ],
        )

    def ensure_up(self, workers: tuple[str, ...] = ("a", "b")) -> None:
        """Whatever a previous test stopped runs again; workers not named are stopped."""
        if not self.pg.running():
            self.pg.start()
        if not self.redis.running():
            self.redis.start()
        if self.web is None or self.web.poll() is not None:
            self.start_web()
        for label in ("a", "b"):
            if label in workers and not self.worker_alive(label):
                self.start_named_worker(label)
            elif label not in workers:
                self.stop_worker(label)
        if self.beat is None or self.beat.poll() is not None:
            self.start_beat()

    def stop_all(self) -> None:
        for proc in [*self.workers.values(), self.beat, self.web]:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        self.redis.stop()
        self.pg.stop()


@pytest.fixture(scope="session")
def chaos(tmp_path_factory) -> ChaosStack:
    import tempfile

    # Not under pytest's own 0700 directory: PostgreSQL runs as another user when we are root.
    root = Path(tempfile.mkdtemp(prefix="aap-chaos-"))
    root.chmod(0o755)
    logs = tmp_path_factory.mktemp("chaos-logs")
    stack = ChaosStack(root, logs)
    try:
        stack.pg.init()
        stack.redis.start()
        stack.manage("migrate", "--noinput", "-v0")
        _seed(stack)
        stack.ensure_up()
        yield stack
    finally:
        stack.stop_all()
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nchaos logs: {logs}")
