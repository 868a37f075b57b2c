"""Writes of AAP sessions and turns: the rules of the protocol live here.

Views validate shapes (protocol serializers) and call one service; tasks call
`turn_execute`. Several rows that change together change in one transaction.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from agents.models import Agent, AgentOption
from agents.runtimes import runtime_for
from agents.runtimes.base import PermissionAnswer, ServerToolBinding, ToolCall
from agents.selectors import agent_definition, server_tool_specs
from hosting import crypto, metrics
from hosting.errors import BadRequest, Conflict, NotFound, describe_failure
from hosting.logs import bind_log_context

from . import admission, dispatch, events, host, idempotency_keys, liveness, turn_store
from .models import IdempotencyKey, Message, Session, Turn, new_turn_id
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


def session_create(*, tenant, agent_config: dict, messages: list[dict] | None, tools: list[dict] | None,
                   idempotency: tuple[str, str] | None = None) -> Session:
    """Create a session (validated against the agent) and store its seed history.

    `idempotency` is (Idempotency-Key, request fingerprint): a retry of the same request
    gets the same session back instead of a second one."""
    created, row = idempotency_keys.create_once(
        lambda: _session_create(tenant=tenant, agent_config=agent_config, messages=messages, tools=tools,
                                idempotency=idempotency),
        tenant, idempotency,
    )
    return created if created is not None else Session(public_id=row.session_public_id)


@transaction.atomic
def _session_create(*, tenant, agent_config: dict, messages: list[dict] | None, tools: list[dict] | None,
                    idempotency: tuple[str, str] | None) -> Session:
    from agents.selectors import agent_for_tenant

    row = idempotency_keys.replayed(tenant, idempotency)
    if row is not None:
        return Session(public_id=row.session_public_id)

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
    idempotency_keys.remember(tenant, idempotency, session.public_id)
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


def turn_start(*, tenant, session_id: str, data: dict, idempotency: tuple[str, str] | None = None) -> Turn:
    """Validate a turn against the session, store its incoming messages, enqueue it.

    Raises BadRequest (400), NotFound (404), Conflict (409, a turn is running) or a Redis
    error (503: nothing is stored). Returns the new turn (not read back from the database),
    or, for a retry with the same `idempotency` key and request, the turn it started.
    """
    created, row = idempotency_keys.create_once(
        lambda: _turn_start(tenant=tenant, session_id=session_id, data=data, idempotency=idempotency),
        tenant, idempotency,
    )
    return created if created is not None else _replayed_turn(row)


def _replayed_turn(row: IdempotencyKey) -> Turn:
    turn = Turn.objects.filter(id=row.turn_id).first()
    if turn is None:
        raise NotFound("The turn this Idempotency-Key started no longer exists (its session was deleted).")
    return turn


def _turn_start(*, tenant, session_id: str, data: dict, idempotency: tuple[str, str] | None) -> Turn:
    with transaction.atomic():
        session = _lock_session(tenant, session_id)
        row = idempotency_keys.replayed(tenant, idempotency)
        if row is not None:
            return _replayed_turn(row)
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
        idempotency_keys.remember(tenant, idempotency, session.public_id, turn.id)
        # Permission answers go to the worker holding the prompt that waits on them (ACP).
        node = runtime_for(agent.runtime_kind).pinned_worker(session_id=session.public_id) if permissions else None
        # `turn_start` (event 1) before the commit: a client sees its turn begin at once, and
        # with Redis unreachable this raises, the transaction rolls back and nothing is stored.
        start_meta = {"turnId": turn.id}
        queued = None if node else dispatch.queued_place(turn.id)  # every worker slot is taken
        if queued:
            start_meta["queued"] = queued
        events.backend().publish_sync(turn.id, 1, {"event": "turn_start", "_meta": start_meta})
        transaction.on_commit(lambda: dispatch.dispatch(turn.id, node=node))
    metrics.turn_started(agent=agent.name, tenant=tenant.name, stream=mode)
    return turn


def _lock_session(tenant, session_id: str) -> turn_store.SessionRow:
    session = turn_store.lock_session(tenant.pk, session_id)
    if session is None:
        raise NotFound(f"No session '{session_id}' exists for this token's tenant.")
    return session


def _end_active_if_lost(row: turn_store.SessionRow) -> bool:
    """The session's active turn is over, or was lost and is now ended. Inside the
    transaction that locked the session. A queued turn is never over: it waits (and is
    dispatched again if its dispatch was lost)."""
    turn = Turn.objects.filter(id=row.active_turn_id).first()
    if turn is None:
        return True
    if turn.status == Turn.QUEUED:
        turn_id, created_at = turn.id, turn.created_at
        transaction.on_commit(lambda: dispatch.redispatch_if_lost(turn_id, created_at))
        return False
    return _finalize_if_lost(turn, Session.objects.get(pk=row.pk))


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


DB_ERRORS = (OperationalError, InterfaceError)


def _with_db_retry(function, *args):
    """Call `function`, retrying while PostgreSQL is briefly unreachable (a restart, a
    failover): a worker's claim or finish must not turn a database blip into a lost turn."""
    deadline = time.monotonic() + settings.AAP_DB_RETRY_SECONDS
    pause = 0.2
    while True:
        try:
            return function(*args)
        except DB_ERRORS as exc:
            if time.monotonic() > deadline:
                raise
            logger.warning("database unavailable (%s); retrying %s", type(exc).__name__, function.__name__)
            connection.close()  # a broken connection goes back to the pool, which discards it
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def _output_json(turn_id: str) -> str | None:
    shaped = host.output_so_far(turn_id)
    return dumps(shaped) if shaped else None


