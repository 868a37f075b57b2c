"""`/metrics`: Prometheus families from the web and the worker processes after real turns
(Daphne + Celery + PostgreSQL + Redis; the model provider is the fake OpenAI server)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.openai_server import FakeOpenAI

from ..support import ROOT, llm_agent, side_redis_db
from .observed import METRICS_TOKEN, new_tenant, observed_stack

pytestmark = pytest.mark.e2e

TURNS_ROUTE = "/v1/sessions/<id:session_id>/turns"
CLIENT_TOOL = {"name": "lookup", "description": "Looks a word up.", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def fake_llm():
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def metered(pg_stack, log_dir, tmp_path_factory, fake_llm):
    directory = tmp_path_factory.mktemp("prometheus")
    stale = directory / "counter_999999.db"  # a dead process's samples from an earlier run
    stale.write_bytes(b"")
    pg_stack.apply_agents([llm_agent("metered-llm", fake_llm.url, api_key="sk-metered-operator-key")])
    stack = observed_stack(
        pg_stack,
        log_dir,
        "metered",
        {"AAP_METRICS": "token", "AAP_METRICS_TOKEN": METRICS_TOKEN, "PROMETHEUS_MULTIPROC_DIR": str(directory)},
        redis_db=side_redis_db(0),
    )
    stack.metrics_dir = directory
    yield stack
    stack.stop()


def scrape(stack, token: str | None = METRICS_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(stack.base_url + "/metrics", headers=headers, timeout=30)


def samples(stack) -> dict[tuple[str, frozenset], float]:
    response = scrape(stack)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    found = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and wanted <= ls)


def test_metrics_need_the_metrics_token(metered):
    for token in (None, "wrong-token", metered.tokens["demo"]):
        response = scrape(metered, token)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert "AAP_METRICS_TOKEN" in response.json()["error"]
    assert httpx.post(metered.base_url + "/metrics", timeout=10).status_code == 405


def test_metrics_are_off_by_default(pg_stack):
    response = httpx.get(pg_stack.base_url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 404
    assert "AAP_METRICS" in response.json()["error"]


def test_the_directory_starts_without_dead_processes_files(metered):
    assert not (metered.metrics_dir / "counter_999999.db").exists()
    pids = {int(p.stem.rsplit("_", 1)[1]) for p in Path(metered.metrics_dir).glob("*.db")}
    assert metered.web.pid in pids  # the web process writes its own samples here


def test_turns_show_up_in_web_and_worker_families(metered, fake_llm):
    tenant = new_tenant(metered)
    client = metered.client(tenant)
    try:
        session = client.create_session("echo", tools=[CLIENT_TOOL])
        delta = client.turn(session, text="hello metrics", stream="delta")
        thinking = client.turn(session, text="/think slowly", stream="delta")
        tool = client.turn(session, text="/tool lookup {}", stream="delta")
        answered = client.turn(
            session, [{"role": "tool", "toolCallId": tool.tool_calls()[0]["toolCallId"], "content": "found"}]
        )
        failed = client.turn(session, text="/error")
        assert [
            delta.stop_reason,
            thinking.stop_reason,
            tool.stop_reason,
            answered.stop_reason,
            failed.stop_reason,
        ] == ["end_turn", "end_turn", "tool_use", "end_turn", "error"]
        missing = client.turn("sess_doesnotexist", text="hi")
        assert missing.status == 404

        fake_llm.enqueue(FakeOpenAI.text("one", usage=(11, 3)), FakeOpenAI.text("two", usage=(13, 5)))
        llm = client.create_session("metered-llm")
        assert client.turn(llm, text="first", stream="delta").stop_reason == "end_turn"
        assert client.turn(llm, text="second").stop_reason == "end_turn"
    finally:
        client.close()

    found = samples(metered)
    # Web process: requests by route pattern and status, turns accepted.
    assert value(found, "aap_http_requests_total", route=TURNS_ROUTE, method="POST", status="200") >= 7
    assert value(found, "aap_http_requests_total", route=TURNS_ROUTE, method="POST", status="404") >= 1
    assert value(found, "aap_http_request_duration_seconds_count", route=TURNS_ROUTE, method="POST") >= 8
    assert value(found, "aap_turns_started_total", agent="echo", tenant=tenant, stream="delta") == 3
    assert value(found, "aap_turns_started_total", agent="echo", tenant=tenant, stream="none") == 2
    assert value(found, "aap_turns_started_total", agent="metered-llm", tenant=tenant) == 2
    streamed = [delta, thinking, tool]
    assert value(found, "aap_events_relayed_total", mode="delta") >= sum(len(r.events) for r in streamed)
    assert value(found, "aap_turn_first_event_seconds_count") >= 3
    # Worker process: turns finished by stop reason, turn time, queue wait, model tokens.
    assert value(found, "aap_turns_finished_total", agent="echo", tenant=tenant, stop_reason="end_turn") == 3
    assert value(found, "aap_turns_finished_total", agent="echo", tenant=tenant, stop_reason="tool_use") == 1
    assert value(found, "aap_turns_finished_total", agent="echo", tenant=tenant, stop_reason="error") == 1
    assert value(found, "aap_turn_duration_seconds_count", agent="echo") >= 5
    assert value(found, "aap_turn_queue_wait_seconds_count") >= 7
    assert value(found, "aap_llm_tokens_total", agent="metered-llm", tenant=tenant, kind="prompt") == 24
    assert value(found, "aap_llm_tokens_total", agent="metered-llm", tenant=tenant, kind="completion") == 8
    assert value(found, "aap_llm_calls_total", agent="metered-llm") >= 2
    # Read at scrape time; and the ACP process families are there before any process ran.
    assert ("aap_turns_queued", frozenset()) in found
    assert ("aap_turns_running", frozenset()) in found
    for family in ("aap_acp_processes_started_total", "aap_acp_processes_killed_total", "aap_acp_processes_alive"):
        assert (family, frozenset()) in found, family
    # Nothing a user typed or any secret is in the exposition.
    text = scrape(metered).text
    for leaked in ("hello metrics", "found", "sk-metered-operator-key", metered.tokens[tenant]):
        assert leaked not in text


def test_429s_are_counted_by_the_limit_that_refused_them(metered, tmp_path):
    tenant = new_tenant(metered)
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"tenants": [{"name": tenant, "limits": {"turnsPerMinute": 1}}]}))
    metered.manage("apply_agents", str(path))
    before = value(samples(metered), "aap_rate_limited_total", limit="turnsPerMinute")
    client = metered.client(tenant)
    try:
        session = client.create_session("echo")
        assert client.turn(session, text="one").status == 200
        refused = client.turn(session, text="two")
    finally:
        client.close()
    assert refused.status == 429 and refused.body["details"] == {"limit": "turnsPerMinute"}
    found = samples(metered)
    assert value(found, "aap_rate_limited_total", limit="turnsPerMinute") == before + 1
    assert value(found, "aap_http_requests_total", route=TURNS_ROUTE, method="POST", status="429") >= 1


def test_open_streams_count_a_running_turn_and_drop_after_it(metered):
    client = metered.client()
    session = client.create_session("echo")
    results = {}
    worker = threading.Thread(
        target=lambda: results.update(r=client.turn(session, text="/slow 30 100", stream="delta"))
    )
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while value(samples(metered), "aap_open_streams", mode="sse") < 1:
            assert time.monotonic() < deadline, "the streaming turn never showed as an open stream"
            time.sleep(0.2)
        assert value(samples(metered), "aap_turns_running") >= 1
    finally:
        worker.join(30)
        client.close()
    assert results["r"].stop_reason == "end_turn"
    deadline = time.monotonic() + 10
    while value(samples(metered), "aap_open_streams", mode="sse") != 0:
        assert time.monotonic() < deadline, "a finished stream is still counted as open"
        time.sleep(0.2)


def test_a_lost_turn_recovery_is_counted(metered):
    client = metered.client()
    session = client.create_session("echo")
    before = value(samples(metered), "aap_lost_turns_recovered_total", state="running")
    results = {}
    streaming = threading.Thread(
        target=lambda: results.update(r=client.turn(session, text="/slow 200 100", stream="delta"))
    )
    streaming.start()
    try:
        time.sleep(1.5)
        metered.kill_worker()  # the turn's worker dies mid-turn
        streaming.join(60)
        assert results["r"].stop_reason == "error"
    finally:
        metered.start_worker()
        client.close()
    assert value(samples(metered), "aap_lost_turns_recovered_total", state="running") == before + 1


def test_grafana_dashboard_is_built_on_these_families():
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat", "row", "table", "bargauge", "gauge"}
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    metrics_source = "".join((ROOT / path).read_text() for path in ("infra/metrics.py", "sessions_app/engine/queue.py"))
    import re

    for expr in exprs:
        for name in re.findall(r"\baap_[a-z_]+", expr):
            base = re.sub(r"_(total|bucket|count|sum)$", "", name)
            assert f'"{base}"' in metrics_source, f"{name} in the dashboard is not a family the service exports"
    assert any(v["name"] == "datasource" for v in dashboard["templating"]["list"])


def test_the_monitoring_compose_profile_scrapes_the_services_and_shows_the_dashboard():
    """The compose file's monitoring profile, validated for structure (no Docker in the suite)."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    monitoring = {name for name, service in services.items() if "monitoring" in service.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    for name in ("web", "worker", "postgres", "redis"):
        assert "profiles" not in services[name], f"{name} must run without the profile"
    env = compose["x-env"]
    assert env["AAP_METRICS"] == "${AAP_METRICS:-off}" and env["AAP_METRICS_ADDR"] == "0.0.0.0"

    def mounts(service):
        pairs = [volume.split(":")[:2] for volume in services[service]["volumes"]]
        return {target: source for source, target in pairs}

    for service in monitoring:
        for source in mounts(service).values():
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{service} mounts {source}, which is not in the repository"
            else:
                assert source in compose["volumes"], f"{service} uses the undeclared volume {source}"
        for port in services[service]["ports"]:
            assert port.startswith("127.0.0.1:"), "monitoring ports stay on the host's loopback"
    prometheus = yaml.safe_load((ROOT / mounts("prometheus")["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    from django.conf import settings

    assert targets == {f"web:{settings.AAP_METRICS_PORT}", f"worker:{settings.AAP_METRICS_PORT}"}
    grafana = mounts("grafana")
    assert grafana["/var/lib/grafana/dashboards/aap-hosting.json"] == "./docs/grafana-dashboard.json"
    provisioning = ROOT / grafana["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "aap.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
