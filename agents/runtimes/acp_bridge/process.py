"""An ACP agent process: spawned in its sandbox, initialized, served (the client side of
ACP), watched against its limits, and stopped.

The process gets an environment built from scratch (sandbox.environment()), its HOME, the
operator's static environment and the options routed to environment variables — secrets
travel only there, never in argv. It is started through the sandbox launcher (see
sandbox.py), in its own session and process group, as its isolation unit's uid when the
service runs as root. Its stdout must carry ACP JSON-RPC only: any other line ends the
connection.

Longer than ~400 lines on purpose: one process's life is one state machine (start, serve,
watch, stop) over shared state; the sandbox, limits, terminals and workspace rules it uses
are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import secrets
import signal
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acp
from acp import schema
from acp._transport import NdjsonTransport
from acp.task import MessageSender, TaskSupervisor
from django.conf import settings

from agents.runtimes.base import AgentError
from infra import logs, metrics

from . import cgroups, limits, sandbox, workspace
from .egress import EgressProxy
from .gateway import GatewaySpec, ModelGateway
from .session import AcpSession

logger = logging.getLogger("agents.runtimes.acp")

PROTOCOL_VERSION = 1
TERM_GRACE_SECONDS = 2.0  # after SIGTERM (a graceful stop's grace is over), before SIGKILL
STREAM_LIMIT = 1024 * 1024
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ProcessSpec:
    """What starts one agent process; processes with equal keys are shared."""

    key: str
    label: str  # for logs: agent name and a key prefix, never a value
    argv: tuple[str, ...]
    env: dict = field(repr=False, hash=False, compare=False)
    home: Path = Path("/")
    terminal: bool = False
    start_timeout: float = 60.0
    idle: float = 600.0
    max_file_bytes: int = 1024 * 1024
    terminal_timeout: float = 120.0
    terminal_output_bytes: int = 64 * 1024
    sandbox: sandbox.SandboxSpec | None = field(default=None, hash=False, compare=False)  # None: unsafe opt-out
    gateway: GatewaySpec | None = field(default=None, repr=False, hash=False, compare=False)  # the model gateway

    def redact(self, text: str) -> str:
        hidden = [self.gateway.key, self.gateway.token] if self.gateway else []
        for value in [*self.env.values(), *hidden]:
            if len(value) >= 4:
                text = text.replace(value, "***")
        return text


@dataclass(frozen=True)
class Pipes:
    """A started process's pipes (AgentProcess.spawn pipes all three)."""

    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader

    @classmethod
    def of(cls, process: asyncio.subprocess.Process) -> Pipes:
        """A process's pipes; asyncio types each as optional, set when it was piped."""
        if process.stdin is None or process.stdout is None or process.stderr is None:
            raise RuntimeError("the process was started without its pipes")
        return cls(process.stdin, process.stdout, process.stderr)


