"""Running a queued turn on a worker: claim it once, plan it from PostgreSQL, run the
agent, persist its messages, pending calls and usage atomically, then publish `turn_stop`.

What a worker keeps about its turns (their heartbeats, their tasks, the histories it read)
is the worker's own (sessions_app.engine.worker.Worker), handed to `turn_execute`."""

from __future__ import annotations

import dataclasses
import logging
import time

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction

from agents.models import Agent
from agents.runtimes.base import PermissionAnswer, ServerToolBinding, ToolCall
from agents.selectors import AgentDefinition, agent_definition, option_rows, server_tool_specs
from infra import crypto, metrics
from infra.logs import bind_log_context

from ..models import Turn
from ..protocol import dumps, unstorable
from . import events, host, store
from .kept_history import KeptHistories
from .liveness import Liveness
from .store import LOST_ERROR, apply_compaction, publish_stop, publish_stop_if_missing

logger = logging.getLogger(__name__)


def effective_options(agent: Agent | AgentDefinition, stored: dict) -> dict[str, str]:
    """Every declared option's value for the runtime: set value, else default (decrypted)."""
    values = {}
    for option in option_rows(agent):
        if option.name in stored:
            values[option.name] = crypto.decrypt(stored[option.name]) if option.is_secret else stored[option.name]
        else:
            values[option.name] = option.default_value()
    return values


def _server_bindings(agent: AgentDefinition, refs: list[dict] | None) -> dict[str, ServerToolBinding]:
    if not refs:
        return {}
    specs = {spec["name"]: spec for spec in server_tool_specs(agent)}
    rows = {tool.name: tool for tool in agent.server_tools}
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


@dataclasses.dataclass
class _Compacted:
    """The compacted history a turn was planned with (positions and messages, in order)."""

    seqs: list[int]
    messages: list[dict]

    def then(self, seqs: list[int], messages: list[dict]) -> list[tuple[int, dict]]:
        """As (seq, message) pairs, followed by the turn's own."""
        return list(zip(self.seqs + seqs, self.messages + messages))


def _plan(
    turn_id: str, claimed: store.ClaimedTurn, session: store.TurnSession, histories: KeptHistories
) -> tuple[host.TurnPlan, _Compacted]:
    agent = agent_definition(session.agent_id, session.agent_revision)
    seqs, messages, incoming = histories.load(claimed.session_pk, turn_id)
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
        history=list(messages),  # the runtime's (the host appends answered permissions to it)
        incoming=incoming,
        permissions=permissions,
        stream=claimed.stream,
        capabilities=agent.capabilities(),
    )
    return plan, _Compacted(seqs, messages)


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


def _output_json(running: host.RunningTurns, turn_id: str) -> str | None:
    shaped = running.output_so_far(turn_id)
    return dumps(shaped) if shaped else None


def turn_execute(
    turn_id: str,
    claimed: store.ClaimedTurn,
    *,
    liveness: Liveness,
    running: host.RunningTurns,
    histories: KeptHistories,
) -> bool:
    """Run a turn a worker thread claimed (schedule_store.claim_next) to its end and persist
    it, with the worker's `liveness` (its heartbeat), `running` turns (a cancel reaches it
    there) and kept `histories`. Returns whether other turns were waiting for a worker slot
    as it ended (True when that is not known): the thread then claims the next."""
    backend = events.backend()
    try:
        backend.set_lease_sync(turn_id)  # the Redis lease backs up the PostgreSQL heartbeat
    except Exception:  # the Redis lease is a backup: the turn runs without it
        logger.warning("no Redis lease for turn %s; its heartbeat stands alone", turn_id, exc_info=True)
    metrics.turn_claimed(claimed.waited)
    liveness.track(turn_id, None if claimed.stream == "delta" else lambda: _output_json(running, turn_id))
    try:
        return _execute_claimed(turn_id, claimed, running, histories)
    finally:
        liveness.untrack(turn_id)


