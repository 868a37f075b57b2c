"""Runtime kind `acp`: any ACP agent (Agent Client Protocol over stdio) as an AAP agent.

The service is the ACP client; the agent is a child process of the worker. Each AAP session
gets its own workspace and its own ACP session (`session/new` with the workspace as cwd, or
`session/load` after a restart when the agent supports it). Agent processes are shared by
the sessions of one tenant with the same agent and option values, reaped when idle and
started again on demand. A user turn is one `session/prompt`; its `session/update`s become
AAP events. The ACP tool kinds are the agent's server tools: a permission request for an
enabled, trusted kind is allowed by the service, for a kind the session did not enable it is
rejected, and for an enabled untrusted kind the AAP turn ends with `tool_use` while the
prompt waits; the next turn's `tool_permission` answers it and the prompt streams on there.
See docs/acp-agents.md and the bridge contract.

Longer than ~400 lines on purpose: one class holds the ACP bridge's shared state (agent
processes by spec, ACP sessions by AAP session, holds) and every step of a turn reads it;
the configuration, the ACP-to-AAP conversion, processes, sessions, terminals, routing and
the sandbox are modules of their own beside it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import hashlib
import json
import logging
import os
import secrets
import signal
import time
import uuid
from pathlib import Path

import acp
from acp import schema
from django.conf import settings

from aap.messages import denial_text
from infra.logs import log_context

from ..base import AgentError, PermissionAnswer, Runtime, StopReason, ToolCall, TurnContext
from . import limits, routing, sandbox, workspace
from .config import CONFIG_SCHEMA, Config, check
from .conversion import STOP_REASONS, TOOL_KINDS, data_uri, tool_text
from .gateway import GatewaySpec
from .process import AgentProcess, ProcessSpec
from .session import AcpSession, CallState, PermissionWaiter, Prompt
from .terminals import Terminals

logger = logging.getLogger("agents.runtimes.acp")

CANCEL_GRACE_SECONDS = 10.0
REAP_INTERVAL_SECONDS = 2.0
# A shutdown waits for the graceful stops (AAP_ACP_STOP_GRACE_SECONDS each, all at once) and
# this much more for what follows an agent's exit (SIGTERM's wait, closing the connection).
SHUTDOWN_SLACK_SECONDS = 15.0

# What `session/prompt` takes (this bridge sends text and image blocks).
PromptBlock = (
    schema.TextContentBlock
    | schema.ImageContentBlock
    | schema.AudioContentBlock
    | schema.ResourceContentBlock
    | schema.EmbeddedResourceContentBlock
)


class AcpRuntime(Runtime):
    kind = "acp"
    title = "ACP agent (Agent Client Protocol over stdio)"
    supports = {
        "history": ("compacted", "full"),
        "stream": ("delta", "message", "none"),
        "application_tools": False,
        "image": ("data",),
    }
    host_executes_server_tools = False
    config_schema = CONFIG_SCHEMA

    def __init__(self):
        self._processes: dict[str, AgentProcess] = {}  # by ProcessSpec.key
        self._starting: dict[str, asyncio.Lock] = {}
        self._sessions: dict[str, AcpSession] = {}  # by AAP session id
        self._acp_ids: dict[str, str] = {}  # AAP session id -> last ACP session id
        self._holds = routing.Holds()
        self._background: list[asyncio.Task] = []
        self._stopping: dict[str, tuple[AgentProcess, asyncio.Future]] = {}  # graceful stops by key
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop its processes live on
        atexit.register(self.shutdown)  # a worker's shutdown calls it first; then a no-op
        sandbox.harden_host()  # before any agent runs: nothing may read this process's memory

    # --- the registry's view ------------------------------------------------------------

    @classmethod
    def builtin_server_tools(cls, config: dict) -> list[dict]:
        return [
            {
                "name": name,
                "title": title,
                "description": f"{text} (ACP tool kind '{name}'.)",
                "parameters": {"type": "object"},
            }
            for name, (title, text) in TOOL_KINDS.items()
        ]

    def pinned_worker(self, *, session_id: str) -> str | None:
        return routing.holder_sync(session_id)

    @classmethod
    def validate_config(cls, config) -> dict:
        config = super().validate_config(config)
        problem = check(config)
        if problem is not None:
            where, sentence = problem
            raise ValueError(f"Runtime configuration for '{cls.kind}' is invalid at '{where}': {sentence}.")
        return config

    # --- a turn -------------------------------------------------------------------------

    async def run(self, ctx: TurnContext) -> StopReason:
        self._start_background()
        cfg = Config.parse(ctx.config)
        session = self._sessions.get(ctx.session_id)
        prompt = session.prompt if session is not None else None
        claimed: list[AgentProcess] = []  # in use by this turn: never reaped meanwhile
        try:
            if ctx.permissions:
                if session is None or prompt is None:  # a prompt is always a session's
                    return await self._answer_lost(ctx)
                claimed.append(self._claim(session.process))
                await self._holds.release(ctx.session_id)
                session.permission_timeout = cfg.permission_timeout
                await self._answer(ctx, prompt, ctx.permissions)
            else:
                if prompt is not None:  # its answers will never come (the pending calls were dropped)
                    await self._drop(ctx.session_id)
                session = await self._ready_session(ctx, cfg, claimed)
                prompt = self._start_prompt(ctx, session)
            session.touch()
            try:
                return await self._pump(ctx, session, prompt, cfg)
            except asyncio.CancelledError:
                await self._cancel(ctx, session, prompt)
                raise
        finally:
            for process in claimed:
                process.users -= 1
                process.touch()

    async def _pump(self, ctx: TurnContext, session: AcpSession, prompt: Prompt, cfg: Config) -> StopReason:
        prompt.active = True
        prompt.attach(ctx)  # the model gateway's usage of this prompt counts for this turn
        try:
            while True:
                quiet = time.monotonic() - session.last_activity
                item = await prompt.next(cfg.hang if session.outstanding else max(0.05, cfg.hang - quiet))
                if item is None:
                    if session.outstanding == 0 and time.monotonic() - session.last_activity >= cfg.hang:
                        raise AgentError(await self._hung(session, cfg))
                    continue
                kind, payload = item
                if kind == "update":
                    await self._update(ctx, prompt, payload)
                elif kind == "permission":
                    if await self._permission(ctx, session, prompt, payload):
                        return "tool_use"
                else:
                    return await self._finish(ctx, session, prompt, payload)
        finally:
            prompt.active = False
            prompt.ctx = None

    async def _update(self, ctx: TurnContext, prompt: Prompt, update) -> None:
        kind = update.session_update
        if kind in ("agent_message_chunk", "agent_thought_chunk"):
            content = update.content
            if getattr(content, "type", None) == "text" and content.text:
                name = "text_delta" if kind == "agent_message_chunk" else "thinking_delta"
                await ctx.emit({"event": name, "delta": content.text})
        elif kind in ("tool_call", "tool_call_update"):
            # Merged into the call's state on arrival (AcpSession.on_update). A call is shown when
            # it runs, ends, or asks permission: agents may fill its input in later updates.
            state = prompt.call_state(update)
            if update.status in ("in_progress", "completed", "failed"):
                await self._show_call(ctx, state, update.tool_call_id)
            if update.status in ("completed", "failed") and not state.resolved:
                await self._result(ctx, state, self._changed_after_allowed(state) + tool_text(state, update.status))
        # plan, available_commands_update, current_mode_update, user_message_chunk and the
        # other session updates have no AAP event: they are skipped, never an error.

    async def _show_call(self, ctx: TurnContext, state: CallState, acp_id: str, *, asking: bool = False) -> str:
        """Emit the call's `tool_call` event with what the agent sent for it so far, once; when
        asking permission for an input other than the one shown, as a new AAP tool call. The
        AAP tool call's id."""
        if state.aap_id is not None and not (asking and state.shown != state.binding):
            return state.aap_id
        if state.aap_id is not None and not state.resolved:
            await self._result(ctx, state, "The agent changed this tool call's input; the next tool call shows it.")
        # AAP ids are the service's own: ACP ids are only unique within one ACP session.
        aap_id = state.aap_id = "call_" + uuid.uuid4().hex
        state.shown, state.resolved = state.binding, False
        meta: dict = {"acpToolCallId": acp_id}
        if state.title:
            meta["title"] = state.title
        if state.locations:
            meta["locations"] = state.locations
        await ctx.emit(
            {"event": "tool_call", "toolCallId": aap_id, "name": state.kind, "input": state.input, "_meta": meta}
        )
        return aap_id

    @staticmethod
    def _changed_after_allowed(state: CallState) -> str:
        """A note when the agent changed a call after the application allowed it (the agent
        holds the permission then: the application's record says what ran)."""
        if state.allowed is None or state.allowed == state.binding:
            return ""
        logger.warning("an ACP agent changed a tool call's input after it was allowed")
        return f"The agent changed this call after it was allowed, to: {json.dumps(state.input, default=str)}\n"

    async def _result(self, ctx: TurnContext, state: CallState, content: str) -> None:
        state.resolved = True
        await ctx.emit({"event": "tool_result", "toolCallId": state.aap_id, "content": content})

    async def _permission(
        self, ctx: TurnContext, session: AcpSession, prompt: Prompt, waiter: PermissionWaiter
    ) -> bool:
        """Answer a permission request, or hand it to the application (returns True: park).
        It is asked for the call as the agent last described it (its updates and the request's
        own toolCall merged), and a grant holds for that kind and input only."""
        state = prompt.call_state(waiter.tool_call)
        aap_id = await self._show_call(ctx, state, waiter.call_id, asking=True)
        kind = state.kind
        if waiter.decided:  # timed out (or cancelled) before a turn saw it
            if not state.resolved:
                await self._result(ctx, state, denial_text(self._expiry(waiter)))
            return False
        binding = ctx.server_tools.get(kind)
        if binding is None:
            waiter.reject()
            await self._result(ctx, state, denial_text(f"tool kind '{kind}' is not enabled for this session"))
            return False
        if binding.trust:
            waiter.allow()
            return False
        waiter.asked = state.binding
        ctx.request_permission(ToolCall(aap_id, kind, state.input))
        prompt.waiting[aap_id] = waiter
        prompt.parked_at = time.monotonic()
        await self._holds.hold(session.aap_id)
        return True

    @staticmethod
    def _expiry(waiter: PermissionWaiter) -> str:
        if waiter.timed_out:
            return f"no answer within {waiter.timeout:g} seconds"
        return "the agent no longer waits for this answer"

    async def _answer(self, ctx: TurnContext, prompt: Prompt, answers: list[PermissionAnswer]) -> None:
        for answer in answers:
            call_id = answer.call.toolCallId
            waiter = prompt.waiting.pop(call_id, None)
            state = prompt.calls.get(waiter.call_id) if waiter is not None else None
            if state is None or state.aap_id != call_id:
                state = CallState(kind=answer.call.name, aap_id=call_id)
            if waiter is None or waiter.decided:
                reason = self._expiry(waiter) if waiter else "the agent no longer waits for this answer"
                await self._result(ctx, state, denial_text(reason))
            elif not answer.granted:
                waiter.reject()
                await self._result(ctx, state, denial_text(answer.reason))
            elif state.binding != waiter.asked:
                # The agent changed the call after the application was asked: the grant is not
                # for what would run. The same request is asked again, with the new input.
                await self._result(
                    ctx,
                    state,
                    denial_text("the agent changed the call's input after permission was asked; asked again"),
                )
                waiter.ask_again()
                prompt.queue.put_nowait(("permission", waiter))
            else:
                state.allowed = state.binding
                waiter.allow()  # the agent runs it; its tool_result comes with the agent's update

    async def _answer_lost(self, ctx: TurnContext) -> StopReason:
        for answer in ctx.permissions:
            await ctx.emit(
                {
                    "event": "tool_result",
                    "toolCallId": answer.call.toolCallId,
                    "content": denial_text("the agent is no longer waiting for this answer"),
                }
            )
        raise AgentError(
            "The agent prompt that asked for this permission is gone (its process stopped or restarted); "
            "send a new message."
        )

    async def _finish(self, ctx: TurnContext, session: AcpSession, prompt: Prompt, result) -> StopReason:
        if session.prompt is prompt:
            session.prompt = None
        await self._holds.release(session.aap_id)
        await self._close_calls(ctx, prompt)
        if isinstance(result, acp.RequestError):
            logger.warning(
                "ACP agent %s failed a prompt: %s %s",
                session.process.spec.label,
                result.code,
                session.process.spec.redact(str(result))[:300],
            )
            raise AgentError(f"The agent failed the prompt (JSON-RPC error {result.code}).")
        if isinstance(result, BaseException):
            # The prompt's boundary: the client reads the process's explanation, the log the frames.
            logger.warning("ACP agent %s: its prompt failed", session.process.spec.label, exc_info=result)
            raise AgentError(await session.process.explain())
        breach = await session.process.check_limits()
        if breach:
            raise AgentError(breach)
        reason = result.stop_reason
        if reason == "cancelled":
            ctx.set_stop_meta(cancelled=True)
        if result.usage is not None and not prompt.metered:  # the gateway's count, when it has one
            ctx.add_usage(prompt_tokens=result.usage.input_tokens, completion_tokens=result.usage.output_tokens)
        return STOP_REASONS.get(reason, "end_turn")

    async def _close_calls(self, ctx: TurnContext, prompt: Prompt) -> None:
        """Give every shown tool call a result, so no tool_use is left dangling in history."""
        for acp_id, state in list(prompt.calls.items()):  # the agent may add calls meanwhile
            if not state.resolved:
                await self._show_call(ctx, state, acp_id)
                await self._result(ctx, state, tool_text(state, None))

    async def _hung(self, session: AcpSession, cfg: Config) -> str:
        reason = f"The agent sent nothing for {cfg.hang:g} seconds while working; its process was stopped."
        session.prompt = None
        await session.process.stop(reason, kill=True)
        return session.process.failure or reason

    async def _cancel(self, ctx: TurnContext, session: AcpSession, prompt: Prompt) -> None:
        """The turn was cancelled: `session/cancel`, then let the prompt end as cancelled."""
        if session.prompt is not prompt:
            return
        try:
            with contextlib.suppress(Exception):
                await session.process.connection.cancel(session_id=session.acp_id)
            for waiter in prompt.pending_waiters():
                waiter.cancel()
            deadline = time.monotonic() + CANCEL_GRACE_SECONDS
            while session.prompt is prompt:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    session.prompt = None
                    await session.process.stop(
                        "The agent did not stop after session/cancel; its process was stopped.", kill=True
                    )
                    break
                item = await prompt.next(remaining)
                if item is None:
                    continue
                kind, payload = item
                if kind == "update":
                    await self._update(ctx, prompt, payload)
                elif kind == "permission":
                    payload.cancel()
                else:
                    session.prompt = None
            await self._holds.release(session.aap_id)
            await self._close_calls(ctx, prompt)
        except Exception:  # a cancel is best effort: the prompt ends either way
            logger.warning("cancelling an ACP prompt failed", exc_info=True)

    # --- sessions and processes -----------------------------------------------------------

    def _spec(self, ctx: TurnContext, cfg: Config) -> ProcessSpec:
        try:
            return self._build_spec(ctx, cfg)
        except ValueError as exc:  # a tenant or session id that cannot name a directory
            raise AgentError(f"The session's workspace cannot be created ({type(exc).__name__}).") from None

    def _build_spec(self, ctx: TurnContext, cfg: Config) -> ProcessSpec:
        gateway = self._gateway(ctx, cfg)
        option_env = {
            route["env"]: ctx.options[name]
            for name, route in cfg.options.items()
            if "env" in route and ctx.options.get(name) and not (cfg.gateway and name == cfg.gateway.key_option)
        }
        per_session = cfg.isolation == "session"
        # The isolation unit is a process: a session's own, or one a tenant's sessions share.
        parts = [ctx.tenant, ctx.agent_name, ctx.config, option_env, ctx.session_id if per_session else None]
        if gateway is not None:  # the key it holds: sessions with different keys never share a unit
            parts.append(gateway.key)
        identity = json.dumps(parts, sort_keys=True)
        key = hashlib.sha256(identity.encode()).hexdigest()
        if per_session:
            home = workspace.session_home(ctx.tenant, ctx.session_id, ctx.agent_name)
            unit = sandbox.unit_name("session", ctx.tenant, ctx.session_id)
            writable: tuple[Path, ...] = (workspace.workspace_path(ctx.tenant, ctx.session_id), home)
        else:
            home = workspace.agent_home(ctx.tenant, ctx.agent_name)
            unit = sandbox.unit_name("tenant", ctx.tenant, key[:16])
            writable = (workspace.tenant_path(ctx.tenant),)
        box = (
            None
            if cfg.unsafe
            else sandbox.SandboxSpec(
                unit=unit,
                writable=writable,
                read_paths=cfg.read_paths,
                egress=cfg.egress,
                limits=cfg.limits,
            )
        )
        return ProcessSpec(
            key=key,
            label=f"{ctx.agent_name}/{ctx.tenant}/{key[:8]}",
            argv=cfg.command,
            env={**cfg.env, **option_env},
            home=home,
            sandbox=box,
            terminal=cfg.terminal,
            start_timeout=cfg.start_timeout,
            max_file_bytes=cfg.max_file_bytes,
            terminal_timeout=cfg.terminal_timeout,
            terminal_output_bytes=cfg.terminal_output_bytes,
            idle=cfg.idle,
            gateway=gateway,
        )

    @staticmethod
    def _gateway(ctx: TurnContext, cfg: Config) -> GatewaySpec | None:
        """The unit's model gateway: the key (the session's option value, the tenant's secret or
        the operator's default) stays in the worker; the agent gets a token of its own."""
        if cfg.gateway is None:
            return None
        return GatewaySpec(
            base_url=cfg.gateway.base_url,
            url_env=cfg.gateway.url_env,
            token_env=cfg.gateway.key_env,
            key=ctx.options.get(cfg.gateway.key_option) or "",
            token=secrets.token_urlsafe(32),
        )

    @staticmethod
    def _claim(process: AgentProcess) -> AgentProcess:
        process.users += 1
        process.touch()
        return process

    async def _process_for(self, spec: ProcessSpec, claimed: list[AgentProcess]) -> AgentProcess:
        """The running process for `spec` (started if needed), claimed for this turn."""
        process = self._processes.get(spec.key)
        if process is not None and process.alive:
            claimed.append(self._claim(process))
            return process
        lock = self._starting.setdefault(spec.key, asyncio.Lock())
        async with lock:
            if spec.key in self._stopping:  # the previous process of this unit may be saving its sessions
                await asyncio.wait({self._stopping[spec.key][1]})
            process = self._processes.get(spec.key)
            if process is None or not process.alive:
                process = AgentProcess(spec)
                self._processes[spec.key] = process
                claimed.append(self._claim(process))
                await process.start()
            else:
                claimed.append(self._claim(process))
            return process

    async def _ready_session(self, ctx: TurnContext, cfg: Config, claimed: list[AgentProcess]) -> AcpSession:
        process = await self._process_for(self._spec(ctx, cfg), claimed)
        session = self._sessions.get(ctx.session_id)
        if session is None or session.process is not process or not process.alive:
            if session is not None:
                await self._drop(ctx.session_id)
            session = await self._open_session(ctx, cfg, process)
        session.permission_timeout = cfg.permission_timeout
        await self._apply_config_options(ctx, cfg, session)
        return session

    async def _open_session(self, ctx: TurnContext, cfg: Config, process: AgentProcess) -> AcpSession:
        try:
            path = workspace.ensure_dir(workspace.workspace_path(ctx.tenant, ctx.session_id))
            await process.own(path)
        except (ValueError, OSError) as exc:
            raise AgentError(f"The session's workspace cannot be created ({type(exc).__name__}).") from None
        previous = await routing.recall_acp_session(ctx.session_id, self._acp_ids)
        response, acp_id = None, None
        if previous and process.capabilities.load_session:
            try:
                response = await process.call(
                    process.connection.load_session(cwd=str(path), session_id=previous, mcp_servers=cfg.mcp_servers),
                    "session/load",
                )
                acp_id = previous
            except AgentError:
                if not process.alive:
                    raise
                logger.info("ACP agent %s could not load a session; starting a new one", process.spec.label)
        if acp_id is None:
            response = await process.call(
                process.connection.new_session(cwd=str(path), mcp_servers=cfg.mcp_servers), "session/new"
            )
            acp_id = response.session_id
        session = AcpSession(
            aap_id=ctx.session_id,
            tenant=ctx.tenant,
            acp_id=acp_id,
            workspace=path,
            process=process,
            terminals=Terminals(
                path, timeout=cfg.terminal_timeout, max_output=cfg.terminal_output_bytes, confine=process.confined
            ),
            permission_timeout=cfg.permission_timeout,
        )
        session.config_ids = {option.id for option in getattr(response, "config_options", None) or []}
        process.sessions[acp_id] = session
        self._sessions[ctx.session_id] = session
        await routing.remember_acp_session(ctx.session_id, acp_id, self._acp_ids)
        return session

    async def _apply_config_options(self, ctx: TurnContext, cfg: Config, session: AcpSession) -> None:
        """Set options routed to `session/set_config_option` when their value changed."""
        for name, route in cfg.options.items():
            config_id = route.get("configOption")
            value = ctx.options.get(name, "")
            if not config_id or not value or session.config_values.get(config_id) == value:
                continue
            if config_id not in session.config_ids:
                logger.info(
                    "ACP agent %s advertises no config option %r; option %r not applied",
                    session.process.spec.label,
                    config_id,
                    name,
                )
                continue
            process = session.process
            await process.call(
                process.connection.set_config_option(config_id=config_id, session_id=session.acp_id, value=value),
                f"option '{name}'",
            )
            session.config_values[config_id] = value

    def _start_prompt(self, ctx: TurnContext, session: AcpSession) -> Prompt:
        prompt = Prompt()
        session.prompt = prompt
        blocks = self._blocks(ctx, session.process)
        prompt.task = asyncio.get_running_loop().create_task(self._send_prompt(session, prompt, blocks))
        return prompt

    async def _send_prompt(self, session: AcpSession, prompt: Prompt, blocks: list[PromptBlock]) -> None:
        try:
            result = await session.process.connection.prompt(session_id=session.acp_id, prompt=blocks)
        except asyncio.CancelledError:
            prompt.queue.put_nowait(("done", ConnectionError("the prompt was abandoned")))
            raise
        except Exception as exc:
            result = exc
        prompt.finished_at = time.monotonic()
        prompt.queue.put_nowait(("done", result))

    @staticmethod
    def _blocks(ctx: TurnContext, process: AgentProcess) -> list[PromptBlock]:
        message = ctx.incoming[-1] if ctx.incoming else {}
        content = message.get("content", "")
        if isinstance(content, str):
            return [acp.text_block(content)]
        images = bool(process.capabilities.prompt_capabilities and process.capabilities.prompt_capabilities.image)
        blocks: list[PromptBlock] = []
        for block in content:
            if block.get("type") == "text":
                blocks.append(acp.text_block(block["text"]))
            elif block.get("type") == "image" and images and block["url"].startswith("data:"):
                mime, data = data_uri(block["url"])
                blocks.append(acp.image_block(data, mime))
            elif block.get("type") == "image":
                blocks.append(acp.text_block("[an image was attached; this agent does not accept images]"))
        return blocks or [acp.text_block("")]

    async def _drop(self, session_id: str) -> None:
        """Forget what this process holds for a session (its prompt is cancelled)."""
        session = self._sessions.pop(session_id, None)
        await self._holds.release(session_id)
        if session is None:
            return
        prompt, session.prompt = session.prompt, None
        session.close()
        session.process.sessions.pop(session.acp_id, None)
        if prompt is not None and prompt.task is not None and not prompt.task.done() and session.process.alive:
            with contextlib.suppress(Exception):
                await session.process.connection.cancel(session_id=session.acp_id)

    async def on_session_deleted(self, *, session_id: str, tenant: str, config: dict) -> None:
        await self._drop(session_id)
        with contextlib.suppress(ValueError):
            unit = sandbox.unit_name("session", tenant, session_id)
            for key, process in list(self._processes.items()):
                if process.spec.sandbox is not None and process.spec.sandbox.unit == unit:
                    self._processes.pop(key, None)
                    await process.stop("The session was deleted.", kill=True)
        with contextlib.suppress(Exception):
            await routing.announce_deleted(session_id)
        with contextlib.suppress(Exception):
            await routing.forget_acp_session(session_id, self._acp_ids)
        try:
            await asyncio.to_thread(workspace.remove_workspace, tenant, session_id)
            await asyncio.to_thread(sandbox.release_unit, sandbox.unit_name("session", tenant, session_id))
        except ValueError:
            pass

    # --- background: idle reaping and deletes seen by other processes ---------------------

    def _start_background(self) -> None:
        if self._background and not any(task.done() for task in self._background):
            return
        loop = self._loop = asyncio.get_running_loop()
        self._background = [
            # A fresh context each: no log ids of the turn that happened to start them.
            loop.create_task(self._reap_forever(), context=contextvars.Context()),
            loop.create_task(self._watch_limits_forever(), context=contextvars.Context()),
            loop.create_task(routing.listen_deleted(self._on_deleted_elsewhere), context=contextvars.Context()),
        ]

    def _on_deleted_elsewhere(self, session_id: str) -> None:
        if session_id in self._sessions:
            asyncio.get_running_loop().create_task(self._drop(session_id))

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_SECONDS)
            try:
                await self._reap()
            except Exception:  # the reaper task's boundary: the next round tries again
                logger.warning("reaping ACP agents failed", exc_info=True)

    async def _watch_limits_forever(self) -> None:
        """Check every sandboxed unit against its limits: one pass over /proc per interval for
        all of them; disk use every interval for units in a turn, every fifth for idle ones."""
        interval = settings.AAP_SANDBOX_MONITOR_SECONDS
        tick = 0
        while True:
            await asyncio.sleep(interval)
            tick += 1
            watched = [p for p in self._processes.values() if p.alive and p.spec.sandbox is not None]
            if not watched:
                continue
            try:
                snap = await asyncio.to_thread(limits.snapshot)
                for process in watched:
                    with log_context(**process.log_ids()):
                        await process.check_limits(snap, disk=bool(process.users) or tick % 5 == 0)
            except Exception:  # the monitor task's boundary: the next round tries again
                logger.warning("checking ACP agents against their limits failed", exc_info=True)

    async def _reap(self) -> None:
        now = time.monotonic()
        for session_id, session in list(self._sessions.items()):
            idle = session.process.spec.idle
            prompt = session.prompt
            busy = prompt is not None and (prompt.active or prompt.pending_waiters())
            if not busy and now - session.last_activity > idle and (prompt is not None or not session.process.alive):
                await self._drop(session_id)  # an undelivered prompt nobody came back for
        for key, process in list(self._processes.items()):
            sessions = list(process.sessions.values())
            if process.starting:  # not alive yet: starting in its sandbox, claimed by its turn
                continue
            if not process.alive:
                self._processes.pop(key, None)
                continue
            if process.users or now - process.last_used <= process.spec.idle:
                continue
            if any(s.prompt is not None or now - s.last_activity <= process.spec.idle for s in sessions):
                continue
            self._processes.pop(key, None)
            for session in sessions:
                self._sessions.pop(session.aap_id, None)
            with log_context(**process.log_ids()):
                await self._stop_gracefully(key, process, "The agent process was idle.")

    async def _stop_gracefully(self, key: str, process: AgentProcess, reason: str) -> None:
        """Stop a process as the agent expects (stdin closed, then AAP_ACP_STOP_GRACE_SECONDS
        to exit); a new process of the same unit starts only once it is gone."""
        stopping = asyncio.ensure_future(process.stop(reason))
        self._stopping[key] = (process, stopping)
        try:
            await asyncio.shield(stopping)
        finally:
            if self._stopping.get(key, (None, None))[1] is stopping:
                del self._stopping[key]

    # --- the process exits: a worker's shutdown (SIGTERM: a deploy, a restart) -------------

    def shutdown(self) -> None:
        """Stop every agent process gracefully, all at once, bounded: agents that save their
        sessions on exit (Agentao does, on stdin EOF) resume them in the next worker's
        `session/load`. What is still running after the bound is killed."""
        loop = self._loop
        if loop is not None and loop.is_running() and (self._processes or self._stopping):
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:  # never the case but in a misuse; blocking there would deadlock
                future = asyncio.run_coroutine_threadsafe(self._stop_all("The worker is shutting down."), loop)
                try:
                    future.result(settings.AAP_ACP_STOP_GRACE_SECONDS + SHUTDOWN_SLACK_SECONDS)
                except Exception:  # shutdown goes on: the agents are killed next
                    logger.warning("stopping the ACP agents gracefully failed", exc_info=True)
        self._kill_all()

    async def _stop_all(self, reason: str) -> None:
        processes = [(key, process) for key, process in self._processes.items() if not process.starting]
        for key, _ in processes:
            del self._processes[key]
        for session_id in list(self._sessions):
            await self._holds.release(session_id)  # its prompt ends with this process
        self._sessions.clear()
        stops = [self._stop_gracefully(key, process, reason) for key, process in processes]
        await asyncio.gather(*stops, *(stopping for _, stopping in self._stopping.values()), return_exceptions=True)

    def _kill_all(self) -> None:
        """Kill every process not yet stopped (the last resort at exit)."""
        stopping = [process for process, _ in list(self._stopping.values())]
        for process in list(self._processes.values()) + stopping:
            if process.process is not None and process.process.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.process.pid, signal.SIGKILL)
