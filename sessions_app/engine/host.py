"""The host side of a turn: what is the same for every runtime.

`execute(plan)` runs one turn on the process's runtime loop: publishes `turn_start`,
resolves the application's permission answers, runs the runtime, shapes its events for the
stream mode, runs server tools, answers unknown tools, keeps the lease alive, honours
cancel, and turns any exception into stop reason `error`. It returns a `TurnOutcome` that
services persist. It never touches the database. The turns a worker runs are its
`RunningTurns`: a cancel signal reaches them there, and its heartbeat reads their output.
What one turn may produce is bounded (`OutputBudget`), and its tiny deltas are joined
(`DeltaRuns`), so that no turn takes the shared runtime loop or Redis from the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from django.conf import settings

from agents import tools as host_tools
from agents.runtimes import runtime_for
from agents.runtimes.base import (
    STOP_REASONS,
    AgentError,
    Compaction,
    PermissionAnswer,
    ServerToolBinding,
    ToolCall,
    ToolOutcome,
)
from infra import metrics, tracing

from ..protocol import MessageShaper, denial_text, fold
from . import events

logger = logging.getLogger(__name__)


# --- the runtime loop: one asyncio loop per process, in a daemon thread ---------------------
# Process-wide, unlike the turns on it (`RunningTurns`, one per worker): what the runtimes
# keep across turns lives on it (ACP agent processes, MCP connections, model connection
# pools: agents.runtimes.runtime_for's instances), and the web process reaches the same
# instances (a deleted session's agent is stopped; in the embedded mode, the worker's).

_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None


def runtime_loop() -> asyncio.AbstractEventLoop:
    """The process-wide loop runtimes run on; it outlives turns (ACP agents wait across turns)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="aap-runtime-loop", daemon=True)
            thread.start()
            _loop = (os.getpid(), loop)
        return _loop[1]


def run_sync(coro, timeout: float | None = None):
    """Run a coroutine on the runtime loop from synchronous code and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coro, runtime_loop()).result(timeout)


class RunningTurns:
    """The turns one worker runs on the runtime loop now: their tasks, which its cancel
    listener reaches (`listen`, `close`), and their publishers, whose output so far its
    heartbeat stores (`output_so_far`). sessions_app.engine.worker.Worker owns one."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self._publishers: dict[str, _Publisher] = {}
        # Claimed turns not running yet (expect): whether a cancel came for each meanwhile.
        self._expected: dict[str, bool] = {}
        # Held here because the loop keeps tasks only weakly: a collected listener hears no cancel.
        self._listener: asyncio.Task | None = None
        self._closed = False

    def listen(self) -> None:
        """Start hearing cancel signals (from any thread but the loop's; returns at once)."""
        asyncio.run_coroutine_threadsafe(self._listen(), runtime_loop())

    async def _listen(self) -> None:
        if self._listener is None and not self._closed:
            self._listener = asyncio.get_running_loop().create_task(events.backend().listen_cancels(self.cancel))

    def close(self) -> None:
        """Stop hearing cancel signals (its turns have ended)."""
        self._closed = True
        listener = self._listener
        if listener is not None:
            listener.get_loop().call_soon_threadsafe(listener.cancel)

    def expect(self, turn_id: str) -> None:
        """A turn this worker claimed and will run: a cancel heard before it runs (`cancel`)
        is kept for it."""
        self._expected.setdefault(turn_id, False)  # never unsets a cancel heard meanwhile

    def add(self, turn_id: str, task: asyncio.Task | None, publisher: _Publisher) -> bool:
        """The turn runs now (on the runtime loop); whether it was cancelled before it ran."""
        if task is not None:
            self._tasks[turn_id] = task
        self._publishers[turn_id] = publisher
        return self._expected.pop(turn_id, False)

    def remove(self, turn_id: str) -> None:
        self._tasks.pop(turn_id, None)
        self._publishers.pop(turn_id, None)
        self._expected.pop(turn_id, None)

    def __contains__(self, turn_id: object) -> bool:
        return turn_id in self._tasks

    def cancel(self, turn_id: str) -> None:
        """A cancel signal: the turn stops where its agent is, if it runs here (any thread)."""
        task = self._tasks.get(turn_id)
        if task is not None:
            if not task.done():
                task.get_loop().call_soon_threadsafe(task.cancel)
        elif turn_id in self._expected:
            self._expected[turn_id] = True  # it stops before it starts

    def output_so_far(self, turn_id: str) -> list[dict] | None:
        """What the running turn's agent produced so far, as `message`-mode events (whole
        blocks; the last one as far as it got). None: not running here. Called from the
        heartbeat thread: it shapes a snapshot of the list the loop appends to."""
        publisher = self._publishers.get(turn_id)
        if publisher is None:
            return None
        shaper = MessageShaper("message")
        shaped = [out for event in publisher.produced.events() for out in shaper.feed(event)]
        return shaped + shaper.flush()


