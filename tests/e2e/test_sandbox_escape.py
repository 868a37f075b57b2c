"""The ACP sandbox, attacked from inside: a scripted agent (tests/fakes/acp_agent.py, `/sh CMD`
runs any shell command in its workspace, as an agent's own tools would) tries every escape
through the AAP API of the real stack, and every attempt must fail; what it may do must work.

Each assertion here fails when the sandbox is off: `AAP_TEST_SANDBOX_OFF=1 make test
ARGS=tests/e2e/test_sandbox_escape.py` registers the same agents with the operator's
`unsafeWithoutSandbox` (never reachable by a tenant) to show it. The dangerous attempts are
bounded so that even then they harm nothing: `kill -0` instead of a kill, a bounded number of
forked sleepers instead of an endless bomb, a few MiB of disk.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support import Stack

from ..turn_checks import checked_turn, user, wait_until
from .escape import SANDBOX_OFF, as_script, connect_probe, refusals, service_targets
from .test_acp_agent import FAKE, FAKE_INSTALL, agent_pid, session_of, workspace

SECRET = "sk-other-tenant-" + uuid.uuid4().hex
LIMITS = {"processes": 40, "diskMiB": 8, "memoryMiB": 300}


@pytest.fixture(scope="module")
def shell_stack(pg_stack, tmp_path_factory, model) -> Stack:
    endpoint = urlsplit(model.url)
    config = {
        "command": FAKE,
        "readPaths": FAKE_INSTALL,
        "egress": [f"{endpoint.hostname}:{endpoint.port}"],
        "limits": LIMITS,
        "options": {"apiKey": {"env": "FAKE_API_KEY"}},
        "hangTimeoutSeconds": 60,
    }
    if SANDBOX_OFF:
        config["unsafeWithoutSandbox"] = True
    agent = {
        "name": "acp-shell",
        "title": "A shell inside the sandbox",
        "runtime": {"kind": "acp", "config": config},
        "options": [{"type": "secret", "name": "apiKey", "default": "sk-operator-default-0001"}],
        "capabilities": {"history": {"compacted": {}, "full": {}}, "stream": {"delta": {}, "message": {}, "none": {}}},
    }
    path = tmp_path_factory.mktemp("sandbox-agents") / "agents.yaml"
    path.write_text(yaml.safe_dump({"agents": [agent]}))
    pg_stack.manage("apply_agents", str(path))
    return pg_stack


@pytest.fixture
def demo(shell_stack):
    client = shell_stack.client("demo")
    yield client
    client.close()


@pytest.fixture
def other(shell_stack):
    client = shell_stack.client("other")
    yield client
    client.close()


def shell(client, session: str, command: str) -> tuple[int | None, str]:
    """Run `command` in the agent's shell; returns (exit code, output)."""
    result = checked_turn(client, session, user("/sh " + command))
    assert result.stop_reason == "end_turn", result.body
    text = "".join(block["text"] for m in result.messages for block in m["content"] if block["type"] == "text")
    head, _, output = text.partition("\n")
    return int(head.removeprefix("exit=")), output


def shell_session(client, **options) -> str:
    return session_of(client, "acp-shell", options=options or None)


def worker_pid_cmd(stack: Stack) -> str:
    # The worker's pid on the host (in its own PID namespace the agent cannot even name it).
    return str(stack.worker.pid)


def alive_after(client, session: str) -> None:
    """The worker (and the service) still serves this session and a new one."""
    assert shell(client, session, "echo still here") == (0, "still here\n")
    assert shell(client, shell_session(client), "echo fresh") == (0, "fresh\n")


# --- what the agent may do ----------------------------------------------------------------


def test_the_agent_reads_and_writes_its_workspace_and_runs_programs_of_its_installation(shell_stack, demo):
    session = shell_session(demo)
    code, output = shell(demo, session, 'echo hello > notes.txt && cat notes.txt && python -c "print(6 * 7)" && pwd')
    assert code == 0
    assert output.splitlines() == ["hello", "42", str(workspace(shell_stack, session))]
    assert (workspace(shell_stack, session) / "notes.txt").read_text() == "hello\n"