class _AgentOutput(NdjsonTransport):
    """The agent's stdout as ACP messages; a line that is not a JSON object ends the stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._supervisor = TaskSupervisor(source="aap.acp")
        super().__init__(reader, MessageSender(writer, self._supervisor))
        self.garbage = False

    async def receive(self):
        while True:
            line = await self._read_line()
            if not line:
                return None
            line = line.strip()
            if not line:
                continue
            try:
                message = json.loads(line) if len(line) <= MAX_MESSAGE_BYTES else None
            except ValueError:
                message = None
            if not isinstance(message, dict):
                self.garbage = True
                return None
            return message

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            await self._supervisor.shutdown()


def _request_error(exc: workspace.WorkspaceError) -> acp.RequestError:
    return acp.RequestError(exc.code, str(exc))


class BridgeClient:
    """The ACP client methods an agent may call; each is scoped to the calling session."""

    def __init__(self, process: AgentProcess):
        self._process = process

    def _session(self, session_id: str) -> AcpSession:
        session = self._process.sessions.get(session_id)
        if session is None:
            raise acp.RequestError.invalid_params({"sessionId": "unknown session"})
        return session

    @asynccontextmanager
    async def _serving(self, session_id: str):
        session = self._session(session_id)
        session.outstanding += 1
        session.touch()
        try:
            yield session
        except workspace.WorkspaceError as exc:
            raise _request_error(exc) from None
        finally:
            session.outstanding -= 1
            session.touch()

    async def session_update(self, session_id, update, **kwargs) -> None:
        session = self._process.sessions.get(session_id)
        if session is not None:
            session.on_update(update)

    async def request_permission(self, session_id, tool_call, options, **kwargs):
        option_id = await self._session(session_id).on_permission(tool_call, options)
        if option_id is None:
            return schema.RequestPermissionResponse(outcome=schema.DeniedOutcome(outcome="cancelled"))
        return schema.RequestPermissionResponse(outcome=schema.AllowedOutcome(outcome="selected", option_id=option_id))

    async def read_text_file(self, session_id, path, line=None, limit=None, **kwargs):
        async with self._serving(session_id) as session:
            content = await asyncio.to_thread(
                workspace.read_text,
                session.workspace,
                path,
                line=line,
                limit=limit,
                max_bytes=self._process.spec.max_file_bytes,
            )
        return schema.ReadTextFileResponse(content=content)

    async def write_text_file(self, session_id, path, content, **kwargs):
        async with self._serving(session_id) as session:
            await asyncio.to_thread(
                workspace.write_text,
                session.workspace,
                path,
                content,
                max_bytes=self._process.spec.max_file_bytes,
                owner=self._process.uid,
            )
        return schema.WriteTextFileResponse()

    def _terminals(self, session: AcpSession, method: str):
        if not self._process.spec.terminal:
            raise acp.RequestError.method_not_found(method)
        return session.terminals

    async def create_terminal(
        self, session_id, command, args=None, env=None, cwd=None, output_byte_limit=None, **kwargs
    ):
        async with self._serving(session_id) as session:
            terminals = self._terminals(session, "terminal/create")
            terminal_id = await terminals.create(command, args, env, cwd, output_byte_limit)
        return schema.CreateTerminalResponse(terminal_id=terminal_id)

    async def terminal_output(self, session_id, terminal_id, **kwargs):
        async with self._serving(session_id) as session:
            return self._terminals(session, "terminal/output").output(terminal_id)

    async def wait_for_terminal_exit(self, session_id, terminal_id, **kwargs):
        async with self._serving(session_id) as session:
            return await self._terminals(session, "terminal/wait_for_exit").wait(terminal_id)

    async def kill_terminal(self, session_id, terminal_id, **kwargs):
        async with self._serving(session_id) as session:
            self._terminals(session, "terminal/kill").kill(terminal_id)
        return {}

    async def release_terminal(self, session_id, terminal_id, **kwargs):
        async with self._serving(session_id) as session:
            self._terminals(session, "terminal/release").release(terminal_id)
        return {}

    # What else acp.Client declares, answered as the SDK answers a client without it.

    async def create_elicitation(
        self, message: str, mode: schema.ElicitationMode, **kwargs: Any
    ) -> schema.CreateElicitationResponse:
        raise acp.RequestError.method_not_found("elicitation/create")

    async def complete_elicitation(self, elicitation_id: str, **kwargs: Any) -> None:
        raise acp.RequestError.method_not_found("elicitation/complete")

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        raise acp.RequestError.method_not_found(f"_{method}")

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None

    def on_connect(self, conn: acp.Agent) -> None:
        return None


_UNIT_LOCKS: dict[str, asyncio.Lock] = {}


def _unit_lock(unit: str) -> asyncio.Lock:
    return _UNIT_LOCKS.setdefault(unit, asyncio.Lock())


class AgentProcess:
    """One running agent (a child process) and the ACP connection to it."""

    noun = "ACP agent"  # in log lines
    what = "agent"  # in sentences: "The agent command could not be started"

    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.sessions: dict[str, AcpSession] = {}  # by ACP session id
        self.process: asyncio.subprocess.Process | None = None
        self.conn: acp.ClientSideConnection | None = None  # once started
        self.capabilities = schema.AgentCapabilities()
        self.failure: str | None = None  # a safe sentence once it is stopped or gone
        self.last_used = time.monotonic()
        self.users = 0  # turns using it right now
        self._output: _AgentOutput | None = None
        self._stderr: deque[str] = deque(maxlen=20)
        self._tasks: list[asyncio.Task] = []
        self.uid: int | None = None  # the isolation unit's uid (when the service runs as root)
        self.tmp: Path | None = None
        self.proxy: EgressProxy | None = None
        self._policy: dict | None = None
        self.mode: str | None = None  # the sandbox mode it started in
        self.cgroup: cgroups.UnitGroup | None = None
        self._oom_base = 0  # the kernel's OOM kills in its cgroup before it started
        self._disk_floor = 0  # disk use that does not count as a breach (what the unit had at start)
        self._breach = False

    @property
    def alive(self) -> bool:
        return self.failure is None and self.process is not None and self.process.returncode is None

    @property
    def starting(self) -> bool:
        return self.failure is None and self.process is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    @property
    def connection(self) -> acp.ClientSideConnection:
        """The ACP connection; an agent's sessions exist only once it started."""
        if self.conn is None:
            raise AgentError(self.failure or f"The {self.what} is not started.")
        return self.conn

    async def start(self) -> None:
        pipes = await self.spawn()
        self._output = _AgentOutput(pipes.stdout, pipes.stdin)
        self.conn = conn = acp.connect_to_agent(BridgeClient(self), self._output)
        capabilities = schema.ClientCapabilities(
            fs=schema.FileSystemCapabilities(read_text_file=True, write_text_file=True), terminal=self.spec.terminal
        )
        try:
            response = await self.call(
                conn.initialize(
                    protocol_version=PROTOCOL_VERSION,
                    client_capabilities=capabilities,
                    client_info=schema.Implementation(name="aap-hosting", title="AAP hosting", version="1.0.0"),
                ),
                "initialize",
            )
        except BaseException:
            await self.stop(self.failure or "The agent did not start.", kill=True)
            raise
        self.capabilities = response.agent_capabilities or schema.AgentCapabilities()

    async def spawn(self) -> Pipes:
        """Start the process in its sandbox (stdin and stdout piped, stderr kept) and watch it;
        what it speaks over its pipes is the caller's (ACP here, MCP for agents.mcp)."""
        sandbox.harden_host()
        env_fd: int | None = None
        try:
            argv, env, cwd, env_fd = await self._command()
        except sandbox.SandboxError as exc:
            self.failure = str(exc)
            logger.error("%s %s: %s", self.noun, self.spec.label, self.failure)
            await self._close_proxy()
            raise AgentError(self.failure) from None
        try:
            process = self.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=cwd,
                start_new_session=True,
                limit=STREAM_LIMIT,
                pass_fds=(env_fd,) if env_fd is not None else (),
            )
        except OSError as exc:
            self.failure = f"The {self.what} command could not be started ({type(exc).__name__})."
            logger.error("%s %s: %s", self.noun, self.spec.label, self.failure)
            await self._close_proxy()
            raise AgentError(self.failure) from None
        finally:
            if env_fd is not None:
                os.close(env_fd)
        pipes = Pipes.of(process)
        if self.spec.sandbox is None:
            logger.warning(
                "%s %s started WITHOUT A SANDBOX (pid %s, %s): unsafeWithoutSandbox is set; it has the worker's reach",
                self.noun,
                self.spec.label,
                process.pid,
                self.spec.argv[0],
            )
        else:
            logger.info(
                "%s %s started (pid %s, %s, sandboxed as uid %s)",
                self.noun,
                self.spec.label,
                process.pid,
                self.spec.argv[0],
                self.uid if self.uid is not None else os.getuid(),
            )
        metrics.acp_process_started()
        loop = asyncio.get_running_loop()
        # Its own log ids, not those of the turn that happened to start it (a process outlives
        # that turn and may serve other sessions).
        unit_context = self.log_context()
        self._tasks = [
            loop.create_task(self._drain_stderr(pipes.stderr), context=unit_context.copy()),
            loop.create_task(self._watch(process), context=unit_context.copy()),
        ]
        return pipes

    async def _command(self) -> tuple[list[str], dict, Path, int | None]:
        """The argv, environment and cwd that start the agent (in its sandbox, unless opted out),
        and the descriptor carrying the agent's environment to the launcher as data."""
        spec, box = self.spec, self.spec.sandbox
        if box is None:
            home = workspace.ensure_dir(spec.home)
            if spec.gateway is not None:  # for the gateway only: unconfined, the agent reaches anything
                self.proxy = EgressProxy((), spec.label, gateway=self._gateway())
                await self.proxy.start()
            env = {**sandbox.environment(home, home, None), **spec.env, **self._gateway_env(), "HOME": str(home)}
            return [sandbox.resolve(spec.argv[0], env["PATH"]), *spec.argv[1:]], env, home, None
        self.mode = await asyncio.to_thread(sandbox.mode)
        gaps = await asyncio.to_thread(sandbox.gaps)
        if gaps:
            raise sandbox.SandboxError(sandbox.refuse_sentence(gaps))
        if sandbox.as_root():
            async with _unit_lock(box.unit):  # never while a stop of the same unit still kills its uid
                self.uid = await asyncio.to_thread(sandbox.unit_uid, box.unit)
        tmp = await asyncio.to_thread(sandbox.prepare, box, self.uid, spec.home)
        self.tmp = tmp
        namespaces = self.mode == "namespaces"
        egress_socket = None
        if box.egress or spec.gateway is not None:
            self.proxy = EgressProxy(box.egress, spec.label, gateway=self._gateway())
            if namespaces:  # reached through a socket mounted into the unit's own network namespace
                directory = await asyncio.to_thread(sandbox.egress_socket_dir)
                egress_socket = str(directory / f"{secrets.token_hex(12)}.sock")
                await self.proxy.start(unix_path=egress_socket, agent_port=sandbox.RELAY_PORT)
                await asyncio.to_thread(sandbox.give_socket, egress_socket, self.uid)
            else:
                await self.proxy.start()
        proxy_url = self.proxy.url if self.proxy else None
        env = {
            **sandbox.environment(spec.home, tmp, proxy_url),
            **spec.env,
            **self._gateway_env(),
            **sandbox.fixed_environment(
                spec.home, tmp, proxy_url, own_loopback=namespaces and not sandbox.names_loopback(box.egress)
            ),
        }
        executable = sandbox.resolve(spec.argv[0], env["PATH"])
        base_tasks = 0
        if self.uid is None:  # RLIMIT_NPROC counts every task of the service's own uid too
            base_tasks = (await asyncio.to_thread(limits.snapshot)).unit(uid=os.getuid(), pgid=None)[1]
        policy = await asyncio.to_thread(
            sandbox.policy,
            box,
            executable,
            uid=self.uid,
            cwd=spec.home,
            proxy_port=self.proxy.port if self.proxy and not namespaces else None,
            base_tasks=base_tasks,
        )
        async with _unit_lock(box.unit):
            self.cgroup = await asyncio.to_thread(cgroups.create, box.unit, box.limits)
            self._oom_base = self.cgroup.oom_kills() if self.cgroup else 0
        procs = self.cgroup.procs_files if self.cgroup else []
        if self.cgroup is not None:  # the kernel bounds the unit's memory as a whole: no per-process
            # data limit, which starves runtimes that reserve large address ranges (Bun, the JVM)
            policy["limits"] = {name: value for name, value in policy["limits"].items() if name != "data"}
        if namespaces:
            policy = sandbox.namespace_policy(policy, egress_socket=egress_socket, cgroup_procs=procs)
        else:
            policy = {**policy, "mode": "fallback", "cgroups": procs}
        self._policy = policy
        self._disk_floor = await asyncio.to_thread(limits.disk_bytes, box.writable)
        env_fd = sandbox.env_descriptor(env)
        argv = sandbox.launcher_argv({**policy, "env_fd": env_fd}, [executable, *spec.argv[1:]])
        return argv, sandbox.launcher_environment(), spec.home, env_fd

    def confined(self, argv: list[str], cwd: Path, env: dict) -> tuple[list[str], dict, int | None]:
        """`argv` (a terminal command) under this agent's sandbox, started in `cwd` with `env`:
        the argv and environment to start, and the descriptor carrying `env` as data (the
        caller closes it once the command started)."""
        if self._policy is None:
            return argv, env, None
        executable = sandbox.resolve(argv[0], sandbox.sandbox_path())
        env_fd = sandbox.env_descriptor(env)
        policy = {**self._policy, "cwd": str(cwd), "env_fd": env_fd}
        return sandbox.launcher_argv(policy, [executable, *argv[1:]]), sandbox.launcher_environment(), env_fd

    async def own(self, path: Path) -> None:
        """Give a directory the service created for this agent (a workspace) to its uid."""
        if self.uid is not None:
            await asyncio.to_thread(sandbox.own, path, self.uid)

    async def check_limits(self, snap: limits.Snapshot | None = None, *, disk: bool = True) -> str | None:
        """A sentence when the unit is past one of its limits (then its processes are stopped).
        `snap` is the runtime's shared view of the processes (taken now when not given)."""
        box = self.spec.sandbox
        if box is None or self.process is None or self.failure is not None:
            return self.failure if self.failure and self._breach else None
        bounds = box.limits
        if snap is None:
            snap = await asyncio.to_thread(limits.snapshot)
        pids, tasks = await asyncio.to_thread(self._members, snap)
        # What no path leads to: memfds (memory) and deleted files it keeps open (disk).
        hidden_memory, hidden_disk = await asyncio.to_thread(limits.hidden_bytes, pids)
        breach = None
        if tasks >= bounds.processes:
            breach = f"The agent reached its limit of {bounds.processes} processes and threads"
        elif (self.cgroup is not None and self.cgroup.oom_kills() > self._oom_base) or (
            self.cgroup is None
            and (await asyncio.to_thread(limits.resident_bytes, pids) + hidden_memory > bounds.memory_bytes)
        ):  # the kernel held the limit
            breach = f"The agent used more than its memory limit of {limits.mib(bounds.memory_bytes)}"
        elif disk:
            used = await asyncio.to_thread(limits.disk_bytes, box.writable) + hidden_disk
            if used > max(bounds.disk_bytes, self._disk_floor):
                breach = (
                    f"The agent's workspace and home hold more than its disk limit of {limits.mib(bounds.disk_bytes)}"
                )
            else:  # what it deleted no longer counts as allowed
                self._disk_floor = min(self._disk_floor, max(used, bounds.disk_bytes))
        if breach is None or self.failure is not None:
            return None
        breach += "; its processes were stopped."
        self._breach = True
        logger.warning("ACP agent %s: %s", self.spec.label, breach)
        await self.stop(breach, kill=True)
        return breach

    def log_ids(self) -> dict[str, str | None]:
        """The unit's own log ids: its tenant, and its session when the unit is one session's
        (nothing of whichever turn is running)."""
        kind, _, rest = (self.spec.sandbox.unit if self.spec.sandbox else "").partition(":")
        tenant, _, detail = rest.partition("/")
        return {"tenant": tenant or None, "session": detail if kind == "session" else None}

    def log_context(self) -> contextvars.Context:
        """A context whose log ids are only the unit's own (log_ids)."""
        ids = self.log_ids()

        def fresh() -> contextvars.Context:
            logs.reset_log_context(**ids)
            return contextvars.copy_context()

        return contextvars.Context().run(fresh)

    def _members(self, snap: limits.Snapshot) -> tuple[list[int], int]:
        """The unit's processes and their task count: its cgroup's where it has one (the
        kernel's own count), else its uid's, else its PID namespace's (namespaces mode: what
        it started cannot leave it), else its process group's."""
        if self.cgroup is not None:
            return self.cgroup.pids(), self.cgroup.tasks()
        if self.uid is None and self.mode == "namespaces" and self.process is not None:
            return limits.namespace_members(self.process.pid)
        return snap.unit(uid=self.uid, pgid=self.process.pid if self.process else None)

    def _gateway(self) -> ModelGateway | None:
        if self.spec.gateway is None:
            return None
        return ModelGateway(self.spec.gateway, self.spec.label, self.add_usage)

    def _gateway_env(self) -> dict:
        """The gateway's URL and the unit's token, as the agent's environment gets them."""
        if self.proxy is None or self.proxy.gateway is None:
            return {}
        return self.proxy.gateway.environment(self.proxy.url)

    def add_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Model usage the gateway metered for this unit: the running prompt's. When several
        run at once (a tenant's sessions sharing the process), the oldest of those not waiting
        on the application's permission (else the oldest) gets it."""
        running = [s.prompt for s in self.sessions.values() if s.prompt is not None and s.prompt.finished_at is None]
        if not running:
            logger.info(
                "model gateway: agent %s used %s prompt + %s completion tokens outside any prompt; not counted",
                self.spec.label,
                prompt_tokens,
                completion_tokens,
            )
            return
        working = [prompt for prompt in running if not prompt.pending_waiters()] or running
        min(working, key=lambda prompt: prompt.started_at).add_usage(prompt_tokens, completion_tokens)

    async def _close_proxy(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()

    async def call(self, awaitable, what: str):
        """Await one request to the agent within the start timeout; failures become AgentError."""
        try:
            return await asyncio.wait_for(awaitable, self.spec.start_timeout)
        except TimeoutError:
            self.failure = (
                self.failure or f"The agent did not answer {what} within {self.spec.start_timeout:g} seconds."
            )
            await self.stop(self.failure, kill=True)
            raise AgentError(self.failure) from None
        except acp.RequestError as exc:
            logger.warning(
                "ACP agent %s refused %s: %s %s", self.spec.label, what, exc.code, self.spec.redact(str(exc))[:300]
            )
            raise AgentError(f"The agent refused {what} (JSON-RPC error {exc.code}).") from None
        except (ConnectionError, OSError):
            raise AgentError(await self.explain()) from None

    async def explain(self) -> str:
        """Why the connection to the agent broke, as a safe sentence (and make sure it is stopped)."""
        if self._output is not None and self._output.garbage and self.failure is None:
            self.failure = "The agent wrote output that is not ACP JSON-RPC; its process was stopped."
            await self.stop(self.failure, kill=True)
        if self.failure is None and self.process is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.process.wait()), 3)
            if self.failure is None and self.process.returncode is not None:
                failure = await self._exit_failure(self.process.returncode)
                self.failure = self.failure or failure
        if self.failure is None:
            self.failure = "The connection to the agent broke; its process was stopped."
            await self.stop(self.failure, kill=True)
        return self.failure

    async def _drain_stderr(self, stderr: asyncio.StreamReader) -> None:
        # Kept in memory (redacted when logged): an agent may print anything there.
        with contextlib.suppress(Exception):
            while line := await stderr.readline():
                self._stderr.append(line.decode("utf-8", errors="replace").rstrip()[:500])

    async def _exit_failure(self, code: int) -> str:
        """Why the process exited, as a safe sentence: its sandbox's own, a limit, or the code."""
        if code == sandbox.EXIT_SETUP_FAILED:
            with contextlib.suppress(TimeoutError):  # the launcher's sentence is on stderr, being drained
                await asyncio.wait_for(asyncio.shield(self._tasks[0]), 1)
            sentence = sandbox.setup_failure(self._stderr)
            if sentence:
                logger.error("ACP agent %s: %s", self.spec.label, sentence)
                return sentence
        if self.spec.sandbox is not None:
            sentence = limits.exit_sentence(code, self.spec.sandbox.limits)
            if sentence:
                return sentence
            if self.cgroup is not None and self.cgroup.oom_kills() > self._oom_base:
                self._breach = True  # the kernel killed it at the unit's memory limit
                bound = limits.mib(self.spec.sandbox.limits.memory_bytes)
                sentence = f"The agent used more than its memory limit of {bound}; its processes were stopped."
                logger.warning("ACP agent %s: %s", self.spec.label, sentence)
                return sentence
        tail = self.spec.redact("\n".join(self._stderr))
        logger.warning(
            "%s %s (pid %s) exited with code %s; last stderr lines:\n%s",
            self.noun,
            self.spec.label,
            self.pid,
            code,
            tail,
        )
        return f"The agent process exited unexpectedly (exit code {code})."

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        metrics.acp_process_exited()
        reason: str | None = None  # set when it exited on its own: no stop is under way
        if self.failure is None:
            failure = await self._exit_failure(code)
            reason = self.failure = self.failure or failure
        for session in list(self.sessions.values()):
            session.close()
        if reason is not None:  # what it left running goes too
            try:
                await self.stop(reason)
            except Exception:  # the watcher's boundary: the unit is killed with the worker at worst
                logger.warning("stopping what ACP agent %s left failed", self.spec.label, exc_info=True)

    async def stop(self, reason: str, *, kill: bool = False) -> None:
        """Stop the process (gracefully unless `kill`); once it is gone, so is the rest of its
        unit, however it stopped (by cgroup and uid, or by process group without either); every
        request to it fails."""
        if self.failure is None:
            self.failure = reason
        if self.process is not None and self.process.returncode is None:
            logger.info("stopping %s %s (pid %s): %s", self.noun, self.spec.label, self.process.pid, reason)
        if (self.uid is not None or self.cgroup is not None) and self.spec.sandbox is not None:
            async with _unit_lock(self.spec.sandbox.unit):  # no new process of the unit meanwhile
                if kill:
                    await self._kill_unit()
                await self._stop(kill)
                await self._kill_unit()
            return
        await self._stop(kill)
        self._signal(signal.SIGKILL)  # what it left behind in its process group

    async def _stop(self, kill: bool) -> None:
        for session in list(self.sessions.values()):
            session.close()
        process = self.process
        if process is not None and process.returncode is None:
            if kill:
                metrics.acp_process_killed()
                self._signal(signal.SIGKILL)
            else:  # as the agent expects: stdin closed (Agentao saves its sessions then), time to exit
                with contextlib.suppress(Exception):
                    if process.stdin is not None:
                        process.stdin.close()
                waits = ((settings.AAP_ACP_STOP_GRACE_SECONDS, signal.SIGTERM), (TERM_GRACE_SECONDS, signal.SIGKILL))
                for seconds, sig in waits:
                    try:
                        await asyncio.wait_for(asyncio.shield(process.wait()), seconds)
                        break
                    except TimeoutError:
                        self._signal(sig)
        if self.conn is not None:
            with contextlib.suppress(Exception):  # bounded: a stop must never hang the reaper
                await asyncio.wait_for(self.conn.close(), 5)
        if process is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(process.wait()), 5)
        self._signal(signal.SIGKILL)  # whatever it left behind in its process group
        await self._close_proxy()

    async def _kill_unit(self) -> None:
        """Kill everything this process of the unit started (what left its process group too):
        its cgroup, which nothing can leave, removed once empty; without one, every process of
        the unit's uid."""
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)
        elif self.uid is not None:
            await asyncio.to_thread(sandbox.kill_uid, self.uid)

    def _signal(self, sig: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
