"""Connections to MCP servers, with the official `mcp` SDK's ClientSession.

A stdio server is a process started by the ACP sandbox's launcher (acp_bridge.process:
the same walls, uid, limits, egress proxy and clean environment as an ACP agent), its
stdin/stdout carrying MCP's newline-delimited JSON-RPC. A remote server is reached over
streamable HTTP through the network guard (agents.netguard: the checked address pinned, no
private address unless the operator allows it for that server).

A connection is one task owning the SDK's session (its task group lives and dies in that
task); tool calls are made from the turns' tasks. A pool keeps one connection per unit and
server (agents.mcp.pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import mcp_types as types
from mcp import ClientSession
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types import CONNECTION_CLOSED

from infra import logs

from ..netguard import AddressRefused, GuardedTransport, checked_address
from ..runtimes.acp_bridge import limits, sandbox
from ..runtimes.acp_bridge.process import MAX_MESSAGE_BYTES, AgentProcess, ProcessSpec
from ..runtimes.mcp_config import Server

logger = logging.getLogger("agents.mcp")

CLIENT_INFO = types.Implementation(name="aap-hosting", title="AAP hosting", version="1.0.0")


class McpFailure(Exception):
    """The server could not serve: a sentence safe to show the model and the application."""


class ServerProcess(AgentProcess):
    """A stdio MCP server's process, started and confined like an ACP agent's."""

    noun = "MCP server"
    what = "MCP server"

    def __init__(self, spec: ProcessSpec, ids: dict[str, str | None]):
        super().__init__(spec)
        self._ids = ids

    def log_ids(self) -> dict[str, str | None]:
        return dict(self._ids)


def process_spec(server: Server, *, key: str, label: str, unit: str, home: Path, env: dict[str, str]) -> ProcessSpec:
    """What starts a stdio server: in its sandbox, unless the operator set the server's
    `unsafeWithoutSandbox` (then unconfined, as the worker's user; each start logs a warning)."""
    raw = server.raw
    box = (
        None
        if raw.get("unsafeWithoutSandbox") is True
        else sandbox.SandboxSpec(
            unit=unit,
            writable=(home,),
            read_paths=tuple(raw.get("readPaths") or ()),
            egress=tuple(raw.get("egress") or ()),
            limits=limits.Limits.parse(raw.get("limits")),
        )
    )
    return ProcessSpec(
        key=key,
        label=label,
        argv=(raw["command"], *(raw.get("args") or ())),
        env=env,
        home=home,
        sandbox=box,
        start_timeout=server.start_timeout,
        idle=server.idle,
    )


@asynccontextmanager
async def _stdio(process: ServerProcess, closed: Callable[[], None]) -> AsyncIterator[tuple]:
    """The process's pipes as the SDK's read and write streams."""
    pipes = await process.spawn()
    reader_out, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](16)
    write_stream, writer_in = anyio.create_memory_object_stream[SessionMessage](16)

    async def read() -> None:
        stdout = pipes.stdout
        async with reader_out:
            while True:
                try:
                    line = await stdout.readline()
                except (ValueError, OSError):  # a line past the stream's limit, a broken pipe
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    if len(line) > MAX_MESSAGE_BYTES:
                        raise ValueError("message too large")
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError:
                    process.failure = process.failure or "The MCP server wrote output that is not MCP JSON-RPC."
                    break
                await reader_out.send(SessionMessage(message))
        closed()

    async def write() -> None:
        stdin = pipes.stdin
        async with writer_in:
            async for item in writer_in:
                data = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                try:
                    stdin.write(data.encode())
                    await stdin.drain()
                except (ConnectionError, OSError):
                    closed()
                    return

    tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(write())]
    try:
        yield read_stream, write_stream
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def _http(server: Server, headers: dict[str, str]) -> AsyncIterator[tuple]:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    raw = server.raw
    url = urlsplit(raw["url"])
    allow_private = bool(raw.get("allowPrivateAddresses"))
    port = url.port or (443 if url.scheme == "https" else 80)
    # Checked before anything is sent; the transport checks and pins every request again.
    await checked_address(url.hostname or "", port, allow_private=allow_private)
    client = httpx2.AsyncClient(
        transport=GuardedTransport(allow_private=allow_private),
        headers=headers,
        timeout=httpx2.Timeout(server.timeout, read=max(server.timeout, 300.0)),
        trust_env=False,
    )
    async with client, streamable_http_client(raw["url"], http_client=client) as streams:
        yield streams[0], streams[1]