def test_the_agent_reaches_its_allowed_model_endpoint_and_nothing_else_over_http(shell_stack, demo, model):
    session = shell_session(demo)
    fetch = 'python -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=10).status)" '
    assert shell(demo, session, fetch + model.url + "/models") == (0, "200\n")
    code, output = shell(demo, session, fetch + shell_stack.base_url + "/healthz")
    assert code != 0 and "200" not in output


# --- what it may not ------------------------------------------------------------------------


def test_another_sessions_workspace_is_out_of_reach_even_in_the_same_tenant(shell_stack, demo):
    mine, theirs = shell_session(demo), shell_session(demo)
    assert shell(demo, theirs, "echo their-private-notes > private.txt")[0] == 0
    target = workspace(shell_stack, theirs)
    code, output = shell(demo, mine, f"cat {target}/private.txt; ls {target} {target.parent} 2>/dev/null")
    assert "their-private-notes" not in output
    assert refusals(output) == 1  # cat's; `ls` listed nothing


def test_another_tenants_agent_environment_is_out_of_reach(shell_stack, demo, other):
    theirs = shell_session(other, apiKey=SECRET)
    pid = agent_pid(other, theirs)
    assert SECRET.encode() in Path(f"/proc/{pid}/environ").read_bytes()  # it is there to steal
    mine = shell_session(demo)
    code, output = shell(
        demo, mine, f"cat /proc/{pid}/environ; grep -a -h -o 'sk-other-tenant-[0-9a-f]*' /proc/*/environ"
    )
    assert SECRET not in output
    peek = (
        f"m = open('/proc/{pid}/mem', 'rb'); m.seek(int(open('/proc/{pid}/maps').readline().split('-')[0], 16)); "
        "print(len(m.read(16)))"
    )
    code, output = shell(demo, mine, f'python -c "{peek}"')
    # Refused: no line "16" (the bytes read). The refusal's traceback names /proc/<pid>/mem,
    # whose pid may itself contain "16".
    assert code != 0 and "16" not in output.splitlines(), output


def test_the_workers_environment_and_the_services_secrets_are_out_of_reach(shell_stack, demo):
    session = shell_session(demo)
    code, output = shell(demo, session, f"env; cat /proc/{worker_pid_cmd(shell_stack)}/environ")
    for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "HOSTING_ENCRYPTION_KEYS"):
        assert name not in output
    assert shell_stack.env["DATABASE_URL"] not in output


def test_key_files_and_etc_shadow_are_unreadable(shell_stack, demo, key_file):
    session = shell_session(demo)
    code, output = shell(demo, session, f"cat {key_file}; cat /etc/shadow; ls {key_file.parent} 2>/dev/null")
    assert key_file.read_text() not in output
    assert "root:" not in output  # /etc/shadow's first line
    assert refusals(output) == 2  # both cats; `ls` listed nothing


def test_nothing_is_written_outside_the_workspace_directly_or_through_links(shell_stack, demo, tmp_path):
    session = shell_session(demo)
    outside = tmp_path / "outside.txt"
    outside.write_text("original")
    outside.chmod(0o666)  # a file anyone may write: only the sandbox stands in the way
    tmp_path.chmod(0o755)
    direct = Path("/tmp") / f"escape-{uuid.uuid4().hex}"
    code, output = shell(
        demo,
        session,
        f"echo direct > {direct}; echo plain >> {outside}; "
        f"ln -s {outside} via-symlink; echo symlink >> via-symlink; "
        f"ln {outside} via-hardlink; echo hardlink >> via-hardlink; "
        f"mkdir {tmp_path}/made-by-agent",
    )
    try:
        assert not direct.exists()
        assert outside.read_text() == "original"
        assert not (tmp_path / "made-by-agent").exists()
        assert outside.stat().st_nlink == 1  # no hard link to it was made (`>>` made a new file)
    finally:
        direct.unlink(missing_ok=True)


