"""The sandbox launcher on its own: what holds without a uid of its own (the Docker image,
where the service and its agents share one unprivileged user), the refusal on a kernel
without Landlock, and the egress proxy's allowlist.

`AAP_TEST_SANDBOX_OFF=1` runs the same commands unconfined (as the same user), to show each
assertion fails then.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from agents.runtimes.acp_bridge import limits, sandbox
from agents.runtimes.acp_bridge.egress import EgressProxy
from agents.runtimes.acp_bridge.process import AgentProcess, ProcessSpec
from agents.runtimes.base import AgentError

SANDBOX_OFF = os.environ.get("AAP_TEST_SANDBOX_OFF") == "1"
SERVICE_UID = 199_990  # stands in for the unprivileged user a container runs the service as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (CI runs as root)")


def as_service(argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={SERVICE_UID}", f"--regid={SERVICE_UID}", "--clear-groups", *argv]


@pytest.fixture
def service():
    """A process and a private file of the service's user, outside any sandbox."""
    secret = "service-secret-" + uuid.uuid4().hex
    tmp_path = Path(tempfile.mkdtemp(prefix="aap-launcher-"))  # not under pytest's 0700 root
    tmp_path.chmod(0o755)
    private = tmp_path / "private-key"
    private.write_text(secret)
    os.chown(private, SERVICE_UID, SERVICE_UID)
    private.chmod(0o600)
    work = tmp_path / "workspace"
    work.mkdir()
    os.chown(work, SERVICE_UID, SERVICE_UID)
    worker = subprocess.Popen(as_service(["sleep", "120"]), env={"SERVICE_SECRET": secret, "PATH": "/usr/bin:/bin"})
    try:
        yield {"secret": secret, "private": private, "workspace": work, "pid": worker.pid}
    finally:
        worker.kill()
        worker.wait()
        shutil.rmtree(tmp_path, ignore_errors=True)


def confined(service, script: str) -> str:
    """Run `script` the way an agent of the service's own user is run; its output."""
    argv = ["/bin/sh", "-c", script]
    if not SANDBOX_OFF:
        spec = sandbox.SandboxSpec(
            unit="test:launcher",
            writable=(service["workspace"],),
            read_paths=(),
            egress=(),
            limits=limits.Limits.parse({"processes": 64}),
        )
        # uid None: the launcher keeps the user it was started as, like an unprivileged service.
        policy = sandbox.policy(spec, "/bin/sh", uid=None, cwd=service["workspace"], proxy_port=None, base_tasks=50)
        argv = sandbox.launcher_argv(policy, argv)
    done = subprocess.run(
        as_service(argv),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=service["workspace"],
        env={"PATH": sandbox.sandbox_path()},
    )
    return done.stdout + done.stderr


def test_without_a_uid_of_its_own_the_agent_still_cannot_read_the_services_files(service):
    output = confined(service, f"cat {service['private']}; echo ok > mine.txt && cat mine.txt")
    assert service["secret"] not in output
    assert "ok" in output  # its workspace works


def test_without_a_uid_of_its_own_the_agent_still_cannot_read_or_signal_the_services_processes(service):
    pid = service["pid"]
    output = confined(service, f"cat /proc/{pid}/environ; kill -0 {pid} && echo signalled; head -c 16 /proc/{pid}/maps")
    assert service["secret"] not in output
    assert "signalled" not in output
    assert not re.search(r"\b[0-9a-f]{6,}-[0-9a-f]{6,}\b", output)  # no line of its memory map


def refused_start(home: Path, unit: str) -> tuple[AgentProcess, str]:
    """Start a sandboxed process that must be refused: the process and the sentence."""
    spec = ProcessSpec(
        key="k",
        label=unit,
        argv=("python", "-c", "print(1)"),
        env={},
        home=home,
        sandbox=sandbox.SandboxSpec(
            unit=unit, writable=(home,), read_paths=(), egress=(), limits=limits.Limits.parse(None)
        ),
    )
    process = AgentProcess(spec)
    with pytest.raises(AgentError) as refused:
        asyncio.run(process.start())
    return process, str(refused.value)


