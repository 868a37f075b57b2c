"""The stack the bench measures: its own PostgreSQL database, Redis db index, Daphne, Celery
workers, and the fake OpenAI-compatible server, all on this machine (loopback only).

Like tests/support.Stack, with what a benchmark needs on top: several worker processes
with a chosen concurrency, Daphne's resident memory, a raised file-descriptor limit for
thousands of open streams, and a database that is emptied before each run.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from tests.support import free_port, wait_for_health, web_argv, worker_argv

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent

DEFAULT_DATABASE = "aap_bench"
DEFAULT_REDIS_DB = 13


def bench_database_url() -> str:
    """BENCH_DATABASE_URL, else DATABASE_URL's server with database `aap_bench`."""
    explicit = os.environ.get("BENCH_DATABASE_URL")
    if explicit:
        return explicit
    base = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/aap"
    return urlunsplit(urlsplit(base)._replace(path="/" + DEFAULT_DATABASE))


def bench_redis_url() -> str:
    """BENCH_REDIS_URL, else REDIS_URL's server with db index 13 (flushed at every run)."""
    explicit = os.environ.get("BENCH_REDIS_URL")
    if explicit:
        return explicit
    base = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    return urlunsplit(urlsplit(base)._replace(path=f"/{DEFAULT_REDIS_DB}"))


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1_048_576
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_kib(pid: int) -> int:
    """Resident set size of a process in KiB (VmRSS from /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def threads(pid: int) -> int:
    """How many threads a process has (Threads from /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (from /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BenchStack:
    def __init__(self, *, log_dir: Path, database_url: str | None = None, redis_url: str | None = None):
        from cryptography.fernet import Fernet

        self.database_url = database_url or bench_database_url()
        self.redis_url = redis_url or bench_redis_url()
        self.log_dir = log_dir
        self.var_dir = Path(tempfile.mkdtemp(prefix="aap-bench-var-"))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "HOSTING_VAR_DIR": str(self.var_dir),
            "AAP_WORKSPACE_ROOT": str(self.var_dir / "workspaces"),
            # Bench-only secrets, fresh for every run: never a developer's or production's.
            "SECRET_KEY": "bench-only-secret-key-" + Fernet.generate_key().decode(),
            "HOSTING_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
            "DJANGO_SETTINGS_MODULE": "hosting.settings",
            "DEBUG": "0",
            "LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL"):
            self.env.pop(name, None)
        self.web: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.others: list[subprocess.Popen] = []
        self.token = ""
        self.fake_pids: list[int] = []

    # --- data ---------------------------------------------------------------------------

    def manage(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            [PYTHON, str(ROOT / "manage.py"), *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def prepare(self, agents_file: Path) -> None:
        """Create the bench database if missing; migrate, empty and seed it (seed_demo, apply_agents)."""
        import psycopg
        from psycopg import sql

        parts = urlsplit(self.database_url)
        name = parts.path.lstrip("/")
        admin_url = urlunsplit(parts._replace(path="/postgres"))
        with psycopg.connect(admin_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        result = subprocess.run(
            [PYTHON, "-m", "bench.prepare", str(agents_file)],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"preparing the bench database failed:\n{result.stdout}\n{result.stderr}")
        self.token = result.stdout.strip().splitlines()[-1]

    def flush_redis(self) -> None:
        import redis

        # Only a Redis that scripts/services.sh started for this run is flushed.
        if "redis" in os.environ.get("AAP_SERVICES_STARTED", "").split():
            redis.Redis.from_url(self.redis_url).flushdb()

    # --- processes ----------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        return subprocess.Popen(
            argv,
            env=kw.pop("env", self.env),
            cwd=ROOT,
            stdout=kw.pop("stdout", log),
            stderr=log,
            start_new_session=True,
            **kw,
        )

    def start_web(self, wait: bool = True) -> None:
        self.web = self._spawn(
            "daphne",
            # As deployed: Daphne with the access log written through logging.
            web_argv(self.port),
        )
        if wait:
            self.wait_web()

    def wait_web(self) -> None:
        wait_for_health(self.web, self.base_url, lambda: self._tail("daphne"))

    def start_workers(self, count: int, concurrency: int, wait: bool = True) -> None:
        """Start `count` Celery worker processes (threads pool) and wait until each is ready."""
        self.stop_workers()
        for index in range(count):
            name = f"celery-{index}"
            (self.log_dir / f"{name}.log").unlink(missing_ok=True)
            self.workers.append(
                self._spawn(
                    name,
                    worker_argv(f"bench{index}-{time.time_ns()}", concurrency),
                )
            )
        if wait:
            self.wait_workers()

    def wait_workers(self) -> None:
        deadline = time.monotonic() + 90
        for index, worker in enumerate(self.workers):
            name = f"celery-{index}"
            while True:
                if worker.poll() is not None:
                    raise RuntimeError(f"celery worker exited:\n{self._tail(name)}")
                if "ready." in self._tail(name):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("celery workers did not become ready within 90 s")
                time.sleep(0.2)

    def start_fake_openai(self, tokens: int, delay_ms: float, *, by_model: bool = False) -> str:
        """Start the fake OpenAI-compatible server; returns its base URL (…/v1).

        `by_model`: the request's model name shapes each reply (tests/fakes/openai_server.py)."""
        proc = self._spawn(
            "openai-fake" + ("-by-model" if by_model else ""),
            [
                PYTHON,
                "-m",
                "tests.fakes.openai_server",
                "--port",
                "0",
                "--tokens",
                str(tokens),
                "--delay-ms",
                str(delay_ms),
                *(["--by-model"] if by_model else []),
            ],
            stdout=subprocess.PIPE,
        )
        self.others.append(proc)
        self.fake_pids.append(proc.pid)
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("http"):
            raise RuntimeError(f"the fake OpenAI server did not print its URL (got {line!r})")
        return line

    def start_process(self, name: str, argv: list[str]) -> subprocess.Popen:
        proc = self._spawn(name, argv)
        self.others.append(proc)
        return proc

    def _tail(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    @staticmethod
    def _stop(proc: subprocess.Popen | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def stop_workers(self) -> None:
        for worker in self.workers:
            self._stop(worker)
        self.workers = []

    def stop(self) -> None:
        self.stop_workers()
        for proc in self.others:
            self._stop(proc)
        self._stop(self.web)
        shutil.rmtree(self.var_dir, ignore_errors=True)