# --- what services hand the host, and what they get back ------------------------------------


@dataclass
class TurnPlan:
    turn_id: str
    session_id: str
    tenant: str
    agent_name: str
    runtime_kind: str
    config: dict
    options: dict[str, str]
    server_tools: dict[str, ServerToolBinding]
    client_tools: dict[str, dict]
    history: list[dict]
    incoming: list[dict]
    permissions: list[PermissionAnswer]
    stream: str
    capabilities: dict
    options_set: frozenset[str] = frozenset()


@dataclass
class TurnOutcome:
    stop_reason: str
    messages: list[dict]
    pending_calls: list[dict]
    last_seq: int
    compaction: Compaction | None = None
    cancelled: bool = False
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0
    usage_estimated: bool = False
    stop_meta: dict = field(default_factory=dict)


# A runtime emitting without awaiting anything gives the loop back at least this often.
YIELD_SECONDS = 0.002
# How often a running turn's writes set its stream's expiry again (see RedisEvents.publish_many).
EXPIRE_EVERY_SECONDS = 10.0
# How long a batch of events Redis refuses (full, read-only) is tried again before it is given up.
PUBLISH_RETRY_SECONDS = 3.0


class _Publisher:
    """Numbers events, shapes them for the stream mode and publishes them in order.

    `turn_start` (event 1) was published by the web process when it created the turn.
    Events are written by one background flusher in pipelined batches, so a runtime never
    waits for Redis between deltas and order is kept.

    Backpressure: once the entries waiting behind a write of this turn still in flight have
    waited `AAP_TURN_COALESCE_SECONDS`, a new delta joins the delta waiting last
    (DeltaRuns; the fold is the same). A turn whose writes keep up sends every
    delta as its own entry; when the process falls behind (a burst of turns, a slow Redis),
    a write round carries one entry per run of deltas however many tokens the model sent
    meanwhile, so Redis, the web process and the client do less exactly when they are behind.
    """

    def __init__(self, turn_id: str, mode: str):
        self.turn_id = turn_id
        self.shaper = MessageShaper("message" if mode == "none" else mode)
        self.seq = 1
        self.produced = DeltaRuns()  # the runtime's events, before shaping (for fold)
        self.budget = OutputBudget()
        self.backend = events.backend()
        self._queue = DeltaRuns()
        self._flusher: asyncio.Task | None = None
        self._writing = False  # a batch of this turn is on its way to Redis
        self._waiting_since = 0.0  # when the oldest entry not yet taken by a write was queued
        self._expired_at: float | None = None
        self._failing_since: float | None = None  # Redis has failed this turn's writes since
        self._yielded: float | None = None
        self.ended = False  # the stream ended without this worker: it writes nothing more
        self.task: asyncio.Task | None = None  # the turn's, set as it starts (a fence stops it)

    def _behind(self) -> bool:
        return (
            self._writing
            and bool(self._queue)
            and time.monotonic() - self._waiting_since >= settings.AAP_TURN_COALESCE_SECONDS
        )

    def _send(self, event: dict, *, last: bool = False) -> None:
        # A long turn's waiting deltas, and those of a turn whose writes fall behind, join
        # into one entry (DeltaRuns).
        if self.ended:
            return
        if (self.seq > JOIN_AFTER_ENTRIES or self._behind()) and self._queue.join(event, JOINED_CHARS):
            return
        if not last:
            self.budget.add_entry()
        self.seq += 1
        if not self._queue:
            self._waiting_since = time.monotonic()
        self._queue.append(self.seq, event)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._queue:
            batch = self._queue.take()
            self._writing = True
            try:
                await self._write(batch)
            finally:
                self._writing = False
            if self._queue and self.seq > JOIN_AFTER_ENTRIES:
                # The turn streams faster than Redis writes: let its tiny deltas join a while.
                await asyncio.sleep(settings.AAP_TURN_COALESCE_SECONDS)

    async def _write(self, batch: list[tuple[int, dict]]) -> None:
        """Write one batch, again and again while Redis fails (a restart, a failover), for up
        to AAP_STREAM_RETRY_SECONDS (PUBLISH_RETRY_SECONDS when Redis answers but refuses, e.g.
        full): a batch dropped while later ones get through would be a hole in every live
        view. The events behind it wait (their order is kept). Past that the batch is given
        up: the stream then shows a hole, and `none` answers come from the stored turn. The
        bound is per outage, not per batch: while Redis still fails, each later batch is tried
        once, so a turn's end waits for Redis at most that long."""
        pause = 0.1
        while True:
            now = time.monotonic()
            expire = self._expired_at is None or now - self._expired_at >= EXPIRE_EVERY_SECONDS
            try:
                await self.backend.publish_many(self.turn_id, batch, expire=expire)
            except events.StreamEnded:
                self._fenced()
                return
            except Exception as exc:
                if self._failing_since is None:
                    self._failing_since = now
                    logger.warning("publishing events of %s failed; retrying", self.turn_id, exc_info=True)
                bound = settings.AAP_STREAM_RETRY_SECONDS if events.unreachable(exc) else PUBLISH_RETRY_SECONDS
                if now - self._failing_since >= bound:
                    logger.warning(
                        "events %d-%d of %s were not published",
                        batch[0][0],
                        batch[-1][0],
                        self.turn_id,
                        exc_info=exc,
                    )
                    return
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            self._failing_since = None
            if expire:
                self._expired_at = now
            return

    def _fenced(self) -> None:
        """The turn's stream has ended without this worker: its claim was declared lost (it
        was frozen, or cut off from Redis and PostgreSQL, past its lease) and its clients were
        told so. Nothing more is written, and the agent is stopped: its answer cannot be kept."""
        if self.ended:
            return
        self.ended = True
        self._queue = DeltaRuns()
        logger.warning("turn %s was declared lost while it ran here; its agent is stopped", self.turn_id)
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    async def emit(self, event: dict) -> None:
        self.budget.add_output(event)
        for shaped in self.shaper.feed(event):
            self._send(shaped)
        if not self.produced.join(event):
            self.produced.append(0, event)
        # Yield to the loop every few milliseconds of emitting: no turn holds the loop other
        # turns, leases and cancels share, and the events of a quick burst (a short answer)
        # still go to Redis in one pipeline, not one round trip for the first and one for the rest.
        now = time.monotonic()
        if self._yielded is None:
            self._yielded = now  # counted from the first event
        elif now - self._yielded >= YIELD_SECONDS:
            self._yielded = now
            await asyncio.sleep(0)

    async def close(self) -> None:
        """Flush the last part and wait until every event is written."""
        for shaped in self.shaper.flush():
            self._send(shaped, last=True)
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)


