"""What the escape suites share: tests/e2e/test_sandbox_escape.py attacks the sandbox from an
ACP agent, tests/e2e/test_mcp_tools.py from a stdio MCP server. Their model server, the
secrets planted for them to steal, and the probes they run, each printing one line per target
that a test counts (never the stolen bytes themselves: a digest).

`AAP_TEST_SANDBOX_OFF=1` (SANDBOX_OFF) registers their attackers with the operator's
`unsafeWithoutSandbox`, to show each assertion fails without the sandbox.

Its fixtures reach every test module of tests/e2e through its conftest.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.support import ROOT, Stack

SANDBOX_OFF = os.environ.get("AAP_TEST_SANDBOX_OFF") == "1"


@pytest.fixture(scope="module")
def model():
    """The fake OpenAI-compatible model server (an allowed egress, the positive control)."""
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture
def key_file() -> Path:
    """A key file as the service keeps them (HOSTING_VAR_DIR, mode 0600): there to steal."""
    var = Path(os.environ.get("HOSTING_VAR_DIR", ROOT / "var"))
    var.mkdir(parents=True, exist_ok=True)
    key = var / f"encryption_key-probe-{uuid.uuid4().hex[:8]}"
    key.write_text("fernet-key-material-" + uuid.uuid4().hex)
    key.chmod(0o600)
    yield key
    key.unlink(missing_ok=True)


def refusals(output: str) -> int:
    """Files a shell command was refused: unreadable (fallback), or not there at all (namespaces)."""
    return output.count("Permission denied") + output.count("No such file or directory")


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def service_targets(stack: Stack) -> list[tuple[str, int]]:
    """The suite's PostgreSQL, Redis and the service's own port, as host and port."""
    database = urlsplit(stack.env["DATABASE_URL"])
    redis = urlsplit(stack.env["REDIS_URL"])
    web = urlsplit(stack.base_url)
    return [(database.hostname, database.port or 5432), (redis.hostname, redis.port), (web.hostname, web.port)]


def connect_probe(targets: list[tuple[str, int]], *, egress: str | None = None, unix: tuple[str, ...] = ()) -> str:
    """A Python script: `egress <status>` for the `egress` URL (the positive control), then
    `connected <port|path>` or `refused <port|path> <error>` for each target."""
    lines = ["import socket, urllib.request"]
    if egress:
        lines.append(f"print('egress', urllib.request.urlopen({egress!r}, timeout=10).status)")
    lines += [
        "for host, port in [" + ", ".join(f"({h!r}, {p})" for h, p in targets) + "]:",
        "    try:",
        "        socket.create_connection((host, port), timeout=5).close(); print('connected', port)",
        "    except OSError as exc: print('refused', port, type(exc).__name__)",
    ]
    if unix:
        lines += [
            f"for path in {list(unix)!r}:",
            "    try:",
            "        s = socket.socket(socket.AF_UNIX); s.connect(path); print('connected', path)",
            "    except OSError as exc: print('refused', path, type(exc).__name__)",
        ]
    return "\n".join(lines) + "\n"


def read_probe(targets: dict[str, str]) -> str:
    """A Python script: `read <label> <sha256>` or `refused <label> <error>` for each file."""
    return (
        "import hashlib\n"
        f"for label, path in {targets!r}.items():\n"
        "    try:\n"
        "        data = open(path, 'rb').read()\n"
        "    except OSError as exc: print('refused', label, type(exc).__name__)\n"
        "    else: print('read', label, hashlib.sha256(data).hexdigest())\n"
    )


def as_script(source: str, name: str = "probe.py") -> str:
    """A shell command that writes `source` to `name` in the working directory and runs it."""
    return f"cat > {name} <<'EOF'\n{source}EOF\npython {name}"
