"""Writes of AAP sessions: creation (validated against the agent, seeded, idempotent) and
deletion (a running turn is cancelled first)."""

from __future__ import annotations

import logging

from django.db import transaction

from agents.runtimes import runtime_for
from agents.tools.mcp import session_deleted as mcp_session_deleted
from infra.service_errors import BadRequest, NotFound
from sessions_app.engine import events, host
from sessions_app.engine.store import append_messages, pending_from_history, publish_stop, seed_compaction_start
from sessions_app.models import Session, Turn

from .. import admission
from .validation import check_images, merge_options, validate_client_tools, validate_server_tools

logger = logging.getLogger(__name__)


def session_create(
    *,
    tenant,
    agent_config: dict,
    messages: list[dict] | None,
    tools: list[dict] | None,
    idempotency: tuple[str, str] | None = None,
) -> Session:
    """Create a session (validated against the agent) and store its seed history.

    `idempotency` is (Idempotency-Key, request fingerprint): a retry of the same request
    gets the same session back instead of a second one."""
    created, row = admission.create_once(
        lambda: _session_create(
            tenant=tenant, agent_config=agent_config, messages=messages, tools=tools, idempotency=idempotency
        ),
        tenant,
        idempotency,
    )
    return created if created is not None else Session(public_id=row.session_public_id)


@transaction.atomic
def _session_create(
    *,
    tenant,
    agent_config: dict,
    messages: list[dict] | None,
    tools: list[dict] | None,
    idempotency: tuple[str, str] | None,
) -> Session:
    from agents.selectors import agent_for_tenant

    row = admission.replayed(tenant, idempotency)
    if row is not None:
        return Session(public_id=row.session_public_id)

    agent = agent_for_tenant(agent_config["name"], tenant)
    if agent is None:
        raise BadRequest(f"Unknown agent '{agent_config['name']}'; GET /v1/meta lists the agents you can use.")
    options = merge_options(agent, {}, agent_config.get("options") or {})
    server_refs = validate_server_tools(agent, agent_config["tools"]) if "tools" in agent_config else None
    validate_client_tools(agent, tools, server_refs)
    check_images(agent, messages or [])
    admission.admit_session(tenant=tenant)
    session = Session.objects.create(
        tenant=tenant, agent=agent, options=options, server_tools=server_refs, client_tools=tools
    )
    if messages:
        append_messages(session, messages, compacted_from=seed_compaction_start(agent, messages))
        session.pending_calls = pending_from_history(messages, tools, server_refs)
        session.save(update_fields=["message_seq", "pending_calls"])
    admission.remember(tenant, idempotency, session.public_id)
    return session


def session_create_in_transaction(
    *, tenant, agent_config: dict, messages: list[dict] | None, tools: list[dict] | None
) -> Session:
    """session_create inside the caller's transaction, without an Idempotency-Key (the caller
    keeps its own: services.turns.session_open)."""
    return _session_create(tenant=tenant, agent_config=agent_config, messages=messages, tools=tools, idempotency=None)


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
    """Delete a session and its history; a running turn on it is cancelled: its stream ends
    with `turn_stop {cancelled: true}` once the delete commits.

    Locks the session, then (deleting them) its turns: the one lock order of every
    transaction on a session and its turns (docs/api.md "Guarantees"), which a turn's end
    (worker._finish) takes too, so a delete never waits on a turn in a cycle."""
    with transaction.atomic():
        session = _session_for_update(tenant, session_id)
        turn = Turn.objects.filter(id=session.active_turn_id).first() if session.active_turn_id else None
        if turn is not None and turn.status != Turn.DONE:
            events.backend().request_cancel_sync(turn.id)
            turn_id = turn.id
            transaction.on_commit(lambda: publish_stop(turn_id, "end_turn", {"cancelled": True}))
        agent = session.agent
        session.delete()
    for cleanup in (runtime_for(agent.runtime_kind).on_session_deleted, mcp_session_deleted):
        try:
            host.run_sync(cleanup(session_id=session_id, tenant=tenant.name, config=agent.runtime_config), timeout=30)
        except Exception:  # the session is deleted; what a runtime keeps of it expires
            logger.warning("cleanup of a deleted session failed", exc_info=True)
