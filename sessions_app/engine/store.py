"""The turn path's statements, and what is built on them: a turn's rows written as SQL, how a
turn ends on its stream and in its stored result, and a session's stored history.

Every turn reads and writes the same few rows: the session (locked), the turn, the new
messages. Each statement is one prepared string, built once, not a query the ORM builds on
every turn at many times the database's own cost for it
(docs/adr/0003-raw-sql-on-the-turn-path.md). The rules stay in the services; these
statements only move rows. Works on PostgreSQL and on SQLite (the embedded mode)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Field
from django.utils import timezone

from agents.models import Agent
from agents.runtimes import runtime_for
from infra.outages import OUTAGE_ERRORS
from tenancy.models import Tenant

from ..models import Message, Session, Turn
from ..protocol import dumps, fold, tool_uses
from . import events

logger = logging.getLogger(__name__)

S = Session._meta.db_table
T = Turn._meta.db_table
M = Message._meta.db_table
A = Agent._meta.db_table
TENANT = Tenant._meta.db_table

# Rows per INSERT statement: well under SQLite's and PostgreSQL's parameter limits.
INSERT_BATCH = 500


def _now():
    return connection.ops.adapt_datetimefield_value(timezone.now())


def _json_param(model, field: str, value):
    return model._meta.get_field(field).get_db_prep_save(value, connection)


def _json(text):
    return None if text is None else json.loads(text) if isinstance(text, str) else text


def _datetime(value) -> datetime:
    """A timestamp read by raw SQL: a datetime from PostgreSQL, text (UTC) from SQLite."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if timezone.is_aware(value) else timezone.make_aware(value, UTC)


def _for_update() -> str:
    return " FOR UPDATE OF s" if connection.features.has_select_for_update_of else ""


# --- sessions ---------------------------------------------------------------------------------


@dataclass
class SessionRow:
    pk: int
    public_id: str
    agent_id: int
    agent_revision: datetime
    options: dict
    server_tools: list | None
    client_tools: list | None
    pending_calls: list
    message_seq: int
    active_turn_id: str | None
    # The tenant may still use the session's agent: the agent is open to every tenant (no
    # tenants chosen) or lists this one. An operator may restrict an agent at any time.
    agent_allowed: bool


_SESSION_COLUMNS = (
    "s.id, s.public_id, s.agent_id, a.updated_at, s.options, s.server_tools, s.client_tools, "
    "s.pending_calls, s.message_seq, s.active_turn_id"
)
AGENT_TENANTS = Agent.tenants.through._meta.db_table
# Read with the session's lock (one statement instead of an ORM query per turn).
_AGENT_ALLOWED = (
    f"(NOT EXISTS (SELECT 1 FROM {AGENT_TENANTS} x WHERE x.agent_id = a.id) "
    f"OR EXISTS (SELECT 1 FROM {AGENT_TENANTS} x WHERE x.agent_id = a.id AND x.tenant_id = s.tenant_id))"
)


def _session_row(row) -> SessionRow:
    pk, public_id, agent_id, revision, options, server_tools, client_tools, pending, seq, active, allowed = row
    return SessionRow(
        pk,
        public_id,
        agent_id,
        revision,
        _json(options) or {},
        _json(server_tools),
        _json(client_tools),
        _json(pending) or [],
        seq,
        active,
        bool(allowed),
    )