def turn_execute(turn_id: str) -> None:
    """Run a queued turn to its end and persist it. Safe to call twice (the second is a no-op)."""
    backend = events.backend()
    try:
        backend.set_lease_sync(turn_id)  # the Redis lease backs up the PostgreSQL heartbeat
    except Exception as exc:
        logger.warning("no Redis lease for turn %s (%s); its heartbeat stands alone", turn_id, type(exc).__name__)
    # One conditional UPDATE claims the turn: a second delivery of the task finds nothing to do.
    try:
        claimed = _with_db_retry(turn_store.claim_turn, turn_id)
    except DB_ERRORS:
        try:
            backend.clear_dispatched_sync(turn_id)  # the outbox dispatches it again once PostgreSQL is back
        except Exception:
            pass
        raise
    if claimed is None:
        return
    liveness.track(turn_id, None if claimed.stream == "delta" else lambda: _output_json(turn_id))
    try:
        _execute_claimed(turn_id, claimed)
    finally:
        liveness.untrack(turn_id)


def _execute_claimed(turn_id: str, claimed: turn_store.ClaimedTurn) -> None:
    try:
        events.backend().clear_dispatched_sync(turn_id)
    except Exception:
        pass  # the mark expires by itself
    session = _with_db_retry(turn_store.session_for_turn, claimed.session_pk)
    if session is None:
        return
    bind_log_context(tenant=session.tenant_name, session=session.public_id)
    try:
        plan, compacted = _with_db_retry(_plan, turn_id, claimed, session)
    except Exception as exc:
        logger.error("turn %s could not be prepared: %s", turn_id, type(exc).__name__)
        try:
            last = events.last_seq_sync(turn_id)
        except Exception:
            last = 1
        outcome = host.TurnOutcome(
            "error", [], [], last, error="The turn could not be prepared.",
            stop_meta={"error": "The turn could not be prepared."},
        )
        compacted = []
    else:
        # The agent may run for minutes: give the connection back to the pool meanwhile.
        connection.close()
        outcome = host.execute_sync(plan)
    try:
        _with_db_retry(_finish, turn_id, claimed.session_pk, outcome, compacted)
    except Exception as exc:
        # Never re-raised to Celery, which would log the database's text (it quotes the values).
        logger.error("turn %s could not be stored: %s", turn_id, describe_failure(exc))
        try:
            events.backend().clear_lease_sync(turn_id)  # with its heartbeat stopped, it ends as lost
        except Exception:
            pass


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
        reclaimed = not ended and _reclaim_declared_lost(turn_id, session_pk, outcome)
        if not ended and not reclaimed:
            # Deleted with its session, or this is a retry whose first commit went through
            # (or a lost turn whose session moved on): the stream gets the stored ending.
            transaction.on_commit(lambda: publish_stop_if_missing(turn_id))
            return
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
        turn_store.set_output_seq(turn_id, first if outcome.messages else 0)
        _apply_compaction(session_pk, last, compacted + list(zip(seqs, outcome.messages)), outcome.compaction)
        meta = dict(outcome.stop_meta)
        if outcome.model_calls:
            meta["usage"] = {"promptTokens": outcome.prompt_tokens, "completionTokens": outcome.completion_tokens}
        if reclaimed:
            return  # its listeners already got the recovery's ending; history and the turn hold the truth
        transaction.on_commit(lambda: _publish_stop(turn_id, outcome.stop_reason, meta, seq=outcome.last_seq + 1))