def test_a_kernel_without_landlock_makes_the_agent_refuse_to_start_naming_what_is_missing(
    monkeypatch, tmp_path, settings
):
    import py_landlock

    monkeypatch.setattr(py_landlock, "get_abi_version", lambda: 3)
    settings.AAP_SANDBOX_MODE = "fallback"
    sandbox.missing.cache_clear()
    sandbox.mode.cache_clear()
    try:
        gaps = sandbox.missing()
        assert gaps == ("Landlock ABI 6 (Linux 6.12 or later; this kernel offers ABI 3)",)
        process, refused = refused_start(tmp_path, "test:refusal")
        assert refused == (
            "The agent cannot start: its sandbox needs Landlock ABI 6 (Linux 6.12 or later; this kernel offers "
            "ABI 3). An operator can run it unconfined only by setting unsafeWithoutSandbox for this agent."
        )
        assert process.process is None  # nothing was started: no silent fallback
    finally:
        sandbox.missing.cache_clear()
        sandbox.mode.cache_clear()


def test_a_trial_run_that_times_out_refuses_the_start_and_never_settles_on_the_fallback(
    monkeypatch, tmp_path, settings
):
    """A busy host makes the namespaces trial slow, not impossible: the `auto` mode must not
    drop to the fallback for the rest of the process because of it. The start is refused with
    a sentence, and the next one tries again."""
    real_run = subprocess.run
    calls = []

    def slow_trial(argv, *args, **kwargs):
        if "--probe" in argv:
            calls.append(argv)
            raise subprocess.TimeoutExpired(argv, kwargs.get("timeout"))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "run", slow_trial)
    monkeypatch.setattr(sandbox, "_bwrap", lambda: "/usr/bin/bwrap")
    settings.AAP_SANDBOX_MODE = "auto"
    sandbox.namespaces_missing.cache_clear()
    sandbox.mode.cache_clear()
    try:
        process, refused = refused_start(tmp_path, "test:busy")
        assert refused == (
            "The agent cannot start yet: the sandbox's trial run did not finish within 30 seconds (the host is "
            "busy). The next start tries again."
        )
        assert process.process is None  # nothing was started, in no mode
        with pytest.raises(sandbox.SandboxError):
            sandbox.mode()
        assert len(calls) == 2  # not cached: each start tries again
        monkeypatch.setattr(sandbox.subprocess, "run", real_run)
        # Once a trial finishes, its verdict is the mode (namespaces on a host that has them).
        assert sandbox.mode() == ("fallback" if sandbox.namespaces_missing() else "namespaces")
    finally:
        sandbox.namespaces_missing.cache_clear()
        sandbox.mode.cache_clear()