def lock_session(tenant_id: int, public_id: str) -> SessionRow | None:
    """The tenant's session, locked until the transaction ends (PostgreSQL), with whether
    the tenant may still use its agent."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {_SESSION_COLUMNS}, {_AGENT_ALLOWED} FROM {S} s JOIN {A} a ON a.id = s.agent_id "
            f"WHERE s.public_id = %s AND s.tenant_id = %s{_for_update()}",
            [public_id, tenant_id],
        )
        row = cursor.fetchone()
    return _session_row(row) if row else None


def lock_session_row(session_pk: int) -> int | None:
    """Lock a session's row until the transaction ends; its last message position, None when
    it is gone. Every transaction that writes a session and its turns takes the session
    first, then the turn (docs/api.md, Guarantees): a delete and a turn's end never wait for
    each other in a cycle."""
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT message_seq FROM {S} WHERE id = %s{lock}", [session_pk])
        row = cursor.fetchone()
    return row[0] if row else None


@dataclass
class TurnSession:
    """What a worker needs of a session to run a turn."""

    public_id: str
    tenant_name: str
    agent_id: int
    agent_revision: datetime
    options: dict
    server_tools: list | None
    client_tools: list | None


# A session as a worker reads it (TurnSession), alone or with the claim of one of its turns.
_TURN_SESSION_COLUMNS = "s.public_id, tn.name, s.agent_id, a.updated_at, s.options, s.server_tools, s.client_tools"
_TURN_SESSION_JOINS = f"{S} s JOIN {A} a ON a.id = s.agent_id JOIN {TENANT} tn ON tn.id = s.tenant_id"


def _turn_session(row) -> TurnSession | None:
    public_id, tenant, agent_id, revision, options, server_tools, client_tools = row
    if public_id is None:
        return None
    return TurnSession(
        public_id, tenant, agent_id, revision, _json(options) or {}, _json(server_tools), _json(client_tools)
    )


def session_for_turn(session_pk: int) -> TurnSession | None:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {_TURN_SESSION_COLUMNS} FROM {_TURN_SESSION_JOINS} WHERE s.id = %s", [session_pk])
        row = cursor.fetchone()
    return _turn_session(row) if row else None


def _session_update(session_pk: int, fields: dict) -> tuple[str, list]:
    """The UPDATE setting columns of a session (JSON ones encoded as their field does) and
    updated_at, with its parameters."""
    columns, params = [], []
    for name, value in fields.items():
        field = Session._meta.get_field(name)
        if not isinstance(field, Field):  # a reverse relation: no column here
            raise ValueError(f"{name!r} is not a column of the session")
        columns.append(f"{field.column} = %s")
        params.append(field.get_db_prep_save(value, connection))
    columns.append("updated_at = %s")
    params.append(_now())
    return f"UPDATE {S} SET {', '.join(columns)} WHERE id = %s", [*params, session_pk]


# --- turns ------------------------------------------------------------------------------------


# The PostgreSQL notification channel of waiting turns (start_turn), which each worker
# listens to (sessions_app.engine.worker).
WAKE_CHANNEL = "aap_turn_waits"


def wake_payload(queue: str, node: str) -> str:
    """A notification's payload: the turn's queue, and the worker woken for it (none: any)."""
    return f"{queue}\t{node}"


def start_turn(
    turn_id: str,
    session_pk: int,
    stream: str,
    permissions: list,
    *,
    first_seq: int,
    messages: list[dict],
    session_fields: dict,
    node: str = "",
    aim: tuple[str, list] | None = None,
    trace_parent: str = "",
    read: tuple[str, list] | None = None,
) -> tuple | None:
    """Store a new queued turn with the messages it brings (full and compacted history, at
    `first_seq`, `first_seq` + 1...) and the session's changes (`session_fields`, columns of
    the session). `node`: the worker that must run it (it holds the prompt the turn answers),
    else any; `aim` (PostgreSQL, a turn any worker may run): a query (SQL, parameters) of the
    worker to wake for it (queue.aimed_worker); `trace_parent`: the trace its run continues.

    On PostgreSQL one statement does all three (its data-modifying CTEs), and it notifies
    WAKE_CHANNEL, which the workers hear when the transaction commits (never before, never
    for a turn rolled back): payload `wake_payload(queue, worker)`, the worker `node`, or
    the one `aim` gives (none: every worker of the queue). The caller holds the session's
    lock (lock_session), so the statement sees the session as it is.

    `read`: a query (SQL, parameters) of one row, read as the database was before the turn
    was stored; its row is returned (on PostgreSQL, from the same statement)."""
    insert = (
        f"INSERT INTO {T} (id, session_id, status, stream, stop_reason, cancelled, permissions, error, "
        f"prompt_tokens, completion_tokens, model_calls, created_at, partial, output_seq, pinned_node, trace_parent, "
        f"queue, worker_node) VALUES (%s, %s, %s, %s, '', %s, %s, '', 0, 0, 0, %s, '', 0, %s, %s, %s, "
        f"{f'COALESCE(({aim[0]}), %s)' if aim else '%s'}) RETURNING worker_node"
    )
    params: list = [
        turn_id,
        session_pk,
        Turn.QUEUED,
        stream,
        False,
        _json_param(Turn, "permissions", permissions),
        _now(),
        node or "",
        trace_parent,
        settings.AAP_TURN_QUEUE,
        *(aim[1] if aim else []),
        node or "",
    ]
    rows = _message_rows(session_pk, first_seq, messages, turn_id=turn_id)
    update, update_params = _session_update(session_pk, session_fields)
    if connection.vendor != "postgresql" or len(rows) > INSERT_BATCH:
        found = None
        with connection.cursor() as cursor:
            if read is not None:
                cursor.execute(*read)
                found = cursor.fetchone()
            cursor.execute(insert, params)
            (worker,) = cursor.fetchone()
        insert_message_rows(rows)
        with connection.cursor() as cursor:
            cursor.execute(update, update_params)
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_notify(%s, %s)", [WAKE_CHANNEL, wake_payload(settings.AAP_TURN_QUEUE, worker)]
                )
        return found
    ctes = [f"stored AS ({insert})"]
    if rows:
        rows_sql, rows_params = _message_insert(rows)
        ctes.append(f"added AS ({rows_sql})")
        params += rows_params
    ctes.append(f"moved AS ({update})")
    params += update_params
    select, source = "pg_notify(%s, %s || stored.worker_node)", "stored"
    if read is not None:
        # Every part of one statement sees the database as it was when the statement began.
        ctes.append(f"seen AS ({read[0]})")
        params += read[1]
        select, source = f"{select}, seen.*", "stored, seen"
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH {', '.join(ctes)} SELECT {select} FROM {source}",
            [*params, WAKE_CHANNEL, wake_payload(settings.AAP_TURN_QUEUE, "")],
        )
        found = cursor.fetchone()
    return tuple(found[1:]) if read is not None and found is not None else None


@dataclass
class ClaimedTurn:
    session_pk: int
    stream: str
    permissions: list
    waited: float = 0.0  # seconds from its acceptance to this claim
    session: TurnSession | None = None  # read with the claim (PostgreSQL); else session_for_turn
    trace_parent: str = ""  # the trace of the request that accepted it


# What a claim returns, then `claimed` builds the ClaimedTurn from.
CLAIMED_COLUMNS = "session_id, stream, permissions, created_at, trace_parent"


def with_session(update_ctes: str, update_name: str) -> str:
    """A claim's statement: the CTEs `update_ctes` (ending in the UPDATE named `update_name`,
    which returns the claimed columns), then its session's row (_TURN_SESSION_COLUMNS): the
    worker needs it next, and it costs no round trip of its own."""
    return (
        f"WITH {update_ctes} SELECT c.*, {_TURN_SESSION_COLUMNS} FROM {update_name} c "
        f"LEFT JOIN ({_TURN_SESSION_JOINS}) ON s.id = c.session_id"
    )


def claimed(row, started: datetime) -> ClaimedTurn:
    """The ClaimedTurn of a claim's row (CLAIMED_COLUMNS, then the session's columns, if read)."""
    session_pk, stream, permissions, created_at, trace_parent = row[:5]
    return ClaimedTurn(
        session_pk,
        stream,
        _json(permissions) or [],
        (started - _datetime(created_at)).total_seconds(),
        _turn_session(row[5:]) if len(row) > 5 else None,
        trace_parent or "",
    )


def waiting(alias: str) -> str:
    """SQL: the turn `alias` waits for a worker slot."""
    return f"{alias}.status = '{Turn.QUEUED}'"


def claim_turn(turn_id: str) -> ClaimedTurn | None:
    """queued -> running, at most once (where PostgreSQL's one-statement claim,
    queue.claim_next, is not available)."""
    started = timezone.now()
    now = connection.ops.adapt_datetimefield_value(started)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {T} SET status = %s, started_at = %s, heartbeat_at = %s "
            f"WHERE id = %s AND status = %s RETURNING {CLAIMED_COLUMNS}",
            [Turn.RUNNING, now, now, turn_id, Turn.QUEUED],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    found = claimed(row, started)
    found.session = session_for_turn(found.session_pk)
    return found


@dataclass(frozen=True)
class EndedTurn:
    others_waiting: bool  # as it ended, other turns were waiting for a worker slot
    message_seq: int  # the session's last message position before the turn's own


# A turn's ending and its session's (end_turn): each is completed by its `output_seq` and
# `message_seq`, its condition and, for the turn, _END_RETURNING.
_END = (
    f"UPDATE {T} SET status = %s, stop_reason = %s, cancelled = %s, error = %s, finished_at = %s, "
    f"prompt_tokens = %s, completion_tokens = %s, model_calls = %s, usage_estimated = %s, partial = '', "
)
_END_RETURNING = f"RETURNING EXISTS (SELECT 1 FROM {T} w WHERE {waiting('w')}) AS others_waiting"
_CLOSE = (
    f"UPDATE {S} SET pending_calls = %s, active_turn_id = NULL, prompt_tokens = prompt_tokens + %s, "
    f"completion_tokens = completion_tokens + %s, updated_at = %s, "
)
# The session's position, read under its lock by the statement's first part.
_BEFORE = "(SELECT message_seq FROM locked)"


def end_turn(
    turn_id: str,
    session_pk: int,
    *,
    messages: list[dict],
    stop_reason: str,
    cancelled: bool,
    error: str,
    prompt_tokens: int,
    completion_tokens: int,
    model_calls: int,
    pending_calls: list,
    usage_estimated: bool = False,
) -> EndedTurn | None:
    """running -> done, with the turn's output stored: `messages` appended to the session's
    history after its last position, its pending calls stored, its usage added, the active
    turn cleared. None, writing nothing, when it was no longer running (declared lost, or
    deleted with its session).

    Locks the session's row, then the turn's: the one lock order of every transaction on a
    session and its turns (docs/api.md, "Guarantees"), so a delete and a turn's end never
    wait for each other in a cycle. On PostgreSQL it is one statement, which commits on its
    own outside a transaction: data-modifying CTEs, the first locking the session's row and
    reading its position, each later one conditional on the turn's ending. The same
    statement says whether other turns wait for a worker slot (a hint for the worker thread
    that ran this one, sessions_app.engine.worker: no statement of its own). When the turn
    produced output, the position of its first message is its `output_seq`."""
    now = _now()
    end_params = [
        Turn.DONE,
        stop_reason,
        cancelled,
        error,
        now,
        prompt_tokens,
        completion_tokens,
        model_calls,
        usage_estimated,
    ]
    close_params = [_json_param(Session, "pending_calls", pending_calls), prompt_tokens, completion_tokens, now]
    # Positions from 1, each added to the session's last one once it is read under its lock.
    rows = _message_rows(session_pk, 1, messages, turn_id=turn_id)
    if connection.vendor != "postgresql" or len(rows) > INSERT_BATCH:  # SQLite: no writes in a WITH
        with transaction.atomic():
            before = lock_session_row(session_pk)
            if before is None:
                return None
            with connection.cursor() as cursor:
                cursor.execute(
                    f"{_END}output_seq = %s WHERE id = %s AND status = %s {_END_RETURNING}",
                    [*end_params, before + 1 if messages else 0, turn_id, Turn.RUNNING],
                )
                row = cursor.fetchone()
                if row is None:
                    return None
                cursor.execute(
                    f"{_CLOSE}message_seq = %s WHERE id = %s", [*close_params, before + len(messages), session_pk]
                )
            insert_message_rows([(pk, kind, seq + before, *rest) for pk, kind, seq, *rest in rows])
        return EndedTurn(bool(row[0]), before)
    sql = (
        f"WITH locked AS MATERIALIZED (SELECT message_seq FROM {S} WHERE id = %s FOR UPDATE), "
        f"ended AS ({_END}output_seq = CASE WHEN %s THEN {_BEFORE} + 1 ELSE 0 END "
        f"WHERE id = %s AND status = %s AND EXISTS (SELECT 1 FROM locked) {_END_RETURNING}, {_BEFORE} AS before_seq), "
        f"closed AS ({_CLOSE}message_seq = {_BEFORE} + %s WHERE id = %s AND EXISTS (SELECT 1 FROM ended))"
    )
    params = [session_pk, *end_params, bool(messages), turn_id, Turn.RUNNING, *close_params, len(messages), session_pk]
    if rows:
        rows_sql, rows_params = _message_insert(rows, when="EXISTS (SELECT 1 FROM ended)", after=_BEFORE)
        sql += f", added AS ({rows_sql})"
        params += rows_params
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} SELECT others_waiting, before_seq FROM ended", params)
        row = cursor.fetchone()
    return EndedTurn(bool(row[0]), row[1]) if row else None


def heartbeat(turn_ids: list[str], partials: dict[str, str]) -> None:
    """Mark running turns alive (one statement), and store the partial output of some."""
    if not turn_ids:
        return
    now = _now()
    with connection.cursor() as cursor:
        marks = ", ".join(["%s"] * len(turn_ids))
        cursor.execute(
            f"UPDATE {T} SET heartbeat_at = %s WHERE status = %s AND id IN ({marks})", [now, Turn.RUNNING, *turn_ids]
        )
        for turn_id, text in partials.items():
            cursor.execute(f"UPDATE {T} SET partial = %s WHERE id = %s AND status = %s", [text, turn_id, Turn.RUNNING])


def turn_output(turn_id: str, session_pk: int, output_seq: int) -> list[dict]:
    """The messages a finished turn added to full history, in order."""
    if not output_seq:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT data FROM {M} WHERE session_id = %s AND kind = %s AND turn_id = %s AND seq >= %s ORDER BY seq",
            [session_pk, Message.FULL, turn_id, output_seq],
        )
        return [json.loads(row[0]) for row in cursor.fetchall()]


# --- history ----------------------------------------------------------------------------------


def _message_rows(
    session_pk: int, first_seq: int, messages: list[dict], *, turn_id: str | None = None, compacted_from: int = 0
) -> list[tuple]:
    rows = []
    for offset, message in enumerate(messages):
        text, role, seq = dumps(message), message.get("role", ""), first_seq + offset
        rows.append((session_pk, Message.FULL, seq, role, text, turn_id))
        if offset >= compacted_from:
            rows.append((session_pk, Message.COMPACTED, seq, role, text, turn_id))
    return rows


def insert_messages(
    session_pk: int, first_seq: int, messages: list[dict], *, turn_id: str | None = None, compacted_from: int = 0
) -> list[int]:
    """Store messages at positions first_seq, first_seq + 1, ... in full history, and those
    from index `compacted_from` on in compacted history too. Returns their positions."""
    insert_message_rows(_message_rows(session_pk, first_seq, messages, turn_id=turn_id, compacted_from=compacted_from))
    return [first_seq + offset for offset in range(len(messages))]


def _message_insert(batch: list[tuple], *, when: str = "", after: str = "0") -> tuple[str, list]:
    """The INSERT of message rows, with its parameters; `when`: a condition the rows are
    inserted on, and `after`: SQL added to their positions (inside a statement whose other
    parts decide them)."""
    params = [value for row in batch for value in row]
    columns = f"INSERT INTO {M} (session_id, kind, seq, role, data, turn_id)"
    if not when:
        return f"{columns} VALUES {', '.join(['(%s, %s, %s, %s, %s, %s)'] * len(batch))}", params
    # Typed: a VALUES list under SELECT takes its types from its values, not from the columns.
    values = ", ".join(["(%s::bigint, %s::varchar, %s::bigint, %s::varchar, %s::text, %s::varchar)"] * len(batch))
    return (
        f"{columns} SELECT v.session_id, v.kind, v.seq + {after}, v.role, v.data, v.turn_id "
        f"FROM (VALUES {values}) AS v (session_id, kind, seq, role, data, turn_id) WHERE {when}"
    ), params


def insert_message_rows(rows: list[tuple]) -> None:
    """(session_id, kind, seq, role, data, turn_id) rows, in batches."""
    with connection.cursor() as cursor:
        for start in range(0, len(rows), INSERT_BATCH):
            cursor.execute(*_message_insert(rows[start : start + INSERT_BATCH]))


def compacted_history_after(
    session_pk: int, after_seq: int
) -> tuple[tuple[int, int] | None, tuple[int, int] | None, list[tuple[int, str, str | None, int]]]:
    """In one statement (one snapshot): the (seq, row id) of the session's first compacted row
    and of its last one at or before `after_seq` (what a kept copy of them checks, with two
    index probes however long the history: compaction deletes rows at the start and inserts
    any summary there with new ids; a lost turn's recovered output is replaced at the end with
    new ids), then the rows after `after_seq` as (seq, JSON text, turn id, row id), in order."""
    rows_of = f"FROM {M} WHERE session_id = %s AND kind = %s"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT 0, seq, id, NULL, NULL FROM (SELECT seq, id {rows_of} ORDER BY seq LIMIT 1) AS first_row "
            f"UNION ALL SELECT 1, seq, id, NULL, NULL FROM "
            f"(SELECT seq, id {rows_of} AND seq <= %s ORDER BY seq DESC LIMIT 1) AS last_row "
            f"UNION ALL SELECT 2, seq, id, data, turn_id {rows_of} AND seq > %s ORDER BY 1, 2",
            (session_pk, Message.COMPACTED) + (session_pk, Message.COMPACTED, after_seq) * 2,
        )
        rows = cursor.fetchall()
    first = last = None
    new = []
    for part, seq, row_id, data, turn in rows:
        if part == 0:
            first = (seq, row_id)
        elif part == 1:
            last = (seq, row_id)
        else:
            new.append((seq, data, turn, row_id))
    return first, last, new


def drop_compacted_before(session_pk: int, cutoff: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {M} WHERE session_id = %s AND kind = %s AND seq < %s",
            [session_pk, Message.COMPACTED, cutoff],
        )


# --- endings ----------------------------------------------------------------------------------
# How a turn ends on its stream and in its stored result: the `turn_stop` event (published
# once, rebuilt from the turn's row when its publication was lost and the stream is whole)
# and the `none`-mode body.


LOST_ERROR = "The worker running this turn stopped before finishing."


def _stored_stop(turn: Turn) -> tuple[str, dict]:
    meta: dict = {}
    if turn.cancelled:
        meta["cancelled"] = True
    if turn.error:
        meta["error"] = turn.error
    if turn.model_calls:
        meta["usage"] = {"promptTokens": turn.prompt_tokens, "completionTokens": turn.completion_tokens}
        if turn.usage_estimated:
            meta["usage"]["estimated"] = True
    return turn.stop_reason or "error", meta


def publish_stop_if_missing(turn_id: str) -> None:
    """A finished turn whose stream has events but no `turn_stop` (its publication failed:
    Redis was down or full) gets one built from its row, so followers end — only when the
    stream holds every event from the first and they fold into what history keeps. A
    `turn_stop` after a hole would tell its readers a wrong answer; without one a stream
    closes as interrupted and its reader goes to history."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return
    try:
        last = events.backend().last_sync(turn_id)
        if last is None or last[1].get("event") == "turn_stop":
            return
        streamed = events.backend().read_all_sync(turn_id)
    except OUTAGE_ERRORS:
        logger.warning("turn %s: its live events are unreadable; no turn_stop is rebuilt", turn_id, exc_info=True)
        return
    if not _tells_what_history_keeps(turn, streamed):
        logger.warning("turn %s: its live events miss part of its output; no turn_stop is rebuilt", turn_id)
        return
    stop_reason, meta = _stored_stop(turn)
    publish_stop(turn_id, stop_reason, meta, seq=streamed[-1][0] + 1)