class HostContext:
    """The TurnContext a runtime gets (see agents.runtimes.base.TurnContext)."""

    def __init__(self, plan: TurnPlan, publisher: _Publisher):
        self.session_id = plan.session_id
        self.turn_id = plan.turn_id
        self.tenant = plan.tenant
        self.agent_name = plan.agent_name
        self.config = plan.config
        self.options = plan.options
        self.options_set = plan.options_set
        self.server_tools = plan.server_tools
        self.client_tools = plan.client_tools
        self.history = plan.history
        self.incoming = plan.incoming
        self.permissions = plan.permissions
        self.capabilities = plan.capabilities
        self._publisher = publisher
        self.pending: list[dict] = []
        self.compaction: Compaction | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.model_calls = 0
        self.usage_estimated = False  # some of the usage was counted by the runtime, not reported
        self.stop_meta: dict = {}

    async def emit(self, event: dict) -> None:
        if event.get("event") not in ("text_delta", "thinking_delta", "tool_call", "tool_result"):
            raise ValueError(f"a runtime cannot emit {event.get('event')!r}")
        await self._publisher.emit(event)

    async def call_tools(self, calls: list[ToolCall]) -> list[ToolOutcome]:
        for call in calls:
            await self.emit(call.as_event())
        outcomes = []
        for call in calls:
            binding = self.server_tools.get(call.name)
            if binding is not None and binding.trust:
                outcome = ToolOutcome(call, content=await run_server_tool(binding, call))
                await self.emit({"event": "tool_result", "toolCallId": call.toolCallId, "content": outcome.content})
            elif binding is not None:
                outcome = ToolOutcome(call, pending="permission")
            elif call.name in self.client_tools:
                outcome = ToolOutcome(call, pending="client")
            else:
                outcome = ToolOutcome(call, content=f"Unknown tool: {call.name}")
                await self.emit({"event": "tool_result", "toolCallId": call.toolCallId, "content": outcome.content})
            if outcome.pending:
                self.pending.append(
                    {"toolCallId": call.toolCallId, "name": call.name, "input": call.input, "kind": outcome.pending}
                )
            outcomes.append(outcome)
        return outcomes

    def request_permission(self, call: ToolCall) -> None:
        self.pending.append(
            {"toolCallId": call.toolCallId, "name": call.name, "input": call.input, "kind": "permission"}
        )

    def set_compacted(self, compaction: Compaction) -> None:
        self.compaction = compaction

    def add_usage(self, *, prompt_tokens: int = 0, completion_tokens: int = 0, estimated: bool = False) -> None:
        self.prompt_tokens += int(prompt_tokens or 0)
        self.completion_tokens += int(completion_tokens or 0)
        self.model_calls += 1
        self.usage_estimated = self.usage_estimated or estimated

    def set_stop_meta(self, **meta: Any) -> None:
        self.stop_meta.update(meta)


