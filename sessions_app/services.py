"""Writes of AAP sessions and turns: the rules of the protocol live here.

Views validate shapes (protocol serializers) and call one service; tasks call
`turn_execute`. Several rows that change together change in one transaction.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from django.db import connection, transaction
from django.utils import timezone

from agents.models import Agent, AgentOption
from agents.runtimes import runtime_for
from agents.runtimes.base import PermissionAnswer, ServerToolBinding, ToolCall
from agents.selectors import agent_definition, server_tool_specs
from hosting import crypto, metrics
from hosting.errors import BadRequest, Conflict, NotFound, describe_failure

from . import admission, events, host, turn_store
from .models import Message, Session, Turn, new_turn_id
from .protocol import content_images, dumps, fold, image_kind, tool_uses, unstorable

logger = logging.getLogger(__name__)


# --- configuration: options, server tools, client tools -------------------------------------


def _declared_options(agent: Agent) -> dict[str, AgentOption]:
    return {option.name: option for option in agent.options.all()}


def _merge_options(agent: Agent, stored: dict, incoming: dict) -> dict:
    """Validate option values and merge them over the stored ones (secrets encrypted)."""
    declared = _declared_options(agent)
    unknown = sorted(set(incoming) - set(declared))
    if unknown:
        names = ", ".join(declared) or "none"
        raise BadRequest(
            f"Unknown option {', '.join(repr(u) for u in unknown)} for agent '{agent.name}'; "
            f"its options are: {names}.",
            details={"unknownOptions": unknown},
        )
    merged = dict(stored)
    for name, value in incoming.items():
        option = declared[name]
        if option.type == AgentOption.SELECT and value not in option.choices:
            raise BadRequest(
                f"Option '{name}' must be one of: {', '.join(option.choices)} (got {value!r}).",
            )
        if option.is_secret and value == crypto.REDACTED:
            continue  # the placeholder means: keep the value in effect (at creation: the default)
        if value == option.public_default():
            # The advertised default (what a UI pre-fills from /meta) means "the default":
            # the same as not sending the option, or going back to the default on a turn.
            merged.pop(name, None)
        elif option.is_secret:
            merged[name] = crypto.encrypt(value)
        else:
            merged[name] = value
    return merged


def effective_options(agent: Agent, stored: dict) -> dict[str, str]:
    """Every declared option's value for the runtime: set value, else default (decrypted)."""
    values = {}
    for option in agent.options.all():
        if option.name in stored:
            values[option.name] = crypto.decrypt(stored[option.name]) if option.is_secret else stored[option.name]
        else:
            values[option.name] = option.default_value()
    return values


def redacted_options(agent: Agent, stored: dict) -> dict[str, str]:
    secret = {o.name for o in agent.options.all() if o.is_secret}
    return {name: (crypto.REDACTED if name in secret else value) for name, value in stored.items()}


def _validate_server_tools(agent: Agent, refs: list[dict]) -> list[dict]:
    exposed = {spec["name"] for spec in server_tool_specs(agent)}
    seen = set()
    for ref in refs:
        if ref["name"] not in exposed:
            raise BadRequest(
                f"Agent '{agent.name}' exposes no server tool named '{ref['name']}'; "
                f"see GET /v1/meta (it exposes: {', '.join(sorted(exposed)) or 'none'}).",
            )
        if ref["name"] in seen:
            raise BadRequest(f"Server tool '{ref['name']}' is listed twice in agent.tools.")
        seen.add(ref["name"])
    return [{"name": ref["name"], "trust": bool(ref.get("trust", False))} for ref in refs]


