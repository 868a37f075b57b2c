"""One AAP session's ACP session, its in-flight prompt and the permissions that prompt waits on.

What the agent sends for a session (updates, permission requests, the prompt's end) lands in
the prompt's queue in arrival order. The turn that runs the prompt drains the queue; when the
prompt waits on the application's permission the turn ends and the queue keeps filling until
the next turn picks the prompt up again.

A tool call is known as the agent describes it so far: its `tool_call`, every
`tool_call_update` and the `toolCall` of a permission request for it, merged field by field as
they arrive (even while no turn drains the queue), so a permission is asked for, and bound to,
the input the agent last sent.
"""

from __future__ import annotations

import asyncio
import json
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
        self.asked: str | None = None  # the call's binding when the application was asked
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

    def ask_again(self) -> None:
        """The application is asked again: its time to answer starts over."""
        if not self.future.done():
            self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(self.timeout, self._expire)

    def _expire(self) -> None:
        if not self.future.done():
            self.timed_out = True
            logger.info("permission for ACP tool call %s unanswered after %gs; rejected", self.call_id, self.timeout)
            self.reject()


def tool_input(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    return {} if raw is None else {"value": raw}


@dataclass
class CallState:
    """An ACP tool call as the agent described it so far, and the AAP tool call showing it."""

    kind: str = "other"
    title: str | None = None
    input: dict = field(default_factory=dict)
    locations: list[dict] = field(default_factory=list)
    content: Any = None
    raw_output: Any = None
    aap_id: str | None = None  # the AAP tool call showing it; None until shown
    shown: str | None = None  # the binding that AAP tool call carries
    allowed: str | None = None  # the binding a permission was granted for
    resolved: bool = False  # that AAP tool call's tool_result is out

    def merge(self, update) -> None:
        """Take what a `tool_call`, `tool_call_update` or permission request sets: ACP
        replaces each field an update carries and keeps the others."""
        if update.kind is not None:
            self.kind = update.kind
        if update.title:
            self.title = update.title
        if update.raw_input is not None:
            self.input = tool_input(update.raw_input)
        if update.locations is not None:
            self.locations = [
                {"path": loc.path, **({"line": loc.line} if loc.line is not None else {})} for loc in update.locations
            ]
        if update.content is not None:
            self.content = update.content
        if update.raw_output is not None:
            self.raw_output = update.raw_output

    @property
    def binding(self) -> str:
        """What a permission is given for: the call's kind and input."""
        return json.dumps([self.kind, self.input], sort_keys=True, default=str)


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

    def track(self, tool_call) -> CallState:
        """The call's state with what `tool_call` (an update or a permission's) sets."""
        state = self.calls.get(tool_call.tool_call_id)
        if state is None:
            state = self.calls[tool_call.tool_call_id] = CallState()
        state.merge(tool_call)
        return state

    def call_state(self, tool_call) -> CallState:
        """The call's state (merged on arrival: taking `tool_call` again would undo later updates)."""
        return self.calls.get(tool_call.tool_call_id) or self.track(tool_call)


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
            if update.session_update in ("tool_call", "tool_call_update"):
                self.prompt.track(update)
            self.prompt.queue.put_nowait(("update", update))

    async def on_permission(self, tool_call, options) -> str | None:
        self.touch()
        if self.prompt is None:
            return None
        self.prompt.track(tool_call)
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