def _tells_what_history_keeps(turn: Turn, streamed: list[tuple[int, dict]]) -> bool:
    """Every event from the first is there, and they fold into the turn's stored output."""
    if [seq for seq, _ in streamed] != list(range(1, len(streamed) + 1)):
        return False
    shown = [event for _, event in streamed if event.get("event") not in ("turn_start", "turn_stop")]
    return fold(shown) == turn_output(turn.id, turn.session_id, turn.output_seq)


def _block_events(block: dict, mode: str) -> list[dict]:
    kind = block.get("type")
    if kind in ("text", "thinking"):
        if mode == "delta":
            return [{"event": f"{kind}_delta", "delta": block[kind]}]
        return [{"event": kind, kind: block[kind]}]
    if kind == "tool_use":
        return [
            {"event": "tool_call", "toolCallId": block["toolCallId"], "name": block["name"], "input": block["input"]}
        ]
    raise ValueError(f"no event stands for a {kind!r} block")


def _blocks(message: dict) -> list[dict]:
    content = message.get("content")
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def _message_events(message: dict, mode: str, skip_blocks: int = 0) -> list[dict]:
    if message.get("role") == "tool":
        return [{"event": "tool_result", "toolCallId": message["toolCallId"], "content": message["content"]}]
    if message.get("role") != "assistant":
        raise ValueError("a turn's output holds assistant and tool messages only")
    return [event for block in _blocks(message)[skip_blocks:] for event in _block_events(block, mode)]