async def run_server_tool(binding: ServerToolBinding, call: ToolCall):
    """Run a server tool's host implementation; failures become the tool's result text."""
    try:
        jsonschema.validate(call.input, binding.spec.get("parameters") or {})
    except jsonschema.ValidationError as exc:
        return f"Invalid input for {call.name}: {exc.message}"
    try:
        return await host_tools.run_tool(binding.implementation, call.input, binding.settings)
    except host_tools.ToolInputError as exc:
        return f"Error: {exc}"
    except Exception as exc:  # the tool call's boundary: the agent reads the failure
        logger.warning("server tool %s failed", call.name, exc_info=True)
        return f"Tool {call.name} failed ({type(exc).__name__})."


async def _resolve_permissions(ctx: HostContext, plan: TurnPlan) -> None:
    """Answer last turn's untrusted calls: run the granted ones, store denials."""
    for answer in plan.permissions:
        call = answer.call
        if answer.granted:
            binding = plan.server_tools.get(call.name)
            content = await run_server_tool(binding, call) if binding else f"Unknown tool: {call.name}"
        else:
            content = denial_text(answer.reason)
        await ctx.emit({"event": "tool_result", "toolCallId": call.toolCallId, "content": content})
        # The runtime sees the answered call like any other result in its history.
        ctx.history.append({"role": "tool", "toolCallId": call.toolCallId, "content": content})