def test_postgresql_redis_and_the_services_port_are_unreachable(shell_stack, demo):
    session = shell_session(demo)
    unix = ("/var/run/postgresql/.s.PGSQL.5432", "/run/postgresql/.s.PGSQL.5432")
    if "postgres" in os.environ.get("AAP_SERVICES_STARTED", ""):  # the suite's own server (scripts/test.sh)
        port = urlsplit(shell_stack.env["DATABASE_URL"]).port
        unix += (f"{os.environ['AAP_SERVICES_DIR']}/pgrun/.s.PGSQL.{port}",)
    targets = service_targets(shell_stack)
    code, output = shell(demo, session, as_script(connect_probe(targets, unix=unix)))
    assert code == 0, output
    assert "connected" not in output
    assert output.count("refused") == len(targets) + len(unix)


def test_the_worker_can_be_neither_signalled_nor_traced(shell_stack, demo):
    session = shell_session(demo)
    worker = worker_pid_cmd(shell_stack)
    code, output = shell(demo, session, f"kill -0 {worker} && echo signalled")
    assert "signalled" not in output
    trace = (
        "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
        "print('traced' if libc.ptrace(0x4206, int(sys.argv[1]), 0, 0) == 0 else 'refused')"
    )
    code, output = shell(demo, session, f'python -c "{trace}" {worker}')
    assert "traced" not in output
    alive_after(demo, session)


def test_a_fork_bomb_ends_the_turn_with_an_error_and_the_worker_survives(shell_stack, demo):
    session = shell_session(demo)
    pid = agent_pid(demo, session)
    bomb = (
        "import os, time\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "    except OSError:\n"
        "        time.sleep(0.05)\n"
        "time.sleep(30)\n"
    )
    result = checked_turn(demo, session, user("/sh cat > bomb.py <<'EOF'\n" + bomb + "EOF\npython bomb.py"))
    assert result.stop_reason == "error", result.body
    assert re.search(r"limit of 40 processes", result.body["_meta"]["error"])
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=10, message="the agent was stopped")
    # In the fallback mode the bomb's processes count against the unit uid's process limit
    # until the kernel has reaped them all: a turn started meanwhile may fail to fork (seen
    # as a JSON-RPC -32603 from the agent). The session must answer again within the bomb's
    # own lifetime, then serve as ever.
    wait_until(
        lambda: checked_turn(demo, session, user("/sh echo up")).stop_reason == "end_turn",
        timeout=40,
        message="the session answers again after the fork bomb",
    )
    alive_after(demo, session)


def test_filling_the_disk_past_the_limit_ends_the_turn_with_an_error_and_the_worker_survives(shell_stack, demo):
    session = shell_session(demo)
    result = checked_turn(
        demo,
        session,
        user("/sh for i in 1 2 3 4 5 6 7 8 9 10 11 12; do head -c 1048576 /dev/urandom > fill-$i; done; sleep 5"),
    )
    assert result.stop_reason == "error", result.body
    assert "disk limit of 8 MiB" in result.body["_meta"]["error"]
    alive_after(demo, session)


def test_using_more_memory_than_the_limit_ends_the_turn_with_an_error(shell_stack, demo):
    session = shell_session(demo)
    hog = "import time; block = bytearray(120 * 1024 * 1024); block[::4096] = b'x' * len(block[::4096]); time.sleep(20)"
    result = checked_turn(demo, session, user(f'/sh for i in 1 2 3 4; do python -c "{hog}" & done; wait'))
    assert result.stop_reason == "error", result.body
    assert "memory limit of 300 MiB" in result.body["_meta"]["error"]
    alive_after(demo, session)