def _reclaim_declared_lost(turn_id: str, session_pk: int, outcome: host.TurnOutcome) -> bool:
    """A worker finished a turn that was declared lost meanwhile (it was frozen longer than
    the lease): its real result wins. When nothing was written to the session since, what
    the recovery stored is taken back and the turn is running again, for _finish to end it."""
    session = Session.objects.select_for_update().filter(pk=session_pk).first()
    turn = Turn.objects.select_for_update().filter(id=turn_id).first()
    if session is None or turn is None or turn.status != Turn.DONE or turn.error != LOST_ERROR:
        return False
    last_of_turn = Message.objects.filter(session_id=session_pk, kind=Message.FULL, turn_id=turn_id).order_by("-seq").first()
    if session.active_turn_id is not None or last_of_turn is None or last_of_turn.seq != session.message_seq:
        logger.warning("turn %s finished after it was declared lost and its session moved on; kept as lost", turn_id)
        return False
    cut = turn.output_seq or session.message_seq + 1
    Message.objects.filter(session_id=session_pk, turn_id=turn_id, seq__gte=cut).delete()
    Session.objects.filter(pk=session_pk).update(message_seq=cut - 1)
    Turn.objects.filter(id=turn_id).update(status=Turn.RUNNING, stop_reason="", error="", finished_at=None, output_seq=0)
    logger.warning("turn %s finished after it was declared lost; its real result replaces the recovered one", turn_id)
    return turn_store.end_turn(
        turn_id, stop_reason=outcome.stop_reason, cancelled=outcome.cancelled, error=outcome.error[:500],
        prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
        model_calls=outcome.model_calls,
    )


def _stored_stop(turn: Turn) -> tuple[str, dict]:
    meta: dict = {}
    if turn.cancelled:
        meta["cancelled"] = True
    if turn.error:
        meta["error"] = turn.error
    if turn.model_calls:
        meta["usage"] = {"promptTokens": turn.prompt_tokens, "completionTokens": turn.completion_tokens}
    return turn.stop_reason or "error", meta


