"""An operator's change to an agent reaches running web and worker processes at the next
turn: they cache agent definitions, and a change to the agent, its options or its tools
invalidates every process's copy."""

from __future__ import annotations

import json

from ..turn_checks import checked_turn, new_session, text_reply, user


def apply(stack, tmp_path, *, signature: str, enabled: bool = True) -> None:
    agent = {
        "name": "echo-live",
        "title": "Changed while the service runs",
        "version": "1.0.0",
        "runtime": {"kind": "echo"},
        "enabled": enabled,
        "options": [{"type": "text", "name": "signature", "default": signature}],
        "capabilities": {"application": {"tools": {}}},
    }
    path = tmp_path / f"agents-{signature}-{enabled}.json"
    path.write_text(json.dumps({"agents": [agent]}))
    stack.manage("apply_agents", str(path))


def test_a_changed_option_default_and_a_disabled_agent_reach_the_next_turn(pg_stack, demo, tmp_path):
    apply(pg_stack, tmp_path, signature="v1")
    session = new_session(demo, "echo-live")
    # Several turns, so each Celery worker and the web process have cached the definition.
    for _ in range(4):
        assert checked_turn(demo, session, user("hi")).messages == text_reply("echo: hi -- v1")

    apply(pg_stack, tmp_path, signature="v2")  # an option's default changes
    for _ in range(4):
        assert checked_turn(demo, session, user("hi")).messages == text_reply("echo: hi -- v2")

    apply(pg_stack, tmp_path, signature="v2", enabled=False)  # and disables the agent
    result = demo.turn(session, user("hi"))
    assert result.status == 400
    assert "disabled" in result.body["error"]
