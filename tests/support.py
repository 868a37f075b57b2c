"""Test support: the running stack (real Daphne + Celery + PostgreSQL + Redis, or the
embedded mode), an AAP client over real HTTP, and an SSE parser of the raw byte stream.

Nothing here imports the code under test's protocol helpers: the tests keep their own
reading of the wire format, so a bug in the service's fold cannot hide itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent


@contextmanager
def serve_pages(
    pages: dict[str, tuple[bytes, dict[str, str]]],
    *,
    default: tuple[bytes, dict[str, str]] | None = None,
    host: str = "127.0.0.1",
):
    """A static HTTP server on a free port for the duration of the block; yields its base
    URL. `pages` maps a path to (body, headers); any other path gets `default`, or a 404.
    Content-Length is added."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            found = pages.get(self.path, default)
            body, headers = found or (b"not found", {"Content-Type": "text/plain"})
            self.send_response(200 if found else 404)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def llm_agent(
    name: str,
    base_url: str,
    *,
    api_key: str | None = None,
    config: dict | None = None,
    streams: tuple[str, ...] = ("delta", "none"),
    **more,
) -> dict:
    """An `openai` agent definition (apply_agents format) served by a fake model at `base_url`."""
    options = [{"type": "text", "name": "model", "default": "fake-model"}]
    if api_key is not None:
        options.append({"type": "secret", "name": "apiKey", "default": api_key})
    options.append({"type": "text", "name": "baseUrl", "default": base_url})
    return {
        "name": name,
        "version": "1.0.0",
        "runtime": {"kind": "openai", "config": config or {"timeoutSeconds": 20, "maxRetries": 0}},
        "options": options,
        "capabilities": {"history": {"full": {}}, "stream": {mode: {} for mode in streams}},
        **more,
    }


def web_argv(port: int) -> list[str]:
    """The web process as every deployment starts it (scripts/run.sh, deploy/entrypoint.sh):
    Daphne with its access log written through logging (infra/webserver.py)."""
    return [
        str(BIN / "python"),
        "-m",
        "infra.webserver",
        "-b",
        "127.0.0.1",
        "-p",
        str(port),
        "hosting.asgi:application",
    ]