def _log_failure(plan: TurnPlan, exc: BaseException) -> None:
    logger.error("turn %s (agent %s) failed", plan.turn_id, plan.agent_name, exc_info=exc)


async def execute(plan: TurnPlan, running: RunningTurns | None = None) -> TurnOutcome:
    """Run one turn (on the runtime loop) and return what services must persist. `running`:
    the worker's turns, among which a cancel finds it (none: a turn no cancel reaches)."""
    running = RunningTurns() if running is None else running
    publisher = _Publisher(plan.turn_id, plan.stream)
    ctx = HostContext(plan, publisher)
    host_tools.CURRENT_TURN.set(ctx)  # server tools that act per tenant or session read it (MCP)
    runtime = runtime_for(plan.runtime_kind)
    task = asyncio.current_task()
    if task is None:  # a coroutine run by an event loop runs in a task
        raise RuntimeError("execute() runs in an asyncio task")
    publisher.task = task
    cancelled_before = running.add(plan.turn_id, task, publisher)
    cancelled, error = False, ""
    stop_reason = "error"
    try:
        if cancelled_before:
            # Cancelled while queued: a CancelledError raised here would not count as a cancel.
            cancelled, stop_reason = True, "end_turn"
        else:
            if runtime.host_executes_server_tools:
                await _resolve_permissions(ctx, plan)
            stop_reason = await runtime.run(ctx)
            if stop_reason not in STOP_REASONS:
                raise AgentError(f"The agent returned an unknown stop reason {stop_reason!r}.")
    except TurnOutputExceeded:
        stop_reason = "max_tokens"  # the sentence goes in turn_stop's _meta.outputLimit (below)
    except asyncio.CancelledError:
        if not task.cancelling():
            raise
        # A cancel: stop where the agent is; what it produced stays.
        task.uncancel()
        cancelled, stop_reason = True, "end_turn"
    except AgentError as exc:
        stop_reason, error = "error", exc.safe_message
    except Exception as exc:
        _log_failure(plan, exc)
        stop_reason, error = "error", f"The agent failed ({type(exc).__name__})."
    finally:
        running.remove(plan.turn_id)
    try:
        await publisher.close()
    except Exception:  # the turn's boundary: its ending is stored in PostgreSQL next
        logger.warning("publishing the end of turn %s failed", plan.turn_id, exc_info=True)

    if publisher.budget.exceeded and not cancelled:
        stop_reason, error = "max_tokens", ""  # even if the runtime caught TurnOutputExceeded
    pending = ctx.pending if stop_reason == "tool_use" else []
    meta = dict(ctx.stop_meta)
    if publisher.budget.exceeded:
        meta["outputLimit"] = publisher.budget.exceeded
    if cancelled:
        meta["cancelled"] = True
    if error:
        meta["error"] = error
    return TurnOutcome(
        stop_reason=stop_reason,
        messages=fold(publisher.produced.events()),
        pending_calls=pending,
        last_seq=publisher.seq,
        compaction=ctx.compaction,
        cancelled=cancelled,
        error=error,
        prompt_tokens=ctx.prompt_tokens,
        completion_tokens=ctx.completion_tokens,
        model_calls=ctx.model_calls,
        usage_estimated=ctx.usage_estimated,
        stop_meta=meta,
    )


def execute_sync(plan: TurnPlan, running: RunningTurns) -> TurnOutcome:
    return run_sync(tracing.carry(plan, metrics.timed_turn(plan, execute(plan, running))))


# --- a turn's output bounds, and the joining of tiny deltas -----------------------------------
# Bounds on what one turn may produce, and the joining of tiny deltas, so that no turn can
# take a worker's shared runtime loop or Redis from the turns beside it.
#
# - `OutputBudget` counts a turn's output bytes and stream entries; past either bound the
#   turn ends `max_tokens` with a sentence (`TurnOutputExceeded`), alone.
# - `DeltaRuns` keeps a run of same-kind deltas as one event whose text is joined when read:
#   the fold of the joined events equals the fold of the originals, and a million one-word
#   deltas become a few hundred stream entries once a turn streams faster than Redis writes.


