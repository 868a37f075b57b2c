"""What a turn's `agent` and `tools` change persists for the rest of the session; secrets
stay secret and survive a `***` round trip; in process, turns run by the embedded engine."""

from __future__ import annotations

import hashlib

from ..turn_checks import CLIENT_TOOL, checked_turn, new_session, text_reply, user

SECRET = "sk-live-a1b2c3d4e5"


def fingerprint(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:8]


def session_info(demo, session: str) -> dict:
    response = demo.get(f"/v1/sessions/{session}")
    assert response.status_code == 200, response.text
    assert SECRET not in response.text
    return response.json()


def test_option_overrides_in_a_turn_persist(demo):
    session = new_session(demo, options={"signature": "first"})
    result = checked_turn(
        demo,
        session,
        user("hi"),
        stream="delta",
        agent={"options": {"style": "upper", "signature": "Sig", "apiKey": SECRET}},
    )
    assert result.messages == text_reply("echo: HI -- Sig")
    assert SECRET.encode() not in result.raw
    assert session_info(demo, session)["agent"] == {
        "name": "echo",
        "options": {"style": "upper", "signature": "Sig", "apiKey": "***"},
    }
    # later turns keep them without repeating them; a turn's options merge by key
    assert checked_turn(demo, session, user("again")).messages == text_reply("echo: AGAIN -- Sig")
    checked_turn(demo, session, user("x"), agent={"options": {"signature": "New"}})
    assert session_info(demo, session)["agent"]["options"] == {"style": "upper", "signature": "New", "apiKey": "***"}
    whoami = checked_turn(demo, session, user("/whoami"), stream="message")
    assert whoami.messages == text_reply(f"style=upper signature=New apiKey={fingerprint(SECRET)}")
    for kind in ("full", "compacted"):
        assert SECRET not in str(demo.history(session, kind))


def test_redacted_secret_sent_back_keeps_the_stored_value(demo):
    session = new_session(demo, options={"apiKey": SECRET, "style": "upper"})
    # an application echoes what GET gave it, placeholder included, and changes one option
    options = session_info(demo, session)["agent"]["options"]
    assert options == {"apiKey": "***", "style": "upper"}
    result = checked_turn(
        demo, session, user("/whoami"), stream="delta", agent={"options": {**options, "signature": "kept"}}
    )
    assert result.messages == text_reply(f"style=upper signature=kept apiKey={fingerprint(SECRET)}")
    assert session_info(demo, session)["agent"]["options"] == {"apiKey": "***", "style": "upper", "signature": "kept"}
    # a new value replaces it
    checked_turn(demo, session, user("rotate"), agent={"options": {"apiKey": "sk-rotated"}})
    assert checked_turn(demo, session, user("/whoami")).messages == text_reply(
        f"style=upper signature=kept apiKey={fingerprint('sk-rotated')}"
    )


def test_redacted_placeholder_without_a_stored_value_keeps_the_operator_default(demo):
    session = new_session(demo, "echo-small", options={"apiKey": "***"})
    # The operator's default is in use; nothing derived from it is shown to the tenant.
    assert checked_turn(demo, session, user("/whoami")).messages == text_reply("style= signature= apiKey=default")
    plain = new_session(demo, "echo")
    assert checked_turn(demo, plain, user("/whoami"), agent={"options": {"apiKey": "***"}}).messages == text_reply(
        "style=plain signature= apiKey=unset"
    )


def test_tools_set_in_a_turn_persist(demo):
    session = new_session(demo)
    checked_turn(
        demo, session, user("configure"), agent={"tools": [{"name": "add", "trust": True}]}, tools=[CLIENT_TOOL]
    )
    info = session_info(demo, session)
    assert info["agent"]["tools"] == [{"name": "add", "trust": True}]
    assert info["tools"] == [CLIENT_TOOL]
    # the trusted server tool runs inline and the client tool is the application's, with no repetition
    inline = checked_turn(demo, session, user('/tool add {"a": 1, "b": 1}'))
    assert inline.messages[-1] == text_reply("tool add returned: 2")[0]
    asked = checked_turn(demo, session, user('/tool mytool {"x": 3}'))
    assert asked.stop_reason == "tool_use"
    [use] = asked.tool_calls()
    answer = [{"role": "tool", "toolCallId": use["toolCallId"], "content": "three"}]
    assert checked_turn(demo, session, answer).messages == text_reply("tool mytool returned: three")
    # replacing the server tools with an empty list disables them
    checked_turn(demo, session, user("off"), agent={"tools": []})
    off = checked_turn(demo, session, user('/tool add {"a": 1, "b": 1}'))
    assert off.messages[-1] == text_reply("tool add returned: Unknown tool: add")[0]


def test_bad_overrides_are_refused_and_change_nothing(demo):
    session = new_session(demo, options={"style": "upper"})
    for body, words in [
        ({"options": {"nope": "x"}}, "nope"),
        ({"options": {"style": "loud"}}, "style"),
        ({"name": "echo-small"}, "echo"),
        ({"tools": [{"name": "not-a-tool"}]}, "not-a-tool"),
    ]:
        refused = demo.turn(session, text="hi", agent=body)
        assert refused.status == 400, (body, refused.raw)
        assert words in refused.body["error"]
    assert demo.history(session) == []
    assert session_info(demo, session)["agent"] == {"name": "echo", "options": {"style": "upper"}}
    assert checked_turn(demo, session, user("ok")).messages == text_reply("echo: OK")


def test_secret_is_stored_encrypted(demo, db_access):
    from sessions_app.models import Session

    session = new_session(demo, options={"apiKey": SECRET})
    checked_turn(demo, session, user("/whoami"), agent={"options": {"apiKey": "***"}})
    stored = Session.objects.get(public_id=session).options["apiKey"]
    assert stored and SECRET not in stored
