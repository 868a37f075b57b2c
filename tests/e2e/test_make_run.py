"""`make run` (scripts/run.sh) restarted as an operator does: the demo agent is seeded only
when absent, so an edit made meanwhile survives the restart, and the demo token printed is
the same working one on every start (a new one, revoking the old, only when its file is gone)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from ..support import PYTHON, ROOT, free_port

pytestmark = pytest.mark.e2e


class MakeRun:
    def __init__(self, var, log_dir):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / "make-run.log"
        # The embedded mode of a fresh clone: no DATABASE_URL, REDIS_URL or keys in the environment.
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "HOSTING_ENCRYPTION_KEYS")
        }
        self.env.update(HOSTING_VAR_DIR=str(var), PORT=str(self.port), HOST="127.0.0.1")

    def start(self) -> str:
        """Start run.sh, wait until it serves; returns the token it printed."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(ROOT / "scripts" / "run.sh")],
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while True:
            text = self.log.read_bytes()[offset:].decode()
            if "serving on" in text:
                break
            assert self.proc.poll() is None, text[-3000:]
            assert time.monotonic() < deadline, "make run did not start serving"
            time.sleep(0.2)
        while True:
            try:
                if httpx.get(self.base_url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "make run's web process did not become healthy"
            time.sleep(0.2)
        return re.search(r"export TOKEN=(\S+)", text).group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # as Ctrl-C: run.sh stops its children cleanly
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise

    def shell(self, code: str) -> str:
        result = subprocess.run(
            [PYTHON, str(ROOT / "manage.py"), "shell", "-v", "0", "-c", code],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    def meta(self, token: str) -> dict:
        response = httpx.get(self.base_url + "/v1/meta", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert response.status_code == 200, response.text
        return {agent["name"]: agent for agent in response.json()["agents"]}

    def sessions_status(self, token: str) -> int:
        return httpx.get(
            self.base_url + "/v1/sessions", headers={"Authorization": f"Bearer {token}"}, timeout=10
        ).status_code


@pytest.fixture
def make_run(tmp_path, log_dir):
    run = MakeRun(tmp_path / "var", log_dir)
    yield run
    if getattr(run, "proc", None) is not None and run.proc.poll() is None:
        run.stop()


def test_restarting_make_run_keeps_an_admin_edit_and_the_demo_token(make_run):
    token = make_run.start()
    assert make_run.meta(token)["echo"]["title"] == "Echo"
    assert make_run.sessions_status(token) == 200
    make_run.stop()

    # What an operator does in admin between two starts: retitle the agent, change a default.
    make_run.shell(
        "from agents.models import Agent, AgentOption;"
        "Agent.objects.filter(name='echo').update(title='Echo, edited in admin');"
        "AgentOption.objects.filter(agent__name='echo', name='style').update(default='upper')"
    )

    again = make_run.start()
    assert again == token, "the same demo token on every start"
    echo = make_run.meta(again)["echo"]
    assert echo["title"] == "Echo, edited in admin"
    style = next(option for option in echo["options"] if option["name"] == "style")
    assert style["default"] == "upper"
    assert (
        make_run.shell(
            "from tenancy.models import ApiToken; print(ApiToken.objects.active().filter(tenant__name='demo').count())"
        )
        == "1"
    ), "restarts mint no further demo tokens"
    make_run.stop()

    # Without the kept token a new one is minted and the previous one stops working.
    os.remove(os.path.join(make_run.env["HOSTING_VAR_DIR"], "demo_token"))
    fresh = make_run.start()
    assert fresh != token
    assert make_run.sessions_status(fresh) == 200
    assert make_run.sessions_status(token) == 401
    assert make_run.meta(fresh)["echo"]["title"] == "Echo, edited in admin"