class FoldCursor:
    """Where a stream's reader stands in what its events fold into (aap.messages.fold), kept
    without their text: the messages it has whole, and the kind and length of each block of
    the one still open. A follower keeps one (not the events) to rebuild the rest of a turn
    whose live events were lost (`rebuilt_ending`)."""

    __slots__ = ("blocks", "closed", "last_delta")

    def __init__(self):
        self.closed = 0  # messages complete (an assistant message closed by a tool result, tool messages)
        self.blocks: list[list] | None = None  # [kind, length] per block of the open assistant message
        self.last_delta: str | None = None

    def feed(self, event: dict) -> None:
        name = event.get("event")
        if name in ("text_delta", "thinking_delta", "text", "thinking"):
            kind = "text" if name.startswith("text") else "thinking"
            piece = event.get("delta", "") if name.endswith("_delta") else event.get(kind, "")
            if self.blocks is None:
                self.blocks = []
            if name.endswith("_delta") and self.last_delta == kind and self.blocks and self.blocks[-1][0] == kind:
                self.blocks[-1][1] += len(piece)
            else:
                self.blocks.append([kind, len(piece)])
            self.last_delta = kind if name.endswith("_delta") else None
        elif name == "tool_call":
            if self.blocks is None:
                self.blocks = []
            self.blocks.append(["tool_use", 0])
            self.last_delta = None
        elif name == "tool_result":
            self.closed += 2 if self.blocks else 1
            self.blocks, self.last_delta = None, None