def _validate_client_tools(agent: Agent, tools: list[dict] | None, server_refs: list[dict] | None) -> None:
    if tools is None:
        return
    if tools and "application" not in agent.capabilities():
        raise BadRequest(f"Agent '{agent.name}' does not accept client tools (capabilities.application.tools).")
    names = [tool["name"] for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise BadRequest(f"Client tool names must be unique; repeated: {', '.join(duplicates)}.")
    collisions = sorted(set(names) & {ref["name"] for ref in server_refs or []})
    if collisions:
        raise BadRequest(
            f"Tool name collision: {', '.join(collisions)} is both a client tool and an enabled server tool."
        )


def _check_images(agent: Agent, messages: list[dict]) -> None:
    supported = agent.capabilities().get("image", {})
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for block in content_images(content):
            kind = image_kind(block["url"])
            if kind not in supported:
                label = "https:// image URLs" if kind == "http" else "data: image URIs"
                raise BadRequest(f"Agent '{agent.name}' does not accept {label} (capabilities.image.{kind}).")


def _check_stream(agent: Agent, mode: str) -> None:
    if mode not in agent.capabilities().get("stream", {}):
        modes = ", ".join(agent.capabilities().get("stream", {}))
        raise BadRequest(f"Agent '{agent.name}' does not support stream '{mode}'; it supports: {modes}.")


# --- history ---------------------------------------------------------------------------------


def _append_messages(session: Session, messages: list[dict], *, turn: Turn | None = None, compacted_from: int = 0) -> list[int]:
    """Append messages to a session's full history, and those from `compacted_from` on to
    its compacted history too (the caller saves session.message_seq)."""
    seqs = turn_store.insert_messages(
        session.pk, session.message_seq + 1, messages, turn_id=turn.id if turn else None, compacted_from=compacted_from
    )
    session.message_seq += len(messages)
    return seqs


def _apply_compaction(session_pk: int, message_seq: int, compacted: list[tuple[int, dict]], compaction) -> None:
    """Keep the last `keep_last` compacted messages (never opening on an orphaned tool
    result) behind an optional summary; `full` history is never touched."""
    if compaction is None or compaction.keep_last >= len(compacted) and not compaction.summary:
        return
    kept = compacted[-compaction.keep_last :] if compaction.keep_last > 0 else []
    while kept and kept[0][1].get("role") == "tool":
        kept = kept[1:]
    cutoff = kept[0][0] if kept else message_seq + 1
    turn_store.drop_compacted_before(session_pk, cutoff)
    if compaction.summary:
        first = cutoff - len(compaction.summary)
        turn_store.insert_message_rows(
            [(session_pk, Message.COMPACTED, first + i, m.get("role", ""), dumps(m), None)
             for i, m in enumerate(compaction.summary)]
        )


def _seed_compaction_start(agent: Agent, messages: list[dict]) -> int:
    """Where a seeded history's compacted copy starts: the runtime's window, if it has one,
    never opening on a tool result whose call was cut off."""
    window = runtime_for(agent.runtime_kind).seed_window(agent.runtime_config or {})
    if window is None or window >= len(messages):
        return 0
    start = len(messages) - window
    while start < len(messages) and messages[start].get("role") == "tool":
        start += 1
    return start


def pending_from_history(messages: list[dict], client_tools: list[dict] | None, server_refs: list[dict] | None) -> list[dict]:
    """Unresolved tool calls at the end of a seeded history, so an application can resume."""
    answered = {m.get("toolCallId") for m in messages if m.get("role") == "tool"}
    for message in reversed(messages):
        uses = tool_uses(message)
        if uses:
            server = {ref["name"]: ref for ref in server_refs or []}
            return [
                {
                    "toolCallId": use["toolCallId"],
                    "name": use["name"],
                    "input": use.get("input", {}),
                    "kind": "permission" if use["name"] in server and not server[use["name"]]["trust"] else "client",
                }
                for use in uses
                if use["toolCallId"] not in answered
            ]
        if message.get("role") in ("user", "assistant"):
            return []
    return []


# --- sessions --------------------------------------------------------------------------------


@transaction.atomic
def session_create(*, tenant, agent_config: dict, messages: list[dict] | None, tools: list[dict] | None) -> Session:
    """Create a session (validated against the agent) and store its seed history."""
    from agents.selectors import agent_for_tenant

    agent = agent_for_tenant(agent_config["name"], tenant)
    if agent is None:
        raise BadRequest(f"Unknown agent '{agent_config['name']}'; GET /v1/meta lists the agents you can use.")
    options = _merge_options(agent, {}, agent_config.get("options") or {})
    server_refs = _validate_server_tools(agent, agent_config["tools"]) if "tools" in agent_config else None
    _validate_client_tools(agent, tools, server_refs)
    _check_images(agent, messages or [])
    admission.admit_session(tenant=tenant)
    session = Session.objects.create(
        tenant=tenant, agent=agent, options=options, server_tools=server_refs, client_tools=tools
    )
    if messages:
        _append_messages(session, messages, compacted_from=_seed_compaction_start(agent, messages))
        session.pending_calls = pending_from_history(messages, tools, server_refs)
        session.save(update_fields=["message_seq", "pending_calls"])
    return session


def _session_for_update(tenant, session_id: str) -> Session:
    session = (
        Session.objects.select_for_update(of=("self",))
        .select_related("agent")
        .filter(public_id=session_id, tenant=tenant)
        .first()
    )
    if session is None:
        raise NotFound(f"No session '{session_id}' exists for this token's tenant.")
    return session


def session_delete(*, tenant, session_id: str) -> None:
    """Delete a session and its history; a running turn on it is cancelled first."""
    with transaction.atomic():
        session = _session_for_update(tenant, session_id)
        turn = session.active_turn
        if turn is not None and turn.status != Turn.DONE:
            events.backend().request_cancel_sync(turn.id)
            turn_id = turn.id
            transaction.on_commit(lambda: _publish_stop(turn_id, "end_turn", {"cancelled": True}))
        agent = session.agent
        session.delete()
    try:
        host.run_sync(
            runtime_for(agent.runtime_kind).on_session_deleted(session_id=session_id, tenant=tenant.name, config=agent.runtime_config),
            timeout=30,
        )
    except Exception as exc:
        logger.warning("runtime cleanup of a deleted session failed: %s", type(exc).__name__)


# --- turns -----------------------------------------------------------------------------------


def _answers_for_pending(pending: list[dict], messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """Check a turn's messages against the pending calls; returns (tool messages, permissions)."""
    by_id = {call["toolCallId"]: call for call in pending}
    roles = [m["role"] for m in messages]
    if not pending:
        if roles != ["user"]:
            ids = [m.get("toolCallId") for m in messages if m["role"] != "user"]
            if ids:
                raise BadRequest(
                    f"No tool calls are pending, so these answers match nothing: {', '.join(ids)}; "
                    "send one user message.",
                    details={"toolCallIds": ids},
                )
            raise BadRequest("Send exactly one user message per turn.")
        return [], []
    if "user" in roles:
        ids = list(by_id)
        raise BadRequest(
            f"Tool calls are pending ({', '.join(ids)}); answer each with a 'tool' message (client tools) "
            "or a 'tool_permission' message (server tools) before sending a user message.",
            details={"pendingToolCallIds": ids},
        )
    seen: set[str] = set()
    unknown, duplicate, wrong = [], [], []
    for message in messages:
        call_id = message["toolCallId"]
        call = by_id.get(call_id)
        if call is None:
            unknown.append(call_id)
        elif call_id in seen:
            duplicate.append(call_id)
        elif (message["role"] == "tool") != (call["kind"] == "client"):
            wrong.append(call_id)
        seen.add(call_id)
    missing = [call_id for call_id in by_id if call_id not in seen]
    problems = []
    if unknown:
        problems.append(f"unknown toolCallId {', '.join(unknown)}")
    if duplicate:
        problems.append(f"answered more than once: {', '.join(duplicate)}")
    if wrong:
        problems.append(
            f"wrong answer kind for {', '.join(wrong)} (client tools take a 'tool' message, "
            "server tools a 'tool_permission')"
        )
    if missing:
        problems.append(f"not answered: {', '.join(missing)}")
    if problems:
        raise BadRequest(
            "The messages must answer every pending tool call exactly once: " + "; ".join(problems) + ".",
            details={"unknown": unknown, "duplicate": duplicate, "wrongKind": wrong, "missing": missing},
        )
    tool_messages = [m for m in messages if m["role"] == "tool"]
    permissions = [
        {
            "toolCallId": m["toolCallId"],
            "name": by_id[m["toolCallId"]]["name"],
            "input": by_id[m["toolCallId"]].get("input", {}),
            "granted": m["granted"],
            "reason": m.get("reason") or None,
        }
        for m in messages
        if m["role"] == "tool_permission"
    ]
    return tool_messages, permissions


def turn_start(*, tenant, session_id: str, data: dict) -> Turn:
    """Validate a turn against the session, store its incoming messages, enqueue it.

    Raises BadRequest (400), NotFound (404) or Conflict (409, a turn is running). Returns
    the new turn (not read back from the database).
    """
    with transaction.atomic():
        session = _lock_session(tenant, session_id)
        if session.active_turn_id is not None:
            if not _end_active_if_lost(session):
                raise Conflict("A turn is already running on this session; wait for its turn_stop or cancel it.")
            session = _lock_session(tenant, session_id)  # the lost turn's output joined the history
        agent = agent_definition(session.agent_id, session.agent_revision)
        if not agent.enabled:
            raise BadRequest(f"Agent '{agent.name}' is disabled; the operator can enable it again.")
        # Access is checked on every turn: an operator may have restricted the agent since.
        if not Agent.objects.for_tenant(tenant).filter(pk=agent.pk).exists():
            raise BadRequest(f"Agent '{agent.name}' is no longer available to this tenant; ask the operator.")
        agent_config = data.get("agent") or {}
        if agent_config.get("name") not in (None, agent.name):
            raise BadRequest(f"This session runs agent '{agent.name}'; agent.name cannot change.")
        mode = data.get("stream", "none")
        _check_stream(agent, mode)
        messages = data["messages"]
        _check_images(agent, messages)

        changes: dict = {}
        if "options" in agent_config:
            changes["options"] = _merge_options(agent, session.options, agent_config["options"])
        if "tools" in agent_config:
            changes["server_tools"] = session.server_tools = _validate_server_tools(agent, agent_config["tools"])
        if "tools" in data:
            changes["client_tools"] = session.client_tools = data["tools"]
        if "tools" in agent_config or "tools" in data:
            _validate_client_tools(agent, session.client_tools, session.server_tools)

        tool_messages, permissions = _answers_for_pending(session.pending_calls, messages)
        admission.admit_turn(tenant=tenant)  # 429 at a tenant limit; nothing is stored then
        turn = Turn(id=new_turn_id(), session_id=session.pk, stream=mode, permissions=permissions)
        turn_store.insert_turn(turn.id, session.pk, mode, permissions)
        incoming = tool_messages if session.pending_calls else messages
        turn_store.insert_messages(session.pk, session.message_seq + 1, incoming, turn_id=turn.id)
        turn_store.update_session(
            session.pk, pending_calls=[], active_turn=turn.id, message_seq=session.message_seq + len(incoming), **changes
        )
        # Permission answers go to the worker holding the prompt that waits on them (ACP).
        node = runtime_for(agent.runtime_kind).pinned_worker(session_id=session.public_id) if permissions else None
        transaction.on_commit(lambda: _announce_and_enqueue(turn.id, node))
    metrics.turn_started(agent=agent.name, tenant=tenant.name, stream=mode)
    return turn


def _lock_session(tenant, session_id: str) -> turn_store.SessionRow:
    session = turn_store.lock_session(tenant.pk, session_id)
    if session is None:
        raise NotFound(f"No session '{session_id}' exists for this token's tenant.")
    return session


def _end_active_if_lost(row: turn_store.SessionRow) -> bool:
    """The session's active turn is over, or was lost and is now ended. Inside the
    transaction that locked the session."""
    turn = Turn.objects.filter(id=row.active_turn_id).first()
    if turn is None:
        return True
    return _finalize_if_lost(turn, Session.objects.get(pk=row.pk))


def _announce_and_enqueue(turn_id: str, node: str | None) -> None:
    """Publish `turn_start` (event 1) from here, so a client sees its turn begin at once,
    then hand the turn to a worker."""
    from .tasks import enqueue_turn

    events.backend().publish_sync(turn_id, 1, {"event": "turn_start", "_meta": {"turnId": turn_id}})
    enqueue_turn(turn_id, node=node)


def _server_bindings(agent: Agent, refs: list[dict] | None) -> dict[str, ServerToolBinding]:
    if not refs:
        return {}
    specs = {spec["name"]: spec for spec in server_tool_specs(agent)}
    rows = {tool.name: tool for tool in agent.server_tools.all()}
    bindings = {}
    for ref in refs:
        spec = specs.get(ref["name"])
        if spec is None:
            continue  # the operator removed it since; the agent no longer sees it
        row = rows.get(ref["name"])
        bindings[ref["name"]] = ServerToolBinding(
            spec=spec,
            trust=bool(ref.get("trust")),
            implementation=row.implementation if row else "",
            settings=row.settings if row else {},
        )
    return bindings


def _plan(turn_id: str, claimed: turn_store.ClaimedTurn, session: turn_store.TurnSession) -> tuple[host.TurnPlan, list[tuple[int, dict]]]:
    import json

    agent = agent_definition(session.agent_id, session.agent_revision)
    rows = turn_store.compacted_history(claimed.session_pk)
    compacted = [(seq, json.loads(data)) for seq, data, _ in rows]
    incoming = [message for (seq, message), (_, _, row_turn) in zip(compacted, rows) if row_turn == turn_id]
    permissions = [
        PermissionAnswer(ToolCall(p["toolCallId"], p["name"], p.get("input", {})), p["granted"], p.get("reason"))
        for p in claimed.permissions
    ]
    plan = host.TurnPlan(
        turn_id=turn_id,
        session_id=session.public_id,
        tenant=session.tenant_name,
        agent_name=agent.name,
        runtime_kind=agent.runtime_kind,
        config=agent.runtime_config or {},
        options=effective_options(agent, session.options),
        options_set=frozenset(session.options),
        server_tools=_server_bindings(agent, session.server_tools),
        client_tools={tool["name"]: tool for tool in session.client_tools or []},
        history=[message for _, message in compacted],
        incoming=incoming,
        permissions=permissions,
        stream=claimed.stream,
        capabilities=agent.capabilities(),
    )
    return plan, compacted


def turn_execute(turn_id: str) -> None:
    """Run a queued turn to its end and persist it. Safe to call twice (the second is a no-op)."""
    backend = events.backend()
    backend.set_lease_sync(turn_id)  # before the claim, so a running turn always has a lease
    # One conditional UPDATE claims the turn: a second delivery of the task finds nothing to do.
    claimed = turn_store.claim_turn(turn_id)
    if claimed is None:
        return
    claimed_at = time.monotonic()
    session = turn_store.session_for_turn(claimed.session_pk)
    if session is None:
        return
    try:
        plan, compacted = _plan(turn_id, claimed, session)
        if time.monotonic() - claimed_at > 1.0:
            backend.set_lease_sync(turn_id)  # preparing took a while; the host renews it from here
    except Exception as exc:
        logger.error("turn %s could not be prepared: %s", turn_id, type(exc).__name__)
        outcome = host.TurnOutcome(
            "error", [], [], events.last_seq_sync(turn_id), error="The turn could not be prepared.",
            stop_meta={"error": "The turn could not be prepared."},
        )
        compacted = []
    else:
        # The agent may run for minutes: give the connection back to the pool meanwhile.
        connection.close()
        outcome = host.execute_sync(plan)
    try:
        _finish(turn_id, claimed.session_pk, outcome, compacted)
    except Exception as exc:
        # Never re-raised to Celery, which would log the database's text (it quotes the values).
        logger.error("turn %s could not be stored: %s", turn_id, describe_failure(exc))
        backend.clear_lease_sync(turn_id)  # listeners end it as lost at their next check


def _finish(turn_id: str, session_pk: int, outcome: host.TurnOutcome, compacted: list[tuple[int, dict]]) -> None:
    """Persist a turn's messages, pending calls and usage atomically, then publish turn_stop."""
    problem = unstorable(outcome.pending_calls)
    if problem:
        # History keeps the calls as produced (stored as text); jsonb cannot keep them pending.
        sentence = "The agent produced a tool call that cannot be kept waiting for an answer: its input holds " \
                   "a NUL character (\\u0000) or a non-finite number."
        outcome = dataclasses.replace(
            outcome, stop_reason="error", pending_calls=[], error=sentence, stop_meta={**outcome.stop_meta, "error": sentence}
        )
    with transaction.atomic():
        ended = turn_store.end_turn(
            turn_id,
            stop_reason=outcome.stop_reason,
            cancelled=outcome.cancelled,
            error=outcome.error[:500],
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            model_calls=outcome.model_calls,
        )
        if not ended:
            return  # declared lost meanwhile, or deleted with its session
        last = turn_store.close_turn_on_session(
            session_pk,
            added=len(outcome.messages),
            pending_calls=outcome.pending_calls,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
        )
        if last is None:
            return
        first = last - len(outcome.messages) + 1
        seqs = turn_store.insert_messages(session_pk, first, outcome.messages, turn_id=turn_id)
        _apply_compaction(session_pk, last, compacted + list(zip(seqs, outcome.messages)), outcome.compaction)
        meta = dict(outcome.stop_meta)
        if outcome.model_calls:
            meta["usage"] = {"promptTokens": outcome.prompt_tokens, "completionTokens": outcome.completion_tokens}
        transaction.on_commit(lambda: _publish_stop(turn_id, outcome.stop_reason, meta, seq=outcome.last_seq + 1))


def _publish_stop(turn_id: str, stop_reason: str, meta: dict, *, seq: int | None = None) -> None:
    backend = events.backend()
    event = {"event": "turn_stop", "stopReason": stop_reason}
    if meta:
        event["_meta"] = meta
    try:
        backend.publish_sync(turn_id, seq or events.last_seq_sync(turn_id) + 1, event, final=True)
    except Exception as exc:
        logger.warning("could not publish turn_stop of %s: %s", turn_id, type(exc).__name__)
    finally:
        try:
            backend.clear_lease_sync(turn_id)
        except Exception:
            pass


def turn_cancel(*, tenant, session_id: str, turn_id: str) -> Turn:
    turn = Turn.objects.filter(id=turn_id, session__public_id=session_id, session__tenant=tenant).first()
    if turn is None:
        raise NotFound(f"No turn '{turn_id}' exists on session '{session_id}' for this token's tenant.")
    if turn.status != Turn.DONE:
        events.backend().request_cancel_sync(turn.id)
    return turn


# --- lost turns --------------------------------------------------------------------------------


def _is_lost(turn: Turn) -> bool:
    if turn.status == Turn.DONE:
        return False
    backend = events.backend()
    if backend.lease_alive_sync(turn.id):
        return False
    if turn.status == Turn.RUNNING:
        return True
    from django.conf import settings

    waited = (timezone.now() - turn.created_at).total_seconds()
    return waited > settings.AAP_TURN_START_TIMEOUT_SECONDS


def _finalize_if_lost(turn: Turn, session: Session) -> bool:
    """Inside a transaction holding the session lock: end a lost turn with `error`.

    What the lost worker had already streamed is folded into history, so the history
    still equals what listeners saw. Returns True when the turn was (or is now) over.
    """
    if turn.status == Turn.DONE:
        return True
    if not _is_lost(turn):
        return False
    streamed = events.backend().read_all_sync(turn.id)
    produced = fold(e for _, e in streamed if e["event"] not in ("turn_start", "turn_stop"))
    message = (
        "The worker running this turn stopped before finishing."
        if turn.status == Turn.RUNNING
        else "No worker picked this turn up in time."
    )
    Turn.objects.filter(id=turn.id).update(
        status=Turn.DONE, stop_reason="error", error=message, finished_at=timezone.now()
    )
    _append_messages(session, produced, turn=turn)
    session.pending_calls = []
    session.active_turn = None
    session.save(update_fields=["message_seq", "pending_calls", "active_turn", "updated_at"])
    last = streamed[-1][0] if streamed else 0
    turn_id = turn.id
    transaction.on_commit(lambda: _publish_stop(turn_id, "error", {"error": message}, seq=last + 1))
    logger.warning("turn %s was lost (%s); ended with error", turn.id, turn.status)
    metrics.turn_lost(turn.status)
    turn.status = Turn.DONE
    return True


def turn_recover_if_lost(turn_id: str) -> bool:
    """End the turn with `error` if its worker is gone. Returns True if the turn is over."""
    turn = Turn.objects.filter(id=turn_id).only("status", "created_at", "session_id").first()
    if turn is None:
        return True
    if turn.status == Turn.DONE or not _is_lost(turn):
        return turn.status == Turn.DONE
    with transaction.atomic():
        session = Session.objects.select_for_update().filter(pk=turn.session_id).first()
        turn = Turn.objects.select_for_update().filter(id=turn_id).first()
        if session is None or turn is None:
            return True
        return _finalize_if_lost(turn, session)


def sweep_stale_turns() -> int:
    """End every lost turn (run periodically); returns how many were ended."""
    ended = 0
    for turn_id in Turn.objects.exclude(status=Turn.DONE).values_list("id", flat=True):
        turn = Turn.objects.filter(id=turn_id).first()
        if turn is not None and turn.status != Turn.DONE and _is_lost(turn):
            ended += bool(turn_recover_if_lost(turn_id))
    return ended
