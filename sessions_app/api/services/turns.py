"""Starting and cancelling turns: a turn is validated against its session, stored with its
incoming messages and `turn_start` published in one transaction, then a worker is woken."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from agents.runtimes import runtime_for
from agents.selectors import agent_definition
from infra import metrics, tracing
from infra.service_errors import BadRequest, Conflict, NotFound
from sessions_app.engine import events, queue, store
from sessions_app.engine.recovery import finalize_if_lost
from sessions_app.models import IdempotencyKey, Session, Turn, new_turn_id

from .. import admission
from . import sessions
from .validation import (
    answers_for_pending,
    check_images,
    check_stream,
    merge_options,
    validate_client_tools,
    validate_server_tools,
)


def turn_start(
    *,
    tenant,
    session_id: str,
    data: dict,
    idempotency: tuple[str, str] | None = None,
    turn_id: str | None = None,
) -> Turn:
    """Validate a turn against the session, store its incoming messages, enqueue it.

    Raises BadRequest (400), NotFound (404), Conflict (409, a turn is running) or a Redis
    error (503: nothing is stored). Returns the new turn (not read back from the database),
    or, for a retry with the same `idempotency` key and request, the turn it started.
    `turn_id`: the new turn's id, chosen by the caller (stream.chosen_turn_id), else a new one.
    """
    created, row = admission.create_once(
        lambda: _turn_start(tenant=tenant, session_id=session_id, data=data, idempotency=idempotency, turn_id=turn_id),
        tenant,
        idempotency,
    )
    return created if created is not None else _replayed_turn(row)


def session_open(
    *,
    tenant,
    agent_config: dict,
    seed: list[dict],
    tools: list[dict] | None,
    turn: dict,
    idempotency: tuple[str, str] | None = None,
    turn_id: str | None = None,
) -> tuple[str, Turn]:
    """Create a session from `seed` and start its first turn (`turn`: a turn request) in one
    transaction, so a refused turn leaves no session behind (the v2-era `PUT /session`).

    Returns (session id, turn); a retry with the same `idempotency` key and request gets the
    same pair back."""

    def create() -> tuple[str, Turn]:
        with transaction.atomic():
            row = admission.replayed(tenant, idempotency)
            if row is not None:
                return row.session_public_id, _replayed_turn(row)
            session = sessions.session_create_in_transaction(
                tenant=tenant, agent_config=agent_config, messages=seed, tools=tools
            )
            started = _turn_start(
                tenant=tenant, session_id=session.public_id, data=turn, idempotency=idempotency, turn_id=turn_id
            )
            return session.public_id, started

    created, row = admission.create_once(create, tenant, idempotency)
    return created if created is not None else (row.session_public_id, _replayed_turn(row))


def _replayed_turn(row: IdempotencyKey) -> Turn:
    turn = Turn.objects.filter(id=row.turn_id).first()
    if turn is None:
        raise NotFound("The turn this Idempotency-Key started no longer exists (its session was deleted).")
    return turn


def _turn_start(
    *, tenant, session_id: str, data: dict, idempotency: tuple[str, str] | None, turn_id: str | None = None
) -> Turn:
    with transaction.atomic():
        session = _lock_session(tenant, session_id)
        row = admission.replayed(tenant, idempotency)
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
        if not session.agent_allowed:
            raise BadRequest(f"Agent '{agent.name}' is no longer available to this tenant; ask the operator.")
        agent_config = data.get("agent") or {}
        if agent_config.get("name") not in (None, agent.name):
            raise BadRequest(f"This session runs agent '{agent.name}'; agent.name cannot change.")
        mode = data.get("stream", "none")
        check_stream(agent, mode)
        messages = data["messages"]
        check_images(agent, messages)

        changes: dict = {}
        if "options" in agent_config:
            changes["options"] = merge_options(agent, session.options, agent_config["options"])
        if "tools" in agent_config:
            changes["server_tools"] = session.server_tools = validate_server_tools(agent, agent_config["tools"])
        if "tools" in data:
            changes["client_tools"] = session.client_tools = data["tools"]
        if "tools" in agent_config or "tools" in data:
            validate_client_tools(agent, session.client_tools, session.server_tools)

        tool_messages, permissions = answers_for_pending(session.pending_calls, messages)
        admission.admit_turn(tenant=tenant)  # 429 at a tenant limit; nothing is stored then
        turn = Turn(id=turn_id or new_turn_id(), session_id=session.pk, stream=mode, permissions=permissions)
        # Permission answers go to the worker holding the prompt that waits on them (ACP).
        node = runtime_for(agent.runtime_kind).pinned_worker(session_id=session.public_id) if permissions else None
        # Where the worker slots stand, read by the statement that stores the turn (for a stream).
        room_query = None if node or mode == "none" else queue.room_for(turn.id, tenant)
        incoming = tool_messages if session.pending_calls else messages
        counts = store.start_turn(
            turn.id,
            session.pk,
            mode,
            permissions,
            first_seq=session.message_seq + 1,
            messages=incoming,
            session_fields={
                "pending_calls": [],
                "active_turn": turn.id,
                "message_seq": session.message_seq + len(incoming),
                **changes,
            },
            node=node or "",
            aim=None if node else queue.aimed_worker(),
            trace_parent=tracing.trace_parent(),
            read=(room_query.sql, room_query.params) if room_query else None,
        )
        room = room_query.room(counts) if room_query else None
        admission.remember(tenant, idempotency, session.public_id, turn.id)
        # `turn_start` (event 1) before the commit: a client sees its turn begin at once, and
        # with Redis unreachable this raises, the transaction rolls back and nothing is stored.
        start_meta: dict[str, Any] = {"turnId": turn.id}
        # Every worker slot is taken, or others wait: where the turn stands among them (for
        # a stream; `stream: "none"` answers once the turn is over, and shows no turn_start).
        queued = queue.queued_place(turn.id, room) if room is not None and not room.takes_slot else None
        if queued:
            start_meta["queued"] = queued
        events.backend().publish_sync(turn.id, 1, {"event": "turn_start", "_meta": start_meta})
        queue.wake_after_commit(node)
    metrics.turn_started(agent=agent.name, tenant=tenant.name, stream=mode)
    return turn


def _lock_session(tenant, session_id: str) -> store.SessionRow:
    session = store.lock_session(tenant.pk, session_id)
    if session is None:
        raise NotFound(f"No session '{session_id}' exists for this token's tenant.")
    return session


def _end_active_if_lost(row: store.SessionRow) -> bool:
    """The session's active turn is over, or was lost and is now ended. Inside the
    transaction that locked the session. A queued turn is never over: it waits for a worker."""
    turn = Turn.objects.filter(id=row.active_turn_id).first()
    if turn is None:
        return True
    if turn.status == Turn.QUEUED:
        return False
    return finalize_if_lost(turn, Session.objects.get(pk=row.pk))


def turn_read(*, tenant, session_id: str, turn_id: str) -> dict:
    """A turn's state (`queued`, `running`, `done`) and, once done, its stored result: the
    body a `stream: "none"` request answers (stop reason, the messages it produced, usage)."""
    turn = Turn.objects.filter(id=turn_id, session__public_id=session_id, session__tenant=tenant).first()
    if turn is None:
        raise NotFound(f"No turn '{turn_id}' exists on session '{session_id}' for this token's tenant.")
    if turn.status != Turn.DONE:
        return {"turnId": turn.id, "status": turn.status}
    result = store.turn_result(turn.id) or {}
    return {"turnId": turn.id, "status": turn.status, **result}


def turn_cancel(*, tenant, session_id: str, turn_id: str) -> Turn:
    turn = Turn.objects.filter(id=turn_id, session__public_id=session_id, session__tenant=tenant).first()
    if turn is None:
        raise NotFound(f"No turn '{turn_id}' exists on session '{session_id}' for this token's tenant.")
    if turn.status != Turn.DONE:
        events.backend().request_cancel_sync(turn.id)
    return turn
