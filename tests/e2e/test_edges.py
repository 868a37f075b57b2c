"""The edges around the views, on a real Daphne: bodies capped while they arrive, slow and
malformed clients, and the network guard in front of every address a tenant can choose."""

from __future__ import annotations

import gzip
import json
import resource
import select
import socket
import time
import zlib

import pytest
import yaml

from tests.fakes.openai_server import FakeOpenAI
from tests.support import Stack, llm_agent, serve_pages

LIMIT = 1_000_000
HEADERS_TIMEOUT = 2
BODY_TIMEOUT = 3
MIB = 1 << 20


@pytest.fixture(scope="module")
def edge(pg_stack, log_dir):
    """A second web process on the suite's database with small limits (no worker needed)."""
    stack = Stack(
        "edge",
        {
            **pg_stack.env,
            "AAP_MAX_BODY_BYTES": str(LIMIT),
            "AAP_REQUEST_HEADERS_TIMEOUT_SECONDS": str(HEADERS_TIMEOUT),
            "AAP_REQUEST_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT),
        },
        log_dir,
    )
    stack.tokens = dict(pg_stack.tokens)
    stack.start_web()
    yield stack
    stack.stop()


def connect(stack: Stack) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
    return sock


def read_all(sock: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes the connection (bounded by `timeout`)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# --- 1. bodies are limited while they arrive, before authentication ----------------------------


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(edge):
    sock = connect(edge)
    sock.sendall(
        b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000000\r\n\r\n"
    )
    status, body = status_and_json(read_all(sock))
    assert status == 413 and str(LIMIT) in body["error"]


def test_a_chunked_gigabyte_without_a_token_is_refused_once_it_passes_the_limit(edge):
    before = rss_kib(edge.web.pid)
    sock = connect(edge)
    sock.sendall(
        b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"%x\r\n" % MIB + b"[" * MIB + b"\r\n"
    sent, answer = 0, b""
    try:
        while sent < 1024 * MIB and not answer:
            sock.sendall(chunk)
            sent += MIB
            if select.select([sock], [], [], 0)[0]:
                answer = sock.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer += read_all(sock, 10)
    status, body = status_and_json(answer)
    assert status == 413 and "larger than the limit" in body["error"]
    assert sent < 1024 * MIB, "the server read the whole gigabyte before answering"
    grown = rss_kib(edge.web.pid) - before
    assert grown < 64 * 1024, f"the web process grew by {grown} KiB"
    assert edge.client("demo").get("/v1/meta").status_code == 200, "the server still answers"


def test_a_body_over_the_limit_with_a_valid_token_is_a_json_413(edge):
    client = edge.client("demo")
    response = client.http.post(
        "/v1/sessions", content=b" " * (LIMIT + 1), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413 and "limit" in response.json()["error"]
    client.close()


# --- 1. slow clients are timed out ---------------------------------------------------------------


def test_a_declared_body_that_never_arrives_is_answered_408(edge):
    sock = connect(edge)
    sock.sendall(
        b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 5000\r\n\r\n{"agent"'
    )
    status, body = status_and_json(read_all(sock, BODY_TIMEOUT + 20))
    assert status == 408 and "body" in body["error"]


def test_fifty_slowloris_connections_are_all_closed(edge):
    socks = [connect(edge) for _ in range(50)]
    line = b"GET /v1/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    closed: set[int] = set()
    answers: dict[int, bytes] = {}
    deadline = time.monotonic() + HEADERS_TIMEOUT + 20
    position = 0
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for index, sock in enumerate(socks):
            if index in closed:
                continue
            try:
                sock.send(line[position % len(line) : position % len(line) + 1])  # one byte, forever
                if select.select([sock], [], [], 0)[0]:
                    data = sock.recv(65536)
                    answers[index] = answers.get(index, b"") + data
                    if not data or b"\r\n\r\n" in answers[index]:
                        closed.add(index)
            except OSError:
                closed.add(index)
        position += 1
        time.sleep(0.2)
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow connections were still open"
    timed_out = [a for a in answers.values() if a.startswith(b"HTTP/1.1 408")]
    assert timed_out, "the slow clients were told why (408)"
    for sock in socks:
        sock.close()
    assert edge.client("demo").get("/v1/meta").status_code == 200


# --- 1. malformed HTTP ----------------------------------------------------------------------------

MALFORMED = {
    "bad Content-Length": b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    "two Content-Lengths": b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "oversized header": b"GET /v1/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    "too many headers": b"GET /v1/meta HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: b\r\n" * 600 + b"\r\n",
    "header without colon": b"GET /v1/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nNoColonHere\r\n\r\n",
    "bad chunk size": b"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "space in header name": b"GET /v1/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Name: x\r\n\r\n",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_http_gets_a_json_400_and_a_closed_connection(edge, raw):
    sock = connect(edge)
    sock.sendall(raw)
    answer = read_all(sock, 15)
    status, body = status_and_json(answer)
    assert status == 400 and len(body["error"]) > 20
    assert b"<html" not in answer.lower()


# --- 3. SSRF: addresses a tenant chooses go through the guard -------------------------------------


@pytest.fixture(scope="module")
def fake(pg_stack):
    server = FakeOpenAI().start()
    pg_stack.apply_agents(
        [
            llm_agent(
                "llm-guarded",
                server.url,
                api_key="sk-operator-guarded",
                config={"timeoutSeconds": 10, "maxRetries": 0},
                streams=("none",),
                title="Operator endpoint on loopback; applications may choose only public ones",
            )
        ]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def target():
    """A model server on loopback that an application tries to point its session at."""
    server = FakeOpenAI().start()
    yield server
    server.stop()


def test_the_operators_own_endpoint_is_trusted_even_on_loopback(fake, demo):
    fake.clear()
    session = demo.create_session("llm-guarded")
    result = demo.turn(session, text="Hello")
    assert result.stop_reason == "end_turn"
    assert len(fake.chat_requests()) == 1


@pytest.mark.parametrize(
    "chosen, kind",
    [
        ("http://127.0.0.1:{port}/v1", "loopback"),
        ("http://localhost:{port}/v1", "loopback"),
        ("http://[::ffff:127.0.0.1]:{port}/v1", "embeds an IPv4"),
        ("http://[64:ff9b::7f00:1]:{port}/v1", "embeds an IPv4"),
        ("http://169.254.169.254/latest", "link-local"),
        ("http://10.0.0.1:8000/v1", "private"),
    ],
)
def test_a_base_url_the_application_chose_must_be_public(fake, target, demo, chosen, kind):
    fake.clear()
    target.clear()
    session = demo.create_session("llm-guarded", agent={"options": {"baseUrl": chosen.format(port=target.port)}})
    result = demo.turn(session, text="Hello")
    assert result.stop_reason == "error"
    error = result.body["_meta"]["error"]
    assert kind in error and "public" in error, error
    assert target.requests == [] and fake.requests == [], "nothing reached a loopback server"
    assert demo.history(session) == [{"role": "user", "content": "Hello"}]


# --- 3. http_fetch bounds the decoded size ---------------------------------------------------------


def gzipped_zeros(mib: int) -> bytes:
    """gzip of `mib` MiB of zeros, made without holding them: about 1 KB per MiB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * MIB
    return b"".join([*(packer.compress(zeros) for _ in range(mib)), packer.flush()])


BOMB = gzipped_zeros(512)  # ~500 KB that inflate to 512 MiB
DOUBLE_BOMB = gzip.compress(BOMB)  # a few KB: "gzip, gzip"
DEFLATED_PAGE = gzip.compress(b"<p>" + b"hello " * 50_000 + b"</p>")


@pytest.fixture(scope="module")
def encoded_server():
    def page(body: bytes, encoding: str) -> tuple[bytes, dict]:
        return body, {"Content-Type": "text/html", "Content-Encoding": encoding}

    with serve_pages(
        {
            "/bomb": page(BOMB, "gzip"),
            "/double": page(DOUBLE_BOMB, "gzip, gzip"),
            "/page": page(DEFLATED_PAGE, "gzip"),
            "/br": page(b"\x0b\x02\x80hello\x03", "br"),
        }
    ) as url:
        yield url


def test_http_fetch_never_inflates_past_its_limit(encoded_server, pg_stack):
    import asyncio

    from agents.tools import http_fetch

    settings = {"allowPrivateAddresses": True, "maxBytes": 100_000}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(3):
        bomb = asyncio.run(http_fetch._http_fetch({"url": encoded_server + "/bomb"}, settings))
        assert "[the body was cut at 100000 bytes]" in bomb
        with pytest.raises(http_fetch.ToolInputError, match="Content-Encoding 'gzip, gzip'"):
            asyncio.run(http_fetch._http_fetch({"url": encoded_server + "/double"}, settings))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
    assert grown_kib < 64 * 1024, f"fetching a 512 MiB gzip bomb raised the peak RSS by {grown_kib} KiB"
    with pytest.raises(http_fetch.ToolInputError, match="does not decode"):
        asyncio.run(http_fetch._http_fetch({"url": encoded_server + "/br"}, settings))
    page = asyncio.run(http_fetch._http_fetch({"url": encoded_server + "/page"}, settings))
    assert page.startswith("HTTP 200 OK") and "hello hello" in page
    assert "[the body was cut at 100000 bytes]" in page


def test_http_fetch_is_refused_loopback_through_the_shared_guard(encoded_server):
    import asyncio

    from agents.tools import http_fetch

    with pytest.raises(http_fetch.ToolInputError, match=r"Refusing to fetch 127\.0\.0\.1: it resolves to a loopback"):
        asyncio.run(http_fetch._http_fetch({"url": encoded_server + "/page"}, {}))


# --- 5. a seeded pending server call runs within the tool's own limits ------------------------------


def test_a_seeded_pending_server_call_gets_the_tools_own_guard(pg_stack, demo, target, tmp_path):
    agent = {
        "name": "echo-fetch",
        "title": "Echo with http_fetch",
        "version": "1.0.0",
        "runtime": {"kind": "echo"},
        "tools": [{"name": "fetch", "description": "Fetches a page.", "implementation": "http_fetch"}],
    }
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [agent]}))
    pg_stack.manage("apply_agents", str(path))
    target.clear()
    seed = [
        {"role": "user", "content": "read it"},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "toolCallId": "call_seeded",
                    "name": "fetch",
                    "input": {"url": target.url + "/models"},
                },
            ],
        },
    ]
    response = demo.post(
        "/v1/sessions", {"agent": {"name": "echo-fetch", "tools": [{"name": "fetch"}]}, "messages": seed}
    )
    assert response.status_code == 201, response.text
    session = response.json()["sessionId"]
    granted = [{"role": "tool_permission", "toolCallId": "call_seeded", "granted": True}]
    result = demo.turn(session, granted, stream="message")
    [tool_result] = [e.data for e in result.events if e.event == "tool_result"]
    assert tool_result["content"].startswith("Error: Refusing to fetch 127.0.0.1: it resolves to a loopback")
    assert target.requests == [], "the seeded call reached nothing the tool may not reach"