class Connection:
    """One MCP client session with one server, owned by a task of its own."""

    def __init__(
        self,
        server: Server,
        label: str,
        ids: dict[str, str | None],
        *,
        spec: ProcessSpec | None = None,
        headers: dict[str, str] | None = None,
        secrets: tuple[str, ...] = (),
        on_tools_changed: Callable[[Connection], None] | None = None,
    ):
        self.server = server
        self.label = label
        self.ids = ids
        self.process = ServerProcess(spec, ids) if spec is not None else None
        self.headers = headers or {}
        self.secrets = tuple(value for value in secrets if len(value) >= 4)
        self.on_tools_changed = on_tools_changed
        self.session: ClientSession | None = None
        self.failure: str | None = None
        self.users = 0
        self.last_used = time.monotonic()
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.failure is None and self._task is not None and not self._task.done()

    def redact(self, text: str) -> str:
        for value in self.secrets:
            text = text.replace(value, "***")
        return text

    async def start(self) -> None:
        """Connect and initialize within the server's start timeout; McpFailure otherwise."""
        context = contextvars.Context()
        context.run(logs.reset_log_context, **self.ids)
        self._task = asyncio.get_running_loop().create_task(self._run(), context=context)
        waiter = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait({waiter, self._task}, timeout=self.server.start_timeout, return_when="FIRST_COMPLETED")
        finally:
            waiter.cancel()
        if self.session is None or self.failure is not None:
            if self.failure is None:
                self.failure = (
                    f"The MCP server '{self.server.name}' did not start within {self.server.start_timeout:g} seconds."
                )
                logger.error("MCP server %s: %s", self.label, self.failure)
            await self.close(kill=True)
            raise McpFailure(self.failure)

    def _closed(self) -> None:
        self._stop.set()

    async def _run(self) -> None:
        crashed: BaseException | None = None
        try:
            if self.process is not None:
                transport = _stdio(self.process, self._closed)
            else:
                transport = _http(self.server, self.headers)
            async with (
                transport as (read, write),
                ClientSession(read, write, client_info=CLIENT_INFO, message_handler=self._on_message) as session,
            ):
                await session.initialize()
                self.session = session
                self._ready.set()
                await self._stop.wait()
        except asyncio.CancelledError:
            raise
        except AddressRefused as exc:
            self.failure = f"The MCP server '{self.server.name}' cannot be reached: {exc}"
            logger.error("MCP server %s: %s", self.label, self.failure)
        except BaseException as exc:  # the SDK raises exception groups from its task groups
            crashed = exc
            # The log renders frames, not the message: a transport's message may carry what it sent.
            logger.error("MCP server %s failed", self.label, exc_info=exc)
        finally:
            self.session = None
            exited = False
            if self.failure is None and self.process is not None and self.process.process is not None:
                with contextlib.suppress(TimeoutError):  # its pipes closed: say how it exited
                    await asyncio.wait_for(asyncio.shield(self.process.process.wait()), 2)
                    exited = True
                await asyncio.sleep(0)
            if self.failure is None:
                self.failure = self._why(crashed) if crashed is not None and not exited else self._exit_sentence()
            self._ready.set()
            if self.process is not None:
                with contextlib.suppress(Exception):
                    await self.process.stop(self.failure or "The MCP server was stopped.", kill=True)

    def _ours(self, sentence: str) -> str:
        """A sentence of the sandbox's process, about this server (whose opt-out is its own)."""
        named = f"The MCP server '{self.server.name}'"
        sentence = sentence.replace("unsafeWithoutSandbox for this agent.", "unsafeWithoutSandbox for this MCP server.")
        sentence = sentence.replace("The agent command", f"The command of MCP server '{self.server.name}'")
        return sentence.replace("The agent process", named).replace("The agent", named)

    def _why(self, exc: BaseException) -> str:
        if self.process is not None and self.process.failure:
            return self._ours(self.process.failure)
        return f"The MCP server '{self.server.name}' failed ({type(exc).__name__})."

    def _exit_sentence(self) -> str:
        if self.process is not None and self.process.failure:
            return self._ours(self.process.failure)
        if (
            self.process is not None
            and self.process.process is not None
            and self.process.process.returncode is not None
        ):
            return f"The MCP server '{self.server.name}' exited (exit code {self.process.process.returncode})."
        return f"The MCP server '{self.server.name}' closed its connection."

    async def _on_message(self, message) -> None:
        if isinstance(message, types.ToolListChangedNotification) and self.on_tools_changed is not None:
            self.on_tools_changed(self)

    async def list_tools(self) -> list[types.Tool]:
        if self.session is None:
            raise McpFailure(self.failure or f"The MCP server '{self.server.name}' is not connected.")
        tools: list[types.Tool] = []
        cursor = None
        for _ in range(100):  # pages
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            result = await asyncio.wait_for(self.session.list_tools(params=params), self.server.timeout)
            tools.extend(result.tools)
            cursor = result.next_cursor
            if not cursor:
                break
        return tools

    async def call_tool(self, name: str, arguments: dict) -> types.CallToolResult:
        """One tools/call within the server's timeout. A cancelled caller cancels the call (the
        SDK sends notifications/cancelled); a server that dies or hangs raises McpFailure."""
        session = self.session
        if session is None:
            raise McpFailure(self.failure or f"The MCP server '{self.server.name}' is not connected.")
        self.users += 1
        self.last_used = time.monotonic()
        try:
            call = asyncio.ensure_future(session.call_tool(name, arguments))
            stopped = asyncio.ensure_future(self._stop.wait())
            try:
                done, _ = await asyncio.wait(
                    {call, stopped}, timeout=self.server.timeout, return_when="FIRST_COMPLETED"
                )
            finally:
                stopped.cancel()
                if not call.done():
                    call.cancel()
                    with contextlib.suppress(BaseException):
                        await call
            error = call.exception() if call in done else None
            closed = isinstance(error, MCPError) and error.code == CONNECTION_CLOSED
            if call in done and not closed:
                failure = call.exception()
                if failure is not None and not isinstance(failure, MCPError):
                    logger.error("MCP server %s failed tools/call %s", self.label, name, exc_info=failure)
                    raise McpFailure(f"The MCP server '{self.server.name}' failed ({type(failure).__name__}).")
                return call.result()
            if not done:
                logger.error("MCP server %s did not answer tools/call %s in time", self.label, name)
                raise McpFailure(
                    f"The MCP server '{self.server.name}' did not answer within {self.server.timeout:g} seconds."
                )
            if self._task is not None:  # it has one: it made the session
                with contextlib.suppress(TimeoutError):  # the connection's task says why it ended
                    await asyncio.wait_for(asyncio.shield(self._task), 5)
            raise McpFailure(self.failure or self._exit_sentence())
        finally:
            self.users -= 1
            self.last_used = time.monotonic()

    async def close(self, *, kill: bool = False) -> None:
        self._stop.set()
        if self._task is None:
            return
        if kill:
            self.failure = self.failure or "The MCP server was stopped."
            if self.process is not None:
                with contextlib.suppress(Exception):
                    await self.process.stop(self.failure, kill=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), 15)
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
