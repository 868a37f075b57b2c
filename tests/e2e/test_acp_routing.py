"""A permission answer reaches the ACP prompt waiting for it when several Celery worker
processes serve turns: the answering turn is routed to the worker that holds the prompt."""

from __future__ import annotations

import os
import signal

import redis

from ..turn_checks import checked_turn, text_reply, user, wait_until
from .test_acp_agent import answer, client, pg, session_of, workspace  # noqa: F401 (fixtures)


def test_a_permission_answer_is_routed_to_the_worker_holding_the_prompt(pg, client):  # noqa: F811
    from hosting.celery import app

    extra = pg.start_extra_worker("celery-extra")
    store = redis.Redis.from_url(pg.env["REDIS_URL"], decode_responses=True)
    holder = None
    try:
        session = session_of(client, tools=[{"name": "edit"}])
        first = checked_turn(client, session, user("/write routed.txt held"), stream="delta")
        assert first.stop_reason == "tool_use"
        [call] = first.tool_calls()
        holder = store.get(f"aap:acp:holder:{session}")
        assert holder, "the worker holding the prompt names itself"
        # From now on the holder takes no turn from the shared queue: only routing reaches it.
        replies = app.control.cancel_consumer("aap-turns", destination=[holder], reply=True, timeout=10)
        assert replies, "the holding worker answers remote control"

        second = answer(client, session, call["toolCallId"], True, stream="delta")
        assert second.stop_reason == "end_turn"
        assert second.messages == [
            {"role": "tool", "toolCallId": call["toolCallId"], "content": "wrote routed.txt"},
            *text_reply("wrote routed.txt"),
        ]
        assert (workspace(pg, session) / "routed.txt").read_text() == "held"
        wait_until(lambda: store.get(f"aap:acp:holder:{session}") is None, timeout=30, message="the hold to end")
        # A user turn is not pinned: the other worker takes it (with an agent process of its own).
        assert checked_turn(client, session, user("elsewhere")).messages == text_reply("echo: elsewhere")
    finally:
        if holder:
            app.control.add_consumer("aap-turns", destination=[holder], reply=True, timeout=10)
        os.killpg(extra.pid, signal.SIGTERM)
        extra.wait(30)