def _execute_claimed(
    turn_id: str, claimed: store.ClaimedTurn, running: host.RunningTurns, histories: KeptHistories
) -> bool:
    session = claimed.session or _with_db_retry(store.session_for_turn, claimed.session_pk)
    if session is None:
        return True
    bind_log_context(tenant=session.tenant_name, session=session.public_id)
    try:
        plan, compacted = _with_db_retry(_plan, turn_id, claimed, session, histories)
    except Exception:  # the turn's boundary: it ends with an error
        logger.error("turn %s could not be prepared", turn_id, exc_info=True)
        try:
            last = events.last_seq_sync(turn_id)
        except Exception:  # its ending is numbered from the start then
            logger.warning("the last event of turn %s is unreadable", turn_id, exc_info=True)
            last = 1
        outcome = host.TurnOutcome(
            "error",
            [],
            [],
            last,
            error="The turn could not be prepared.",
            stop_meta={"error": "The turn could not be prepared."},
        )
        compacted = _Compacted([], [])
    else:
        # The agent may run for minutes: give the connection back to the pool meanwhile.
        connection.close()
        outcome = host.execute_sync(plan, running)
    try:
        return _with_db_retry(_finish, turn_id, claimed.session_pk, outcome, compacted)
    except Exception:
        # Never re-raised to Celery, which would log the database's text (it quotes the values).
        logger.error("turn %s could not be stored", turn_id, exc_info=True)
        try:
            events.backend().clear_lease_sync(turn_id)  # with its heartbeat stopped, it ends as lost
        except Exception:  # the lease expires by itself
            logger.warning("could not clear the lease of %s", turn_id, exc_info=True)
        return True


def _finish(turn_id: str, session_pk: int, outcome: host.TurnOutcome, compacted: _Compacted) -> bool:
    """Persist a turn's messages, pending calls and usage atomically, then publish turn_stop.
    Locks the session, then the turn (the one lock order, docs/api.md "Guarantees").
    Returns whether other turns wait for a worker slot (True when not known)."""
    problem = unstorable(outcome.pending_calls)
    if problem:
        # History keeps the calls as produced (stored as text); jsonb cannot keep them pending.
        sentence = (
            "The agent produced a tool call that cannot be kept waiting for an answer: its input holds "
            "a NUL character (\\u0000) or a non-finite number."
        )
        outcome = dataclasses.replace(
            outcome,
            stop_reason="error",
            pending_calls=[],
            error=sentence,
            stop_meta={**outcome.stop_meta, "error": sentence},
        )
    with transaction.atomic():
        # The lock order of every transaction on a session and its turns: the session first
        # (a delete holding it and waiting for this turn's row would otherwise deadlock).
        store.lock_session_row(session_pk)
        ended = _end_turn(turn_id, outcome)
        if not ended:
            # Deleted with its session, a retry whose first commit went through, or a turn
            # declared lost while this worker was frozen or cut off: it ended once already,
            # and what its clients were told then is what history keeps (the fence,
            # docs/api.md "Guarantees"). The stream gets the stored ending if it lacks one.
            if _declared_lost(turn_id):
                logger.warning("turn %s finished after it was declared lost; its answer is not kept", turn_id)
            transaction.on_commit(lambda: publish_stop_if_missing(turn_id))
            return True
        others_waiting = ended.others_waiting
        last = store.close_turn_on_session(
            session_pk,
            added=len(outcome.messages),
            pending_calls=outcome.pending_calls,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
        )
        if last is None:
            return others_waiting
        first = last - len(outcome.messages) + 1
        seqs = store.insert_messages(session_pk, first, outcome.messages, turn_id=turn_id)
        if outcome.compaction is not None:
            apply_compaction(session_pk, last, compacted.then(seqs, outcome.messages), outcome.compaction)
        meta = dict(outcome.stop_meta)
        if outcome.model_calls:
            meta["usage"] = {"promptTokens": outcome.prompt_tokens, "completionTokens": outcome.completion_tokens}
            if outcome.usage_estimated:
                meta["usage"]["estimated"] = True
        transaction.on_commit(lambda: publish_stop(turn_id, outcome.stop_reason, meta, seq=outcome.last_seq + 1))
    return others_waiting


def _end_turn(turn_id: str, outcome: host.TurnOutcome) -> store.EndedTurn | None:
    """running -> done with the outcome's stop reason, error and usage (store.end_turn)."""
    return store.end_turn(
        turn_id,
        stop_reason=outcome.stop_reason,
        cancelled=outcome.cancelled,
        error=outcome.error[:500],
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        model_calls=outcome.model_calls,
        produced=bool(outcome.messages),
        usage_estimated=outcome.usage_estimated,
    )


def _declared_lost(turn_id: str) -> bool:
    return Turn.objects.filter(id=turn_id, status=Turn.DONE, error=LOST_ERROR).exists()
