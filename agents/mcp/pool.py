"""The connections of one process: one per unit (a session's or a tenant's) and server,
reused across turns; stopped when idle longer than the server's `idleSeconds`, when its session
is deleted (in any worker: told through Redis), or when its unit breaks a limit."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable

from django.conf import settings

from infra import logs

from ..runtimes.acp_bridge import limits, routing
from .connection import Connection

logger = logging.getLogger("agents.mcp")

REAP_INTERVAL_SECONDS = 2.0


class Pool:
    """The connections of one process, by key (unit and server); idle ones are stopped."""

    def __init__(self):
        self._connections: dict[str, Connection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: dict[str, asyncio.Task] = {}

    async def get(self, key: str, make: Callable[[], Connection]) -> Connection:
        self._start_reaper()
        connection = self._connections.get(key)
        if connection is not None and connection.alive:
            connection.last_used = time.monotonic()
            return connection
        async with self._locks.setdefault(key, asyncio.Lock()):
            connection = self._connections.get(key)
            if connection is None or not connection.alive:
                connection = make()
                self._connections[key] = connection
                try:
                    await connection.start()
                except BaseException:
                    self._connections.pop(key, None)
                    raise
            return connection

    def connections(self) -> list[Connection]:
        return list(self._connections.values())

    def _start_reaper(self) -> None:
        """The pool's background tasks on this loop, each started again only if it ended (the
        deletes' listener ends at once without Redis: the embedded mode deletes in-process)."""
        loop = asyncio.get_running_loop()
        jobs = {"reap": self._reap_forever, "limits": self._watch_limits_forever}
        if "deleted" not in self._background:
            jobs["deleted"] = lambda: routing.listen_deleted(self._on_deleted)
        for name, job in jobs.items():
            task = self._background.get(name)
            if task is None or (task.done() and name != "deleted"):
                # A fresh context each: no log ids of the turn that happened to start them.
                self._background[name] = loop.create_task(job(), context=contextvars.Context())

    def _on_deleted(self, session_id: str) -> None:
        asyncio.get_running_loop().create_task(self.drop_session(session_id), context=contextvars.Context())

    async def drop_session(self, session_id: str) -> None:
        """A deleted session's own servers are stopped at once."""
        for key, connection in list(self._connections.items()):
            if connection.ids.get("session") == session_id:
                self._connections.pop(key, None)
                with logs.log_context(**connection.ids):
                    await connection.close(kill=True)

    async def _watch_limits_forever(self) -> None:
        """Each stdio server's unit against its limits, as the ACP runtime watches its agents."""
        while True:
            await asyncio.sleep(settings.AAP_SANDBOX_MONITOR_SECONDS)
            watched = [c.process for c in self._connections.values() if c.alive and c.process is not None]
            if not watched:
                continue
            try:
                snap = await asyncio.to_thread(limits.snapshot)
                for process in watched:
                    with logs.log_context(**process.log_ids()):
                        await process.check_limits(snap)
            except Exception:  # the monitor task's boundary: the next round tries again
                logger.warning("checking MCP servers against their limits failed", exc_info=True)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_SECONDS)
            now = time.monotonic()
            for key, connection in list(self._connections.items()):
                idle = not connection.users and now - connection.last_used > connection.server.idle
                if connection.alive and not idle:
                    continue
                self._connections.pop(key, None)
                with logs.log_context(**connection.ids):
                    if connection.alive:
                        logger.info("stopping MCP server %s: idle for %gs", connection.label, connection.server.idle)
                    try:
                        await connection.close()
                    except Exception:  # the reaper task's boundary: the other servers still stop
                        logger.warning("stopping MCP server %s failed", connection.label, exc_info=True)

    def kill_all(self) -> None:
        """The process exits: kill every server process still running (bounded, synchronous)."""
        for connection in list(self._connections.values()):
            process = connection.process
            if process is not None and process.process is not None and process.process.returncode is None:
                process._signal(9)
