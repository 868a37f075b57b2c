"""A session's stored history: full and compacted copies, seeding, compaction, and the
tool calls a seeded history leaves pending."""

from __future__ import annotations

from agents.models import Agent
from agents.runtimes import runtime_for

from ..models import Message, Session, Turn
from ..protocol import dumps, tool_uses
from . import turn_store


def append_messages(
    session: Session, messages: list[dict], *, turn: Turn | None = None, compacted_from: int = 0
) -> list[int]:
    """Append messages to a session's full history, and those from `compacted_from` on to
    its compacted history too (the caller saves session.message_seq)."""
    seqs = turn_store.insert_messages(
        session.pk, session.message_seq + 1, messages, turn_id=turn.id if turn else None, compacted_from=compacted_from
    )
    session.message_seq += len(messages)
    return seqs


def apply_compaction(session_pk: int, message_seq: int, compacted: list[tuple[int, dict]], compaction) -> None:
    """Keep the last `keep_last` compacted messages (never opening on an orphaned tool
    result) behind an optional summary; `full` history is never touched."""
    if compaction is None or (compaction.keep_last >= len(compacted) and not compaction.summary):
        return
    kept = compacted[-compaction.keep_last :] if compaction.keep_last > 0 else []
    while kept and kept[0][1].get("role") == "tool":
        kept = kept[1:]
    cutoff = kept[0][0] if kept else message_seq + 1
    turn_store.drop_compacted_before(session_pk, cutoff)
    if compaction.summary:
        first = cutoff - len(compaction.summary)
        turn_store.insert_message_rows(
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
