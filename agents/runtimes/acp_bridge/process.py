"""An ACP agent process: spawned, initialized, served (the client side of ACP), and stopped.

The process gets a trimmed environment (acp.default_environment()), its HOME, the operator's
static environment and the options routed to environment variables — secrets travel only
there, never in argv. It runs in its own process group so stopping it also stops whatever
it spawned. Its stdout must carry ACP JSON-RPC only: any other line ends the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import acp
from acp import schema
from acp._transport import NdjsonTransport
from acp.task import MessageSender, TaskSupervisor

from agents.runtimes.base import AgentError
from hosting import metrics

from . import workspace
from .session import AcpSession

logger = logging.getLogger("agents.runtimes.acp")

PROTOCOL_VERSION = 1
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

    def redact(self, text: str) -> str:
        for value in self.env.values():
            if len(value) >= 4:
                text = text.replace(value, "***")
        return text


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
                workspace.read_text, session.workspace, path, line=line, limit=limit,
                max_bytes=self._process.spec.max_file_bytes,
            )
        return schema.ReadTextFileResponse(content=content)

    async def write_text_file(self, session_id, path, content, **kwargs):
        async with self._serving(session_id) as session:
            await asyncio.to_thread(
                workspace.write_text, session.workspace, path, content, max_bytes=self._process.spec.max_file_bytes
            )
        return schema.WriteTextFileResponse()

    def _terminals(self, session: AcpSession, method: str):
        if not self._process.spec.terminal:
            raise acp.RequestError.method_not_found(method)
        return session.terminals

    async def create_terminal(self, session_id, command, args=None, env=None, cwd=None, output_byte_limit=None,
                              **kwargs):
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


class AgentProcess:
    """One running agent (a child process) and the ACP connection to it."""

    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.sessions: dict[str, AcpSession] = {}  # by ACP session id
        self.process: asyncio.subprocess.Process | None = None
        self.conn = None
        self.capabilities = schema.AgentCapabilities()
        self.failure: str | None = None  # a safe sentence once it is stopped or gone
        self.last_used = time.monotonic()
        self.users = 0  # turns using it right now
        self._output: _AgentOutput | None = None
        self._stderr: deque[str] = deque(maxlen=20)
        self._tasks: list[asyncio.Task] = []

    @property
    def alive(self) -> bool:
        return self.failure is None and self.process is not None and self.process.returncode is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    async def start(self) -> None:
        home = workspace.ensure_dir(self.spec.home)
        env = {**acp.default_environment(), "HOME": str(home), **self.spec.env}
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.spec.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, cwd=home, start_new_session=True, limit=STREAM_LIMIT,
            )
        except OSError as exc:
            self.failure = f"The agent command could not be started ({type(exc).__name__})."
            logger.error("ACP agent %s: %s", self.spec.label, self.failure)
            raise AgentError(self.failure) from None
        logger.info("ACP agent %s started (pid %s, %s)", self.spec.label, self.process.pid, self.spec.argv[0])
        metrics.acp_process_started()
        self._output = _AgentOutput(self.process.stdout, self.process.stdin)
        self.conn = acp.connect_to_agent(BridgeClient(self), self._output)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._drain_stderr()), loop.create_task(self._watch())]
        capabilities = schema.ClientCapabilities(
            fs=schema.FileSystemCapabilities(read_text_file=True, write_text_file=True), terminal=self.spec.terminal
        )
        try:
            response = await self.call(
                self.conn.initialize(
                    protocol_version=PROTOCOL_VERSION, client_capabilities=capabilities,
                    client_info=schema.Implementation(name="aap-hosting", title="AAP hosting", version="1.0.0"),
                ),
                "initialize",
            )
        except BaseException:
            await self.stop(self.failure or "The agent did not start.", kill=True)
            raise
        self.capabilities = response.agent_capabilities or schema.AgentCapabilities()

    async def call(self, awaitable, what: str):
        """Await one request to the agent within the start timeout; failures become AgentError."""
        try:
            return await asyncio.wait_for(awaitable, self.spec.start_timeout)
        except TimeoutError:
            self.failure = self.failure or f"The agent did not answer {what} within {self.spec.start_timeout:g} seconds."
            await self.stop(self.failure, kill=True)
            raise AgentError(self.failure) from None
        except acp.RequestError as exc:
            logger.warning("ACP agent %s refused %s: %s %s", self.spec.label, what, exc.code,
                           self.spec.redact(str(exc))[:300])
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
                self.failure = f"The agent process exited unexpectedly (exit code {self.process.returncode})."
        if self.failure is None:
            self.failure = "The connection to the agent broke; its process was stopped."
            await self.stop(self.failure, kill=True)
        return self.failure

    async def _drain_stderr(self) -> None:
        # Kept in memory (redacted when logged): an agent may print anything there.
        with contextlib.suppress(Exception):
            while line := await self.process.stderr.readline():
                self._stderr.append(line.decode("utf-8", errors="replace").rstrip()[:500])

    async def _watch(self) -> None:
        code = await self.process.wait()
        metrics.acp_process_exited()
        if self.failure is None:
            self.failure = f"The agent process exited unexpectedly (exit code {code})."
            tail = self.spec.redact("\n".join(self._stderr))
            logger.warning("ACP agent %s (pid %s) exited with code %s; last stderr lines:\n%s",
                           self.spec.label, self.process.pid, code, tail)
        for session in list(self.sessions.values()):
            session.close()

    async def stop(self, reason: str, *, kill: bool = False) -> None:
        """Stop the process (gracefully unless `kill`); every request to it fails."""
        if self.failure is None:
            self.failure = reason
        for session in list(self.sessions.values()):
            session.close()
        process = self.process
        if process is not None and process.returncode is None:
            logger.info("stopping ACP agent %s (pid %s): %s", self.spec.label, process.pid, reason)
            if kill:
                metrics.acp_process_killed()
                self._signal(signal.SIGKILL)
            else:
                with contextlib.suppress(Exception):
                    process.stdin.close()
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        await asyncio.wait_for(asyncio.shield(process.wait()), 2)
                        break
                    except TimeoutError:
                        self._signal(sig)
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
        if process is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(process.wait()), 5)
        self._signal(signal.SIGKILL)  # whatever it left behind in its process group

    def _signal(self, sig: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