def _tail(cursor: FoldCursor, stored: list[dict], mode: str) -> list[dict]:
    """The events that take a reader at `cursor` to `stored` (ValueError when the stored
    messages do not have the shape the reader was shown)."""
    shown = cursor.closed + (1 if cursor.blocks else 0)
    if shown > len(stored):
        raise ValueError("the reader was shown more messages than history keeps")
    tail: list[dict] = []
    if cursor.blocks:
        message = stored[cursor.closed]
        target = _blocks(message)
        if message.get("role") != "assistant" or len(target) < len(cursor.blocks):
            raise ValueError("the message shown last is not the stored one")
        for (kind, length), block in zip(cursor.blocks, target):
            held = block.get(kind, "") if kind != "tool_use" else ""
            if block.get("type") != kind or len(held) < length:
                raise ValueError("a block shown is not the stored one")
        kind, length = cursor.blocks[-1]
        rest = target[len(cursor.blocks) - 1].get(kind, "") if kind != "tool_use" else ""
        if len(rest) > length:
            if mode != "delta" or cursor.last_delta != kind:
                raise ValueError("only a delta stream shows part of a block")
            tail.append({"event": f"{kind}_delta", "delta": rest[length:]})
        tail += _message_events(message, mode, skip_blocks=len(cursor.blocks))
    for message in stored[shown:]:
        tail += _message_events(message, mode)
    return tail


