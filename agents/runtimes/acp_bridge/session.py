"""One AAP session's ACP session, its in-flight prompt and the permissions that prompt waits on.

What the agent sends for a session (updates, permission requests, the prompt's end) lands in
the prompt's queue in arrival order. The turn that runs the prompt drains the queue; when the
prompt waits on the application's permission the turn ends and the queue keeps filling until
the next turn picks the prompt up again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acp import schema

from .terminals import Terminals

logger = logging.getLogger("agents.runtimes.acp")

ALLOW_KINDS = ("allow_once", "allow_always")
REJECT_KINDS = ("reject_once", "reject_always")


class PermissionWaiter:
    """An agent's `session/request_permission`, answered once (by the service or the app)."""

    def __init__(self, tool_call: schema.ToolCallUpdate, options: list[schema.PermissionOption], timeout: float):
        self.tool_call = tool_call
        self.options = options
        self.future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.timed_out = False
        self.timeout = timeout
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    @property
    def call_id(self) -> str:
        return self.tool_call.tool_call_id

    @property
    def decided(self) -> bool:
        return self.future.done()

    def _pick(self, kinds: tuple[str, ...]) -> str | None:
        for kind in kinds:  # the first preference the agent offers
            for option in self.options:
                if option.kind == kind:
                    return option.option_id
        return None

    def _settle(self, option_id: str | None) -> None:
        self._timer.cancel()
        if not self.future.done():
            self.future.set_result(option_id)

    def allow(self) -> None:
        self._settle(self._pick(ALLOW_KINDS))

    def reject(self) -> None:
        self._settle(self._pick(REJECT_KINDS))

    def cancel(self) -> None:
        self._settle(None)

    def _expire(self) -> None:
        if not self.future.done():
            self.timed_out = True
            logger.info("permission for ACP tool call %s unanswered after %gs; rejected", self.call_id, self.timeout)
            self.reject()


@dataclass
class CallState:
    """A tool call already shown to the application as a `tool_call` event."""

    kind: str
    aap_id: str
    input: dict = field(default_factory=dict)
    content: Any = None
    raw_output: Any = None
    resolved: bool = False  # its tool_result is out


@dataclass
class Prompt:
    """A `session/prompt` in flight; it may outlive the AAP turn that started it."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    calls: dict[str, CallState] = field(default_factory=dict)
    waiting: dict[str, PermissionWaiter] = field(default_factory=dict)  # on the application
    requested: list[PermissionWaiter] = field(default_factory=list)  # every request, seen or not
    active: bool = False  # a turn is draining it right now
    parked_at: float | None = None  # when its turn ended with tool_use
    finished_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)
    ctx: Any = None  # the TurnContext of the turn draining it right now
    usage: list[tuple[int, int]] = field(default_factory=list)  # metered while no turn drained it
    metered: bool = False  # the model gateway counted its usage (the agent's own report is not used)

    def add_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Model usage of this prompt (from the model gateway): its turn's; while the prompt
        waits on the application, kept for the turn that drains it next."""
        self.metered = True
        if self.ctx is not None:
            self.ctx.add_usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        else:
            self.usage.append((prompt_tokens, completion_tokens))

    def attach(self, ctx) -> None:
        """`ctx`'s turn drains this prompt from now on (and gets the usage kept for it)."""
        self.ctx = ctx
        usage, self.usage = self.usage, []
        for prompt_tokens, completion_tokens in usage:
            ctx.add_usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    async def next(self, timeout: float):
        """The next item `(kind, payload)`, or None after `timeout` seconds of nothing."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None

    def pending_waiters(self) -> list[PermissionWaiter]:
        return [waiter for waiter in self.requested if not waiter.decided]


class AcpSession:
    """An AAP session's ACP session inside one agent process."""

    def __init__(
        self,
        *,
        aap_id: str,
        tenant: str,
        acp_id: str,
        workspace: Path,
        process,
        terminals: Terminals,
        permission_timeout: float,
    ):
        self.aap_id = aap_id
        self.tenant = tenant
        self.acp_id = acp_id
        self.workspace = workspace
        self.process = process
        self.terminals = terminals
        self.permission_timeout = permission_timeout
        self.config_values: dict[str, str] = {}  # configOption values already set on the agent
        self.config_ids: set[str] = set()  # configOptions the agent advertises
        self.prompt: Prompt | None = None
        self.last_activity = time.monotonic()
        self.outstanding = 0  # agent requests being served (a silent agent is then not hung)

    def touch(self) -> None:
        self.last_activity = time.monotonic()
        self.process.touch()

    def on_update(self, update) -> None:
        self.touch()
        if self.prompt is not None:  # replays of session/load and idle chatter are not a turn's
            self.prompt.queue.put_nowait(("update", update))

    async def on_permission(self, tool_call, options) -> str | None:
        self.touch()
        if self.prompt is None:
            return None
        waiter = PermissionWaiter(tool_call, options, self.permission_timeout)
        self.prompt.requested.append(waiter)
        self.prompt.queue.put_nowait(("permission", waiter))
        self.outstanding += 1
        try:
            return await asyncio.shield(waiter.future)
        finally:
            self.outstanding -= 1
            self.touch()

    def close(self) -> None:
        self.terminals.close()
        if self.prompt is not None:
            for waiter in self.prompt.pending_waiters():
                waiter.cancel()
