"""The Docker Compose deployment run without a Docker engine: deploy/entrypoint.sh runs its
roles as the containers would (first-run, init, web, worker against a fresh PostgreSQL
database and a Redis database of their own), the deployment serves the agents of the mounted
file, the healthchecks pass with a public-only ALLOWED_HOSTS, and `--scale worker=N` stays
under PostgreSQL's max_connections. The files themselves are read in
tests/unit/test_compose_files.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import yaml

from ..support import BIN, PYTHON, ROOT, free_port, log_message, side_redis_db
from ..unit.test_compose_files import compose, default_of


@pytest.fixture(scope="module")
def shims(tmp_path_factory) -> Path:
    """python (the web role's server) and celery stand-ins that print what the entrypoint hands them."""
    path = tmp_path_factory.mktemp("shims")
    for name in ("python", "celery"):
        shim = path / name
        shim.write_text('#!/bin/sh\necho "pool=$DATABASE_POOL_MAX args=$*"\n')
        shim.chmod(0o755)
    return path


def entrypoint_says(shims: Path, role: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "WORKER_", "AAP_WEB"))}
    environ.update(env, PATH=f"{shims}:{environ['PATH']}", HOSTING_VAR_DIR=str(shims / "var"))
    result = subprocess.run(
        [str(ROOT / "deploy" / "entrypoint.sh"), role], env=environ, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_scaling_workers_stays_under_postgres_max_connections(shims):
    services = compose()["services"]
    max_connections = int(
        re.search(r"max_connections=(\d+)", default_of(" ".join(services["postgres"]["command"]))).group(1)
    )
    pools = {}
    for role in ("web", "worker", "beat"):
        said = entrypoint_says(shims, role)
        pools[role] = int(re.search(r"pool=(\d+)", said).group(1))
    worker = entrypoint_says(shims, "worker")
    concurrency = int(re.search(r"--concurrency (\d+)", worker).group(1))
    assert pools["worker"] > concurrency, "a worker's pool serves every thread of it"
    reserved = 3 + 2  # PostgreSQL's superuser slots, a one-off `run --rm init` or psql
    workers = 10
    used = pools["web"] + workers * pools["worker"] + pools["beat"] + reserved
    assert used <= max_connections, (
        f"--scale worker={workers} needs {used} connections, max_connections={max_connections}"
    )
    # Both knobs move together: more threads, a bigger pool.
    assert "pool=20 " in entrypoint_says(shims, "worker", WORKER_CONCURRENCY="16")
    assert "--concurrency 16" in entrypoint_says(shims, "worker", WORKER_CONCURRENCY="16")
    assert "pool=7 " in entrypoint_says(shims, "worker", DATABASE_POOL_MAX="7") + " "


def test_json_logs_have_no_banner_and_the_web_role_logs_access_through_logging(shims):
    web = entrypoint_says(shims, "web")
    assert "args=-m infra.webserver -b 0.0.0.0 -p 8000 hosting.asgi:application" in web
    for role in ("worker", "beat"):
        assert "args=-A hosting --quiet " in entrypoint_says(shims, role), role
        assert "--quiet" not in entrypoint_says(shims, role, LOG_FORMAT="plain"), role


# --- live: the entrypoint's roles, as the containers run them --------------------------------


class Deployment:
    """deploy/entrypoint.sh run the way docker-compose.yml runs it, against real services."""

    def __init__(self, env: dict, log_dir: Path):
        self.env, self.log_dir, self.procs = env, log_dir, []

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(ROOT / "deploy" / "entrypoint.sh"), *args],
            env={**self.env, **env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def start(self, role: str, *args: str, **env: str) -> subprocess.Popen:
        log = open(self.log_dir / f"deploy-{role}.log", "ab")
        proc = subprocess.Popen(
            [str(ROOT / "deploy" / "entrypoint.sh"), role, *args],
            env={**self.env, **env},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def log(self, role: str) -> str:
        path = self.log_dir / f"deploy-{role}.log"
        return path.read_text() if path.exists() else ""

    def healthcheck(self, role: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PYTHON, str(ROOT / "deploy" / "healthcheck.py"), role],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, log_dir):
    import psycopg
    from cryptography.fernet import Fernet

    # The suite's server; its maintenance database hosts CREATE/DROP DATABASE.
    server = urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path="/postgres"))
    name = f"aap_deploy_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    # The workers' role, as docker-compose.yml names it (roles belong to the server: a name of its own).
    role, password = f"aap_worker_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    database = urlsplit(urlunsplit(urlsplit(server)._replace(path="/" + name)))
    worker_url = urlunsplit(database._replace(netloc=f"{role}:{password}@{database.hostname}:{database.port or 5432}"))
    # A Redis database apart from the suite's queues.
    redis_url = urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{side_redis_db(3)}"))
    var = tmp_path_factory.mktemp("deploy-var")
    (var / "config").mkdir()
    port = free_port()
    # The environment docker-compose.yml gives the app containers, with the .env of the README.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AAP_", "DATABASE_", "HOSTING_", "OPENAI_"))}
    env.update(
        {
            "PATH": f"{BIN}:{env['PATH']}",
            "PYTHON": PYTHON,
            "SECRET_KEY": uuid.uuid4().hex * 2,
            "HOSTING_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
            "DATABASE_URL": urlunsplit(urlsplit(server)._replace(path="/" + name)),
            "AAP_WORKER_DATABASE_URL": worker_url,
            "REDIS_URL": redis_url,
            "AAP_WORKSPACE_ROOT": str(var / "workspaces"),
            "HOSTING_VAR_DIR": str(var),
            # The operator's file does not exist yet: first-run makes it from the example.
            "AAP_AGENTS_FILE": str(var / "config" / "agents.yaml"),
            "AAP_AGENTS_EXAMPLE": str(ROOT / "deploy" / "agents.example.yaml"),
            "ALLOWED_HOSTS": "aap.example.com",  # a public name only: the healthcheck must still pass
            "PORT": str(port),
            "BIND_ADDRESS": "127.0.0.1",
            "WORKER_CONCURRENCY": "2",
            "LOG_LEVEL": "INFO",
        }
    )
    deploy = Deployment(env, log_dir)
    deploy.base_url = f"http://127.0.0.1:{port}"
    deploy.worker_env = {"DATABASE_URL": worker_url, "POSTGRES_PASSWORD": ""}  # the worker service's own
    try:
        yield deploy
    finally:
        deploy.stop()
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_the_deployment_serves_the_mounted_agents_and_its_first_tenant(deployment):
    first = deployment.run("first-run")
    assert first.returncode == 0, first.stderr
    token = first.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"aap_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}", token), first.stdout
    assert "applied the agents of" in first.stderr

    # Every later `up` runs init again: idempotent, and no token is ever printed again.
    again = deployment.run("first-run")
    assert again.returncode == 0, again.stderr
    assert not re.search(r"aap_[0-9a-f]{8}_", again.stdout + again.stderr), again.stdout
    assert "exists" in again.stderr
    assert deployment.run("init").returncode == 0

    web = deployment.start("web")
    worker = deployment.start("worker", **deployment.worker_env)  # as the role init granted
    headers = {"Host": "aap.example.com", "Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + 90
    while True:
        assert web.poll() is None, deployment.log("web")[-3000:]
        try:
            if httpx.get(deployment.base_url + "/healthz", headers=headers, timeout=3).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the web role did not become healthy"
        time.sleep(0.3)

    meta = httpx.get(deployment.base_url + "/v1/meta", headers=headers, timeout=10).json()
    created = Path(deployment.env["AAP_AGENTS_FILE"])
    assert created.read_text() == (ROOT / "deploy" / "agents.example.yaml").read_text()
    mounted = [a["name"] for a in yaml.safe_load(created.read_text())["agents"]]
    assert [a["name"] for a in meta["agents"]] == mounted

    # The worker role runs the tenant's turns.
    while not any(" ready." in log_message(line) for line in deployment.log("worker").splitlines()):
        assert worker.poll() is None, deployment.log("worker")[-3000:]
        assert time.monotonic() < deadline + 60, "the worker role did not become ready"
        time.sleep(0.3)
    session = httpx.post(
        deployment.base_url + "/v1/sessions", headers=headers, json={"agent": {"name": "echo"}}, timeout=10
    )
    assert session.status_code == 201, session.text
    turn = httpx.post(
        f"{deployment.base_url}/v1/sessions/{session.json()['sessionId']}/turns",
        headers=headers,
        json={"messages": [{"role": "user", "content": "hello deploy"}]},
        timeout=60,
    )
    assert turn.status_code == 200, turn.text
    assert "echo: hello deploy" in turn.text

    # The containers' healthchecks pass with a public name as the only allowed host...
    for role in ("web", "worker"):
        result = deployment.healthcheck(role)
        assert result.returncode == 0, f"{role}: {result.stderr}"
    # ...where the API refuses a request naming 127.0.0.1.
    assert (
        httpx.get(deployment.base_url + "/v1/meta", headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code
        == 400
    )
    assert token not in deployment.log("web") + deployment.log("worker")


def test_the_worker_role_runs_the_sweep_but_cannot_change_agents_or_read_tokens(deployment):
    import psycopg

    assert deployment.run("init").returncode == 0  # granting again changes nothing
    # The periodic sweep runs on a worker: as its role.
    sweep = deployment.run(
        "python",
        "manage.py",
        "shell",
        "-v",
        "0",
        "-c",
        "from sessions_app.tasks import sweep_stale_turns; sweep_stale_turns(); print('swept')",
        **deployment.worker_env,
    )
    assert sweep.returncode == 0 and sweep.stdout.strip() == "swept", sweep.stderr
    with psycopg.connect(deployment.worker_env["DATABASE_URL"], autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM agents_agent").fetchone()[0] >= 1
        assert conn.execute("SELECT count(*) FROM hosting_tenant").fetchone()[0] >= 1
        denied = (
            "UPDATE agents_agent SET runtime_config = '{}'",
            "UPDATE agents_agentoption SET \"default\" = ''",
            "DELETE FROM agents_servertool",
            "INSERT INTO agents_agent_tenants (agent_id, tenant_id) SELECT a.id, t.id FROM agents_agent a, hosting_tenant t",
            "UPDATE hosting_tenant SET max_running_turns = 0",
            "SELECT token_hash FROM hosting_apitoken",
            "SELECT password FROM auth_user",
            "CREATE TABLE agents_shadow (id int)",
        )
        for statement in denied:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
        # An agent's revision is the one column it may move (an MCP server's list changed).
        with conn.transaction():
            conn.execute("SELECT id FROM agents_agent FOR UPDATE")
            conn.execute("UPDATE agents_agent SET updated_at = updated_at")


def test_init_seeds_the_demo_on_request_without_printing_a_token(deployment):
    result = deployment.run("init", AAP_SEED_DEMO="true")
    assert result.returncode == 0, result.stderr
    assert not re.search(r"aap_[0-9a-f]{8}_", result.stdout + result.stderr), "no token in a container's log"
    count = deployment.run(
        "python",
        "manage.py",
        "shell",
        "-v",
        "0",
        "-c",
        "from tenancy.models import ApiToken, Tenant;"
        "print(Tenant.objects.filter(name='demo').count(), ApiToken.objects.filter(tenant__name='demo').count())",
    )
    assert count.stdout.split() == ["1", "0"], count.stderr


def test_init_says_in_one_sentence_when_the_database_is_missing(deployment):
    env = dict(deployment.env, DATABASE_URL=deployment.env["DATABASE_URL"] + "_absent", AAP_DATABASE_WAIT_SECONDS="1")
    result = subprocess.run(
        [str(ROOT / "deploy" / "entrypoint.sh"), "init"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "has no database" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_beat_role_logs_its_sweeps_at_debug_and_its_healthcheck_follows_its_file(deployment):
    # At DEBUG, to see the sweeps it sends: each line about one must say DEBUG, never INFO.
    beat = deployment.start("beat", LOG_LEVEL="DEBUG")
    var = Path(deployment.env["HOSTING_VAR_DIR"])
    deadline = time.monotonic() + 60
    while not list(var.glob("celerybeat-schedule*")):
        assert beat.poll() is None, deployment.log("beat")[-3000:]
        assert time.monotonic() < deadline, "beat wrote no schedule file"
        time.sleep(0.3)
    assert deployment.healthcheck("beat").returncode == 0

    def sweep_lines() -> list[dict]:
        lines = [json.loads(line) for line in deployment.log("beat").splitlines() if line.startswith("{")]
        return [line for line in lines if "sweep" in line.get("message", "")]

    while not sweep_lines():  # due every 10 s
        assert beat.poll() is None, deployment.log("beat")[-3000:]
        assert time.monotonic() < deadline + 30, "beat sent no sweep"
        time.sleep(0.5)
    assert {line["level"] for line in sweep_lines()} == {"DEBUG"}

    os.killpg(beat.pid, signal.SIGTERM)
    beat.wait(20)
    old = time.time() - 3600
    for path in var.glob("celerybeat-schedule*"):
        os.utime(path, (old, old))
    stale = deployment.healthcheck("beat")
    assert stale.returncode == 1 and "not been written" in stale.stderr