def rebuilt_ending(turn_id: str, cursor: FoldCursor, mode: str) -> list[dict] | None:
    """For a follower whose turn ended in PostgreSQL while its live events stopped short (lost
    with Redis): the rest of the turn, rebuilt from history, then its `turn_stop` rebuilt from
    the turn's row (stop reason, error, usage). `cursor`: where the events it sent, every one
    from the first, left its reader. None when the turn is not over, or the stored output does
    not have the shape the reader was shown: no ending that folds into history can be told."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return None
    stored = turn_output(turn.id, turn.session_id, turn.output_seq)
    try:
        tail = _tail(cursor, stored, mode)
    except (ValueError, KeyError, TypeError, AttributeError):
        logger.warning("turn %s: what its follower was sent is not the start of its history", turn_id)
        return None
    stop_reason, meta = _stored_stop(turn)
    stop: dict[str, Any] = {"event": "turn_stop", "stopReason": stop_reason}
    if meta:
        stop["_meta"] = meta
    return [*tail, stop]


def rebuilt_stream(turn_id: str, mode: str) -> list[dict] | None:
    """A finished turn's whole stream, rebuilt from history and its row, for a reader
    re-attaching from the start once its live events are gone (a Redis restart or flush):
    `turn_start`, the events that fold into what history keeps, `turn_stop`. None when the
    turn is not over."""
    ending = rebuilt_ending(turn_id, FoldCursor(), mode)
    if ending is None:
        return None
    return [{"event": "turn_start", "_meta": {"turnId": turn_id}}, *ending]


def publish_stop(turn_id: str, stop_reason: str, meta: dict, *, seq: int | None = None) -> None:
    backend = events.backend()
    event: dict[str, Any] = {"event": "turn_stop", "stopReason": stop_reason}
    if meta:
        event["_meta"] = meta
    try:
        # The last event: its publish also clears the turn's lease. Without `seq` (another
        # process ends the turn: a delete, a cancel) it goes after whatever the stream holds
        # when it is written, so an event the worker writes meanwhile cannot take its place.
        backend.publish_sync(turn_id, seq or 1, event, final=True)
    except Exception:  # the turn's ending stands in PostgreSQL whatever its live event does
        logger.warning("could not publish turn_stop of %s", turn_id, exc_info=True)
        try:
            backend.clear_lease_sync(turn_id)
        except Exception:  # the lease expires by itself
            logger.warning("could not clear the lease of %s", turn_id, exc_info=True)


def turn_result(turn_id: str) -> dict | None:
    """A finished turn's `stream: "none"` body, from PostgreSQL alone (None: not finished)."""
    turn = Turn.objects.filter(id=turn_id, status=Turn.DONE).first()
    if turn is None:
        return None
    stop_reason, meta = _stored_stop(turn)
    messages = turn_output(turn_id, turn.session_id, turn.output_seq)
    return {"stopReason": stop_reason, "messages": messages, "_meta": {"turnId": turn_id, **meta}}