def publish_stop_if_missing(turn_id: str) -> None:
    """A finished turn whose stream has events but no `turn_stop` (its publication failed:
    Redis was down) gets one built from its row, so followers end."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return
    try:
        last = events.backend().last_sync(turn_id)
    except Exception:
        return
    if last is None or last[1].get("event") == "turn_stop":
        return
    stop_reason, meta = _stored_stop(turn)
    _publish_stop(turn_id, stop_reason, meta, seq=last[0] + 1)


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


LOST_ERROR = "The worker running this turn stopped before finishing."


def _is_lost(turn: Turn) -> bool:
    """A running turn whose PostgreSQL heartbeat is stale and whose Redis lease has lapsed.
    Queued turns are never lost: they wait for a worker, however long the queue."""
    if turn.status != Turn.RUNNING:
        return False
    beat = turn.heartbeat_at or turn.started_at
    if beat is not None and (timezone.now() - beat).total_seconds() < settings.AAP_TURN_LEASE_SECONDS:
        return False
    try:
        if events.backend().lease_alive_sync(turn.id):
            return False  # e.g. PostgreSQL was down longer than the lease: the worker lives
    except Exception:
        pass  # Redis down: the heartbeat alone decides
    return True


def _produced_before_loss(turn: Turn, streamed: list[tuple[int, dict]]) -> tuple[list[dict], list[dict]]:
    """What the lost worker's agent produced, and the events of it nobody was sent yet.

    `message` and `none` modes publish whole blocks only; the worker's last checkpoint
    (`partial`: its output as message-mode events) also holds the block it was in and any
    it had not published. The stream's events are a prefix of the checkpoint's then."""
    shown = [e for _, e in streamed if e["event"] not in ("turn_start", "turn_stop")]
    if turn.partial and turn.stream != "delta":
        import json

        checkpoint = json.loads(turn.partial)
        if len(checkpoint) >= len(shown) and fold(checkpoint[: len(shown)]) == fold(shown):
            return fold(checkpoint), checkpoint[len(shown):]
    return fold(shown), []


def _finalize_if_lost(turn: Turn, session: Session) -> bool:
    """Inside a transaction holding the session lock: end a lost turn with `error`.

    What the lost worker had already produced is folded into history, so the history
    still equals what listeners saw (and more, in message/none modes). Returns True when
    the turn was (or is now) over.
    """
    if turn.status == Turn.DONE:
        return True
    if not _is_lost(turn):
        return False
    streamed = events.backend().read_all_sync(turn.id)
    produced, unsent = _produced_before_loss(turn, streamed)
    message = LOST_ERROR
    Turn.objects.filter(id=turn.id).update(
        status=Turn.DONE, stop_reason="error", error=message, finished_at=timezone.now(), partial="",
        output_seq=session.message_seq + 1 if produced else 0,
    )
    _append_messages(session, produced, turn=turn)
    session.pending_calls = []
    session.active_turn = None
    session.save(update_fields=["message_seq", "pending_calls", "active_turn", "updated_at"])
    last = streamed[-1][0] if streamed else 0
    turn_id = turn.id

    def publish_end():
        # Listeners get the rest of what history now holds, then the ending.
        try:
            for offset, event in enumerate(unsent, start=1):
                events.backend().publish_sync(turn_id, last + offset, event)
        except Exception as exc:
            logger.warning("could not publish the recovered output of %s: %s", turn_id, type(exc).__name__)
        _publish_stop(turn_id, "error", {"error": message}, seq=last + len(unsent) + 1)

    transaction.on_commit(publish_end)
    logger.warning("turn %s was lost (%s); ended with error", turn.id, turn.status)
    metrics.turn_lost(turn.status)
    turn.status = Turn.DONE
    return True


_LIVENESS_FIELDS = ("status", "created_at", "session_id", "heartbeat_at", "started_at")


def turn_recover_if_lost(turn_id: str) -> bool:
    """End the turn with `error` if its worker is gone; dispatch it again if it is queued
    and its dispatch was lost; give a finished turn's stream its missing `turn_stop`.
    Returns True if the turn is over."""
    turn = Turn.objects.filter(id=turn_id).only(*_LIVENESS_FIELDS).first()
    if turn is None:
        return True
    if turn.status == Turn.QUEUED:
        dispatch.redispatch_if_lost(turn.id, turn.created_at)
        return False
    if turn.status == Turn.DONE:
        publish_stop_if_missing(turn_id)
        return True
    if not _is_lost(turn):
        return False
    with transaction.atomic():
        session = Session.objects.select_for_update().filter(pk=turn.session_id).first()
        turn = Turn.objects.select_for_update().filter(id=turn_id).first()
        if session is None or turn is None:
            return True
        return _finalize_if_lost(turn, session)


def turn_result(turn_id: str) -> dict | None:
    """A finished turn's `stream: "none"` body, from PostgreSQL alone (None: not finished)."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return None
    stop_reason, meta = _stored_stop(turn)
    messages = turn_store.turn_output(turn_id, turn.session_id, turn.output_seq)
    return {"stopReason": stop_reason, "messages": messages, "_meta": {"turnId": turn_id, **meta}}


def sweep_stale_turns() -> int:
    """End every lost turn, dispatch queued turns whose dispatch was lost, forget expired
    Idempotency-Keys (run periodically); returns how many turns were ended."""
    dispatch.dispatch_pending()
    idempotency_keys.forget_expired()
    ended = 0
    for turn_id in Turn.objects.filter(status=Turn.RUNNING).values_list("id", flat=True):
        turn = Turn.objects.filter(id=turn_id).only(*_LIVENESS_FIELDS).first()
        if turn is not None and _is_lost(turn):
            ended += bool(turn_recover_if_lost(turn_id))
    return ended
