"""The `http_fetch` server tool, called by an `openai` agent through the whole stack."""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import serve_pages

PAGE = b"""<html><head><title>Opening hours</title><style>body{color:red}</style></head>
<body><h1>Opening hours</h1><script>track()</script><p>Monday to Friday, 9&nbsp;to&nbsp;5.</p></body></html>"""


@pytest.fixture(scope="module")
def fake(pg_stack, tmp_path_factory):
    server = FakeOpenAI().start()
    fetch = {"description": "Fetches a web page.", "implementation": "http_fetch"}
    agent = {
        "name": "llm-fetch",
        "runtime": {"kind": "openai", "config": {"timeoutSeconds": 30}},
        "options": [
            {"type": "text", "name": "model", "default": "fake-model"},
            {"type": "text", "name": "baseUrl", "default": server.url},
        ],
        "tools": [
            {"name": "fetch", **fetch},
            {
                "name": "fetch_local",
                **fetch,
                "settings": {"allowPrivateAddresses": True, "maxBytes": 1000, "timeoutSeconds": 2},
            },
        ],
        "capabilities": {"stream": {"delta": {}, "none": {}}},
    }
    path = tmp_path_factory.mktemp("llm-fetch") / "agents.yaml"
    path.write_text(yaml.safe_dump([agent]))
    pg_stack.manage("apply_agents", str(path))
    yield server
    server.stop()


@pytest.fixture
def page_url():
    with serve_pages(
        {"/big": (b"x" * 5000, {"Content-Type": "text/plain"})},
        default=(PAGE, {"Content-Type": "text/html; charset=utf-8"}),
    ) as url:
        yield url


def fetch_turn(fake, demo, tool: str, urls: list[str]) -> list[str]:
    """One turn in which the model fetches each URL with `tool`; returns the tool results."""
    fake.clear()
    response = demo.post("/v1/sessions", {"agent": {"name": "llm-fetch", "tools": [{"name": tool, "trust": True}]}})
    assert response.status_code == 201, response.text
    fake.enqueue(
        FakeOpenAI.tool_calls([{"name": tool, "arguments": json.dumps({"url": u})} for u in urls]),
        FakeOpenAI.text("Fetched."),
    )
    result = demo.turn(response.json()["sessionId"], text="Fetch them", stream="delta")
    assert result.stop_reason == "end_turn"
    results = [e.data["content"] for e in result.events if e.event == "tool_result"]
    # The model saw exactly these results.
    sent = [m["content"] for m in fake.chat_requests()[-1]["json"]["messages"] if m["role"] == "tool"]
    assert sent == results
    return results


def test_http_fetch_refuses_loopback_private_and_link_local_targets_by_default(fake, demo):
    urls = [fake.url + "/models", "http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/", "http://[::1]:9/"]
    results = fetch_turn(fake, demo, "fetch", urls)
    assert len(results) == 4
    for result in results:
        assert result.startswith("Error: Refusing to fetch ")
        assert "loopback, private or link-local" in result
    assert not [r for r in fake.requests if r["path"].endswith("/models")]


def test_http_fetch_reaches_local_targets_when_allowed_within_its_limits(fake, demo, page_url):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        quiet_url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        urls = [fake.url + "/models", page_url + "/hours", page_url + "/big", quiet_url]
        models, page, big, quiet = fetch_turn(fake, demo, "fetch_local", urls)

    assert models.startswith(f"HTTP 200 OK from {fake.url}/models (application/json)")
    assert '"id": "fake-model"' in models
    assert [r["path"] for r in fake.requests if r["path"].endswith("/models")] == ["/v1/models"]
    assert page.startswith(f"HTTP 200 OK from {page_url}/hours (text/html)")
    assert page.endswith("\n\nOpening hours\n\nOpening hours\n\nMonday to Friday, 9\xa0to\xa05.")
    assert "track()" not in page and "color:red" not in page
    assert big.endswith("x" * 1000 + "\n[the body was cut at 1000 bytes]")
    assert quiet == f"Error: Fetching {quiet_url} took longer than 2 seconds."
