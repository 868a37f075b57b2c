"""The egress proxy of one sandboxed agent process: its only way out of the host.

Landlock filters TCP connect by port only, so a sandboxed agent may connect to one port:
this proxy's, on 127.0.0.1, run by the worker (never by the agent). The proxy lets through
exactly the `host:port` pairs the operator declared for that agent (`egress`), as HTTP
`CONNECT` tunnels (HTTPS) or absolute-form HTTP requests (plain HTTP); anything else gets
`403` and a log line naming the agent and the refused destination. The agent finds it
through HTTP_PROXY / HTTPS_PROXY / ALL_PROXY, which the sandbox sets.

With a model gateway (gateway.py), requests to the proxy itself are the gateway's: origin
form (`POST /gateway/v1/chat/completions`) or absolute form naming the proxy's own address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from .gateway import ModelGateway

logger = logging.getLogger("agents.runtimes.acp")

HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 15.0
CHUNK = 64 * 1024
# Connections one agent process may hold open through its proxy at once: each costs the
# worker two descriptors, shared by every unit it runs.
MAX_CONNECTIONS = 64


def parse_destination(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    return host.strip("[]").lower(), int(port)


class EgressProxy:
    """An allowlisting forward proxy on 127.0.0.1 for one agent process."""

    def __init__(self, allowed: tuple[str, ...], label: str, *, gateway: ModelGateway | None = None):
        self.allowed = {parse_destination(entry) for entry in allowed}
        self.label = label
        self.gateway = gateway  # serves requests to the proxy itself
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None  # where it listens on the host's loopback (fallback mode)
        self.unix_path: str | None = None  # where it listens instead (namespaces mode)
        self.agent_port: int | None = None  # the port the agent reaches it on
        self._tasks: set[asyncio.Task] = set()
        self._full = False  # refusing connections past MAX_CONNECTIONS (logged once per run of them)

    @property
    def url(self) -> str:
        """The proxy's address as the agent sees it."""
        return f"http://127.0.0.1:{self.agent_port}"

    async def start(self, *, unix_path: str | None = None, agent_port: int | None = None) -> int | None:
        """Listen on the host's loopback (an ephemeral port), or on `unix_path`, a socket
        mounted into the agent's own network namespace, where a relay serves it on
        127.0.0.1:`agent_port`."""
        if unix_path is not None:
            self.server = await asyncio.start_unix_server(self._serve, unix_path, limit=HEAD_LIMIT)
            self.unix_path, self.agent_port = unix_path, agent_port
            return None
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT)
        self.port = self.agent_port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        self.server = None
        if self.gateway is not None:
            await self.gateway.close()
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._tasks) >= MAX_CONNECTIONS:  # each costs the worker two descriptors
            if not self._full:
                logger.warning(
                    "sandbox: agent %s holds %s connections through its egress proxy; more are refused",
                    self.label,
                    MAX_CONNECTIONS,
                )
            self._full = True
            with contextlib.suppress(Exception):
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                writer.close()
            return
        self._full = False
        task = asyncio.current_task()
        if task is None:  # never: asyncio.start_server runs each connection's callback as a task
            raise RuntimeError("an egress connection served outside a task")
        self._tasks.add(task)
        try:
            await self._handle(reader, writer)
        except (
            asyncio.CancelledError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ValueError,
            OSError,
        ):
            pass
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        line, _, rest = head.partition(b"\r\n")
        method, target, version = line.decode("latin-1").split(" ", 2)
        own = self._own_target(target)
        if own is not None and self.gateway is not None:
            await self.gateway.serve(method, own, rest, reader, writer)
            return
        if method.upper() == "CONNECT":
            host, port = parse_destination(target)
            forward = b""
        else:
            url = urlsplit(target)
            if url.scheme != "http" or not url.hostname:
                await self._refuse(writer, "only CONNECT and absolute http:// requests go through this proxy")
                return
            host, port = url.hostname.lower(), url.port or 80
            path = url.path or "/"
            if url.query:
                path += "?" + url.query
            forward = f"{method} {path} {version}\r\n".encode("latin-1") + rest
        if (host, port) not in self.allowed:
            logger.warning(
                "sandbox: agent %s tried to reach %s:%s, which its egress does not allow", self.label, host, port
            )
            await self._refuse(writer, f"{host}:{port} is not in this agent's egress allowlist")
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        except (OSError, TimeoutError):
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return
        if forward:
            up_writer.write(forward)
        else:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            with contextlib.suppress(Exception):
                up_writer.close()

    def _own_target(self, target: str) -> str | None:
        """The origin-form target of a request to the proxy itself (its gateway's), else None."""
        if self.gateway is None:
            return None
        if target.startswith("/"):
            return target
        url, own = urlsplit(target), urlsplit(self.url)
        with contextlib.suppress(ValueError):
            if url.scheme == "http" and url.hostname in (own.hostname, "localhost") and url.port == own.port:
                return (url.path or "/") + ("?" + url.query if url.query else "")
        return None

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while chunk := await source.read(CHUNK):
                sink.write(chunk)
                await sink.drain()
        finally:
            with contextlib.suppress(Exception):
                if sink.can_write_eof():
                    sink.write_eof()

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, reason: str) -> None:
        body = f"Refused by the sandbox: {reason}.\n".encode()
        writer.write(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
