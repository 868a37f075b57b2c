"""The web process's access log (infra/webserver.py, the compose web role's server): one
JSON line per response with the route and the status, never the query string — where events
tickets travel — and health probes only at DEBUG."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from tests.support import ROOT, free_port, wait_for_health, web_argv

pytestmark = pytest.mark.e2e

TICKET = "aapt_0123456789abcdefSECRETTICKET"


@pytest.fixture
def web(django_db_setup, django_db_blocker, tmp_path):
    from django.db import connection

    parts = urlsplit(os.environ["DATABASE_URL"])
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": urlunsplit(parts._replace(path="/" + connection.settings_dict["NAME"])),
        "LOG_FORMAT": "json",
        "LOG_LEVEL": "INFO",
        "HOSTING_VAR_DIR": str(tmp_path / "var"),
    }
    log = tmp_path / "web.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            web_argv(port),
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base_url, log.read_text)
        yield base_url, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def access_lines(log) -> list[dict]:
    lines = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"a line that is not JSON: {line!r}") from None
        if record.get("logger") == "hosting.access":
            lines.append(record)
    return lines


def test_access_lines_are_json_with_route_and_status_and_no_query_string(web):
    base_url, log = web
    session = "0f5b1c2e-8d4a-4c1e-9a57-6e1d2c3b4a59"
    for _ in range(3):
        assert httpx.get(base_url + "/healthz", timeout=10).status_code == 200
    events = httpx.get(f"{base_url}/v1/sessions/{session}/turns/t1/events?ticket={TICKET}", timeout=10)
    assert events.status_code in (401, 403, 404)
    assert httpx.get(base_url + "/v1/meta?ticket=" + TICKET, timeout=10).status_code in (200, 401)

    text = log.read_text()
    assert TICKET not in text and "ticket=" not in text
    lines = access_lines(log)
    by_route = {line["route"]: line for line in lines}
    assert "/healthz" not in by_route, "healthchecks log at DEBUG only"
    line = next(line for line in lines if "events" in line["route"])
    assert line["status"] == events.status_code and line["method"] == "GET" and line["level"] == "INFO"
    assert "<" in line["route"] and session not in line["route"], line  # the pattern, not the ids
    assert "/v1/meta" in by_route