def worker_argv(node: str, threads: int) -> list[str]:
    """A Celery worker of the turn queue on a pool of `threads` threads, named `node`@host."""
    return [
        str(BIN / "celery"), "-A", "hosting", "worker", "--pool", "threads", "--concurrency", str(threads),
        "-Q", "aap-turns", "--loglevel", "INFO", "-n", f"{node}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip


def side_redis_db(index: int) -> int:
    """The Redis database of a side stack (metrics, tracing, /try/, compose: `index` 0-3),
    apart from the suite's: 5-8 in a single process; under pytest-xdist 16 + 4 per worker,
    above the workers' own (tests/conftest.py), so parallel workers never share one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return 5 + index if not worker else 16 + 4 * int(worker.removeprefix("gw")) + index


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(web: subprocess.Popen, base_url: str, log, timeout: float = 60.0) -> None:
    """Wait until a started Daphne answers /healthz with 200; `log()` gives its output on failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if web.poll() is not None:
            raise RuntimeError(f"daphne exited:\n{log()[-3000:]}")
        try:
            if httpx.get(base_url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"daphne did not become healthy within {timeout:.0f} s")


def log_message(line: str) -> str:
    """The message of one log line: JSON lines (the default) or plain text."""
    if line.startswith("{"):
        try:
            return str(json.loads(line).get("message", ""))
        except ValueError:
            pass
    return line


# --- SSE ---------------------------------------------------------------------------------


@dataclass
class Event:
    id: str | None
    event: str
    data: dict

    def as_dict(self) -> dict:
        return {"event": self.event, **self.data}


def parse_sse(raw: bytes) -> tuple[list[Event], int]:
    """Parse an SSE byte stream into events; also count `: ping` comments."""
    events, pings = [], 0
    text = raw.decode("utf-8")
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        fields: dict[str, str] = {}
        data_lines = []
        for line in block.split("\n"):
            if line.startswith(":"):
                pings += 1
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data_lines.append(value)
            else:
                fields[name] = value
        if "event" in fields or data_lines:
            events.append(Event(fields.get("id"), fields.get("event", "message"), json.loads("\n".join(data_lines))))
    return events, pings


def fold_events(events: list[dict]) -> list[dict]:
    """The spec's fold, written independently of the service."""
    messages, blocks, joining = [], None, None
    for ev in events:
        kind = ev["event"]
        if kind in ("text_delta", "thinking_delta"):
            part = kind.split("_")[0]
            blocks = blocks if blocks is not None else []
            if joining == part:
                blocks[-1][part] += ev["delta"]
            else:
                blocks.append({"type": part, part: ev["delta"]})
            joining = part
        elif kind in ("text", "thinking"):
            blocks = blocks if blocks is not None else []
            blocks.append({"type": kind, kind: ev[kind]})
            joining = None
        elif kind == "tool_call":
            blocks = blocks if blocks is not None else []
            blocks.append(
                {"type": "tool_use", "toolCallId": ev["toolCallId"], "name": ev["name"], "input": ev["input"]}
            )
            joining = None
        elif kind == "tool_result":
            if blocks:
                messages.append({"role": "assistant", "content": blocks})
            blocks, joining = None, None
            messages.append({"role": "tool", "toolCallId": ev["toolCallId"], "content": ev["content"]})
    if blocks:
        messages.append({"role": "assistant", "content": blocks})
    return messages


# --- the client --------------------------------------------------------------------------


@dataclass
class TurnResult:
    status: int
    headers: httpx.Headers
    body: dict | None = None  # stream none, or an error
    events: list[Event] = field(default_factory=list)
    pings: int = 0
    raw: bytes = b""

    @property
    def stop_reason(self) -> str:
        if self.body is not None and "stopReason" in self.body:
            return self.body["stopReason"]
        return self.events[-1].data["stopReason"]

    @property
    def messages(self) -> list[dict]:
        if self.body is not None and "messages" in self.body:
            return self.body["messages"]
        return fold_events([e.as_dict() for e in self.events])

    @property
    def names(self) -> list[str]:
        return [e.event for e in self.events]

    @property
    def turn_id(self) -> str:
        return self.headers["AAP-Turn-Id"]

    def tool_calls(self) -> list[dict]:
        if self.events:
            return [e.data for e in self.events if e.event == "tool_call"]
        return [b for m in self.messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"]


class AAP:
    """An application calling the service with one API token."""

    def __init__(
        self, base_url: str, token: str | None, timeout: float = 60.0, transport: httpx.BaseTransport | None = None
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout, transport=transport)

    def close(self):
        self.http.close()

    def get(self, path, **kw):
        return self.http.get(path, **kw)

    def post(self, path, body=None, **kw):
        return self.http.post(path, json=body, **kw) if body is not None else self.http.post(path, **kw)

    def delete(self, path, **kw):
        return self.http.delete(path, **kw)

    def meta(self) -> dict:
        response = self.get("/v1/meta")
        assert response.status_code == 200, response.text
        return response.json()

    def create_session(self, name: str = "echo", *, agent: dict | None = None, **body) -> str:
        """Create a session of agent `name`; `agent` adds tools/options to its AgentConfig."""
        payload = {"agent": {"name": name, **(agent or {})}, **body}
        response = self.post("/v1/sessions", payload)
        assert response.status_code == 201, response.text
        return response.json()["sessionId"]

    def history(self, session_id: str, kind: str = "full") -> list[dict]:
        response = self.get(f"/v1/sessions/{session_id}/history", params={"type": kind})
        assert response.status_code == 200, response.text
        return response.json()["history"][kind]

    def turn(
        self, session_id: str, messages=None, *, stream: str = "none", text: str | None = None, **body
    ) -> TurnResult:
        if text is not None:
            messages = [{"role": "user", "content": text}]
        payload = {"messages": messages, **body}
        if stream != "none" or "stream" in body:
            payload["stream"] = stream
        with self.http.stream("POST", f"/v1/sessions/{session_id}/turns", json=payload) as response:
            raw = response.read()
        return self._result(response, raw)

    def reattach(self, session_id: str, turn_id: str, last_event_id: int | None = None) -> TurnResult:
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
        with self.http.stream("GET", f"/v1/sessions/{session_id}/turns/{turn_id}/events", headers=headers) as response:
            raw = response.read()
        return self._result(response, raw)

    @staticmethod
    def _result(response: httpx.Response, raw: bytes) -> TurnResult:
        result = TurnResult(response.status_code, response.headers, raw=raw)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            result.events, result.pings = parse_sse(raw)
        else:
            result.body = json.loads(raw)
        return result


# --- the stack -----------------------------------------------------------------------------


class Stack:
    """Real processes serving the service: Daphne, and a Celery worker when Redis is used."""

    def __init__(self, name: str, env: dict, log_dir: Path):
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env}
        self.log_dir = log_dir
        self.web: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.tokens: dict[str, str] = {}

    @property
    def uses_redis(self) -> bool:
        return bool(self.env.get("REDIS_URL"))

    def manage(self, *args: str, input: str | None = None) -> str:
        result = subprocess.run(
            [PYTHON, str(ROOT / "manage.py"), *args],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            input=input,
            # A bound against a hang, not a timing: applying agents starts their MCP servers in
            # the sandbox, which under a loaded CI (the fallback pass runs at nice 10) took
            # over 120 s once.
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def apply_agents(self, agents: list[dict]) -> str:
        """Apply agent definitions the way an operator does (`manage.py apply_agents FILE`)."""
        import tempfile

        import yaml

        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=self.log_dir, delete=False) as file:
            yaml.safe_dump({"agents": agents}, file)
        return self.manage("apply_agents", file.name)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{self.name}-{name}.log", "ab")
        return subprocess.Popen(
            argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_web(self) -> None:
        self.web = self._spawn("daphne", web_argv(self.port))
        self.wait_healthy()

    def start_worker(self) -> None:
        if not self.uses_redis:
            return
        self.worker = self.spawn_worker("celery", 16)

    def spawn_worker(self, label: str, threads: int, timeout: float = 60.0) -> subprocess.Popen:
        """A Celery worker process on the turn queue, once it said it is ready."""
        node = f"{self.name}-{label}-{time.time_ns()}"
        proc = self._spawn(label, worker_argv(node, threads))
        log_path = self.log_dir / f"{self.name}-{label}.log"
        deadline = time.monotonic() + timeout
        # A log may be shared by restarted workers: wait for this node's own "ready." line.
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"celery worker {label} exited:\n{log_path.read_text()[-3000:]}")
            tail = log_path.read_text()[-5000:] if log_path.exists() else ""
            if any(f"{node}@" in text and text.endswith(" ready.") for text in map(log_message, tail.splitlines())):
                return proc
            time.sleep(0.2)
        raise RuntimeError(f"celery worker {label} did not become ready")

    def wait_healthy(self, timeout: float = 60.0) -> None:
        wait_for_health(
            self.web, self.base_url, lambda: (self.log_dir / f"{self.name}-daphne.log").read_text(), timeout
        )

    def start_extra_worker(self, label: str, timeout: float = 60.0) -> subprocess.Popen:
        """One more Celery worker process on the turn queue (the caller stops it with SIGTERM)."""
        return self.spawn_worker(label, 4, timeout)

    def kill_worker(self) -> None:
        """SIGKILL the worker, as a crashed machine would."""
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(10)

    def terminate_worker(self, timeout: float = 60.0) -> float:
        """SIGTERM the worker, as a deploy does (docker stop), and wait for its warm shutdown;
        returns how long it took."""
        started = time.monotonic()
        self.worker.send_signal(signal.SIGTERM)
        self.worker.wait(timeout)
        return time.monotonic() - started

    def stop(self) -> None:
        for proc in (self.worker, self.web):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    with suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)

    def client(self, tenant: str = "demo", **kw) -> AAP:
        return AAP(self.base_url, self.tokens[tenant], **kw)

    def anonymous(self) -> AAP:
        return AAP(self.base_url, None)


def committed(fn):
    """Run ORM code on a connection of its own, outside the test's transaction, so the stack sees it."""
    from django.db import connection

    def run():
        try:
            return fn()
        finally:
            connection.close()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()