# --- stored history ---------------------------------------------------------------------------
# A session's stored history: full and compacted copies, seeding, compaction, and the
# tool calls a seeded history leaves pending.


def append_messages(
    session: Session, messages: list[dict], *, turn: Turn | None = None, compacted_from: int = 0
) -> list[int]:
    """Append messages to a session's full history, and those from `compacted_from` on to
    its compacted history too (the caller saves session.message_seq)."""
    seqs = insert_messages(
        session.pk, session.message_seq + 1, messages, turn_id=turn.id if turn else None, compacted_from=compacted_from
    )
    session.message_seq += len(messages)
    return seqs


def compaction_rewrites(compaction, count: int) -> bool:
    """Whether `compaction` (a runtime's Compaction, or None) changes a compacted history of
    `count` messages."""
    return compaction is not None and (compaction.keep_last < count or bool(compaction.summary))


def apply_compaction(session_pk: int, message_seq: int, compacted: list[tuple[int, dict]], compaction) -> None:
    """Keep the last `keep_last` compacted messages (never opening on an orphaned tool
    result) behind an optional summary; `full` history is never touched."""
    if not compaction_rewrites(compaction, len(compacted)):
        return
    kept = compacted[-compaction.keep_last :] if compaction.keep_last > 0 else []
    while kept and kept[0][1].get("role") == "tool":
        kept = kept[1:]
    cutoff = kept[0][0] if kept else message_seq + 1
    drop_compacted_before(session_pk, cutoff)
    if compaction.summary:
        first = cutoff - len(compaction.summary)
        insert_message_rows(
            [
                (session_pk, Message.COMPACTED, first + i, m.get("role", ""), dumps(m), None)
                for i, m in enumerate(compaction.summary)
            ]
        )


def seed_compaction_start(agent: Agent, messages: list[dict]) -> int:
    """Where a seeded history's compacted copy starts: the runtime's window, if it has one,
    never opening on a tool result whose call was cut off."""
    window = runtime_for(agent.runtime_kind).seed_window(agent.runtime_config or {})
    if window is None or window >= len(messages):
        return 0
    start = len(messages) - window
    while start < len(messages) and messages[start].get("role") == "tool":
        start += 1
    return start


def pending_from_history(
    messages: list[dict], client_tools: list[dict] | None, server_refs: list[dict] | None
) -> list[dict]:
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