_JOINABLE = ("text_delta", "thinking_delta")
# A turn's first entries go out one delta each (what a reader expects of a short answer);
# past this many, deltas that are still waiting for Redis join the one before them.
JOIN_AFTER_ENTRIES = 256
# Largest joined delta (characters) in one stream entry.
JOINED_CHARS = 64 * 1024


class TurnOutputExceeded(Exception):
    """A turn went past one of its output bounds; the message is safe to show."""


def _output_size(event: dict) -> int:
    name = event.get("event")
    if name in _JOINABLE:
        return len(event.get("delta", "").encode())
    if name == "tool_result" and isinstance(event.get("content"), str):
        return len(event["content"].encode())
    from ..protocol import dumps

    return len(dumps(event))


class OutputBudget:
    """Output bytes (the runtime's events) and stream entries (what Redis keeps) of one turn."""

    def __init__(self):
        self.max_bytes = settings.AAP_TURN_MAX_OUTPUT_BYTES
        self.max_entries = settings.AAP_TURN_MAX_EVENTS
        self.bytes = 0
        self.entries = 0
        self.exceeded: str = ""

    def _over(self, message: str) -> TurnOutputExceeded:
        self.exceeded = self.exceeded or message
        return TurnOutputExceeded(self.exceeded)

    def add_output(self, event: dict) -> None:
        if self.exceeded:
            raise TurnOutputExceeded(self.exceeded)
        self.bytes += _output_size(event)
        if self.max_bytes and self.bytes > self.max_bytes:
            raise self._over(
                f"The agent's answer passed this service's limit of {self.max_bytes} bytes per turn; it was cut there."
            )

    def add_entry(self) -> None:
        self.entries += 1
        if self.max_entries and self.entries > self.max_entries:
            raise self._over(
                f"The agent's answer passed this service's limit of {self.max_entries} events per turn; "
                "it was cut there."
            )


def joinable(event: dict) -> bool:
    return event.get("event") in _JOINABLE and len(event) == 2 and isinstance(event.get("delta"), str)


class DeltaRuns:
    """A list of events in which a joinable delta may join the run before it.

    Items are [seq, event, parts, chars]; `parts` (the run's texts) is None for an event that
    cannot be joined. Texts are joined only when read, so building a run costs O(n)."""

    __slots__ = ("items",)

    def __init__(self):
        self.items: list[list] = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def join(self, event: dict, limit: int | None = None) -> bool:
        """Join `event` to the last run if it can; True if it did."""
        if not self.items or not joinable(event):
            return False
        tail = self.items[-1]
        parts = tail[2]
        if parts is None or tail[1]["event"] != event["event"] or (limit is not None and tail[3] >= limit):
            return False
        parts.append(event["delta"])
        tail[3] += len(event["delta"])
        if len(parts) >= 1024:  # keep the number of small strings held bounded
            parts[:] = ["".join(parts)]
        return True

    def append(self, seq: int, event: dict) -> None:
        if joinable(event):
            self.items.append([seq, event, [event["delta"]], len(event["delta"])])
        else:
            self.items.append([seq, event, None, 0])

    def take(self) -> list[tuple[int, dict]]:
        """Every item as (seq, event), joined texts in place; the list is emptied."""
        items, self.items = self.items, []
        return [(seq, _joined(event, parts)) for seq, event, parts, _ in items]

    def events(self) -> list[dict]:
        return [_joined(event, parts) for _, event, parts, _ in self.items]


def _joined(event: dict, parts: list[str] | None) -> dict:
    if parts is None or (len(parts) == 1 and parts[0] is event["delta"]):
        return event
    return {"event": event["event"], "delta": "".join(parts)}