def test_the_egress_proxy_lets_through_only_the_allowed_destinations():
    async def scenario():
        async def upstream(reader, writer):
            request = await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
                if request.startswith(b"GET /models")
                else b"HTTP/1.1 400 Bad\r\n\r\n"
            )
            await writer.drain()
            writer.close()

        allowed = await asyncio.start_server(upstream, "127.0.0.1", 0)
        other = await asyncio.start_server(upstream, "127.0.0.1", 0)
        allowed_port, other_port = (s.sockets[0].getsockname()[1] for s in (allowed, other))
        proxy = EgressProxy((f"127.0.0.1:{allowed_port}",), "test")
        await proxy.start()

        async def ask(head: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(head)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return data

        try:
            plain = await ask(f"GET http://127.0.0.1:{allowed_port}/models HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            refused = await ask(f"GET http://127.0.0.1:{other_port}/models HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            tunnel_refused = await ask(f"CONNECT 127.0.0.1:{other_port} HTTP/1.1\r\n\r\n".encode())
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(f"CONNECT 127.0.0.1:{allowed_port} HTTP/1.1\r\n\r\n".encode())
            established = await reader.readuntil(b"\r\n\r\n")
            writer.write(b"GET /models HTTP/1.1\r\n\r\n")
            tunnelled = await asyncio.wait_for(reader.read(), 10)
            writer.close()
        finally:
            await proxy.close()
            allowed.close()
            other.close()
        return plain, refused, tunnel_refused, established, tunnelled

    plain, refused, tunnel_refused, established, tunnelled = asyncio.run(scenario())
    assert plain.startswith(b"HTTP/1.1 200") and plain.endswith(b"hi")
    assert refused.startswith(b"HTTP/1.1 403") and b"not in this agent's egress allowlist" in refused
    assert tunnel_refused.startswith(b"HTTP/1.1 403")
    assert established.startswith(b"HTTP/1.1 200")
    assert tunnelled.endswith(b"hi")


def test_commands_are_found_on_the_sandboxs_path_which_starts_with_the_services_environment():
    path = sandbox.sandbox_path()
    assert path.split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert sandbox.resolve("python", path) == str(Path(sys.executable).parent / "python")
    with pytest.raises(sandbox.SandboxError, match="'no-such-agent' was not found on the sandbox's PATH"):
        sandbox.resolve("no-such-agent", path)


UNPRIVILEGED_SERVICE = r"""
import asyncio, os, sys
from pathlib import Path

import django

django.setup()
import acp

from agents.runtimes.acp_bridge import limits, sandbox
from agents.runtimes.acp_bridge.process import AgentProcess, ProcessSpec

fake, script, unsafe = sys.argv[1], sys.argv[2].replace("WORKER_PID", str(os.getpid())), sys.argv[3] == "1"


class Collect:
    def __init__(self):
        self.text = []

    def on_update(self, update):
        content = getattr(update, "content", None)
        if getattr(content, "text", None):
            self.text.append(content.text)

    def close(self):
        pass


async def main():
    root = Path(os.environ["AAP_WORKSPACE_ROOT"])
    work, home = root / "demo" / "sess_1", root / "demo" / ".session-homes" / "sess_1" / "shell"
    box = None if unsafe else sandbox.SandboxSpec(
        unit="session:demo/sess_1", writable=(work, home), read_paths=(str(Path(fake).parent),), egress=(),
        limits=limits.Limits.parse(None))
    process = AgentProcess(ProcessSpec(key="k", label="shell/demo", argv=("python", fake), env={}, home=home,
                                       sandbox=box))
    await process.start()
    work.mkdir(parents=True, exist_ok=True)
    session = await process.conn.new_session(cwd=str(work), mcp_servers=[])
    collect = Collect()
    process.sessions[session.session_id] = collect
    await process.conn.prompt(session_id=session.session_id, prompt=[acp.text_block("/sh " + script)])
    print("".join(collect.text))
    await process.stop("done", kill=True)


asyncio.run(main())
"""


def test_an_unprivileged_service_starts_its_agents_sandboxed(service):
    """The Docker image's case, end to end: the service runs as an unprivileged user and
    starts the agent through the sandbox; the agent shares its uid yet reaches none of it."""
    state = Path(tempfile.mkdtemp(prefix="aap-unprivileged-"))
    os.chown(state, SERVICE_UID, SERVICE_UID)
    state.chmod(0o755)
    fake = str(Path(__file__).parents[1] / "fakes" / "acp_agent.py")
    script = (
        f"echo ok > mine.txt && cat mine.txt; cat {service['private']}; "
        "cat /proc/WORKER_PID/environ; kill -0 WORKER_PID && echo signalled"
    )
    env = {
        "PATH": sandbox.sandbox_path(),
        "DJANGO_SETTINGS_MODULE": "hosting.settings",
        "HOSTING_VAR_DIR": str(state / "var"),
        "AAP_WORKSPACE_ROOT": str(state / "workspaces"),
        "SECRET_KEY": "unprivileged-service-test-key",
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "HOSTING_ENCRYPTION_KEYS": os.environ["HOSTING_ENCRYPTION_KEYS"],
        "SERVICE_SECRET": service["secret"],
    }
    try:
        done = subprocess.run(
            as_service([sys.executable, "-c", UNPRIVILEGED_SERVICE, fake, script, "1" if SANDBOX_OFF else "0"]),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=str(Path(fake).parents[2]),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        output = done.stdout
        assert output.startswith("exit=") and "\nok\n" in output  # its workspace works
        assert service["secret"] not in output  # neither the service's file nor its environment
        assert "signalled" not in output
    finally:
        shutil.rmtree(state, ignore_errors=True)
