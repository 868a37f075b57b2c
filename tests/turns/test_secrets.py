"""Secret options: "***" in every answer, ciphertext at rest, "***" on input keeps the stored
value, and never a plaintext in a response, history row, event or log line.

One test runs the service's secret-bearing paths and reads every line it logged meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid

import pytest

SECRET = f"sk-live-{uuid.uuid4().hex}"
ROTATED = f"sk-rotated-{uuid.uuid4().hex}"
SMALL_SECRET_DEFAULT = "sk-small-window-default"  # tests/agents.yaml


def fingerprint(secret: str) -> str:
    """What the echo runtime's /whoami prints for an apiKey."""
    return hashlib.sha256(secret.encode()).hexdigest()[:8]


def whoami(client, session: str, **body) -> str:
    result = client.turn(session, text="/whoami", **body)
    assert result.status == 200, result.body
    text = result.messages[-1]["content"][0]["text"]
    return text.rsplit("apiKey=", 1)[1]


def create(client, agent: str, options: dict) -> str:
    response = client.post("/v1/sessions", {"agent": {"name": agent, "options": options}})
    assert response.status_code == 201, response.text
    return response.json()["sessionId"]


def raw_session_options(public_id: str) -> str:
    """The options column as PostgreSQL stores it (no ORM decoding)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT options::text FROM sessions_app_session WHERE public_id = %s", [public_id])
        return cursor.fetchone()[0]


@pytest.fixture(scope="module")
def secret_session(engine):
    client = engine.client("demo")
    session = create(client, "echo", {"apiKey": SECRET, "signature": "sig"})
    client.close()
    return session


def test_get_and_list_show_secret_options_as_stars(demo, secret_session):
    info = demo.get(f"/v1/sessions/{secret_session}")
    assert info.json()["agent"]["options"] == {"apiKey": "***", "signature": "sig"}
    assert SECRET not in info.text
    listing = demo.get("/v1/sessions", params={"limit": 100})
    listed = [s for s in listing.json()["sessions"] if s["sessionId"] == secret_session]
    assert listed and listed[0]["agent"]["options"]["apiKey"] == "***"
    assert SECRET not in listing.text


def test_secret_option_is_ciphertext_at_rest(secret_session, db_access):
    from infra import crypto

    raw = raw_session_options(secret_session)
    assert SECRET not in raw
    assert SECRET[8:24] not in raw, "not even part of it"
    from sessions_app.models import Session

    stored = Session.objects.get(public_id=secret_session).options
    assert stored["signature"] == "sig", "text options stay readable"
    assert stored["apiKey"].startswith("gAAAAA"), "a Fernet token"
    assert crypto.decrypt(stored["apiKey"]) == SECRET


def test_the_agent_receives_the_plaintext_secret(demo, secret_session):
    assert whoami(demo, secret_session) == fingerprint(SECRET)


def test_stars_on_input_keep_the_stored_secret(demo, secret_session, db_access):
    before = raw_session_options(secret_session)
    assert whoami(demo, secret_session, agent={"options": {"apiKey": "***"}}) == fingerprint(SECRET)
    assert raw_session_options(secret_session) == before, "the stored ciphertext is untouched"
    assert demo.get(f"/v1/sessions/{secret_session}").json()["agent"]["options"]["apiKey"] == "***"


def test_a_new_secret_replaces_the_stored_one(demo, db_access):
    session = create(demo, "echo", {"apiKey": SECRET})
    assert whoami(demo, session, agent={"options": {"apiKey": ROTATED}}) == fingerprint(ROTATED)
    assert whoami(demo, session) == fingerprint(ROTATED), "options persist for the rest of the session"
    raw = raw_session_options(session)
    assert ROTATED not in raw and SECRET not in raw


def test_stars_at_creation_keep_the_agents_secret_default(demo):
    for options in ({"apiKey": "***"}, {}):
        session = create(demo, "echo-small", options)
        # The runtime has the operator's key, and says only that: no digest of it reaches a tenant.
        assert whoami(demo, session) == "default"
        assert "options" not in demo.get(f"/v1/sessions/{session}").json()["agent"], "nothing was set"
    session = create(demo, "echo", {"apiKey": "***"})
    assert whoami(demo, session) == "unset", "echo has no stored default"


def test_agent_secret_default_is_ciphertext_at_rest(engine, db_access):
    from django.db import connection

    from infra import crypto

    with connection.cursor() as cursor:
        cursor.execute(
            'SELECT o."default" FROM agents_agentoption o JOIN agents_agent a ON a.id = o.agent_id '
            "WHERE a.name = 'echo-small' AND o.name = 'apiKey'"
        )
        (stored,) = cursor.fetchone()
    assert SMALL_SECRET_DEFAULT not in stored
    assert crypto.decrypt(stored) == SMALL_SECRET_DEFAULT


def test_secrets_never_appear_in_history_or_events(demo, secret_session):
    stream = demo.turn(secret_session, text="/whoami", stream="delta")
    assert stream.status == 200 and SECRET.encode() not in stream.raw
    for kind in ("full", "compacted"):
        text = demo.get(f"/v1/sessions/{secret_session}/history", params={"type": kind}).text
        assert SECRET not in text and fingerprint(SECRET) in text


def test_refusals_never_echo_a_secret(demo, secret_session):
    bad_create = {"agent": {"name": "echo", "options": {"apiKey": SECRET, "style": "bold"}}}
    response = demo.post("/v1/sessions", bad_create)
    assert response.status_code == 400 and SECRET not in response.text
    bad_turn = {"agent": {"options": {"apiKey": SECRET, "nope": "x"}}, "messages": [{"role": "user", "content": "hi"}]}
    response = demo.post(f"/v1/sessions/{secret_session}/turns", bad_turn)
    assert response.status_code == 400 and SECRET not in response.text
    # The refused turn changed nothing.
    assert whoami(demo, secret_session) == fingerprint(SECRET)


def test_no_secret_reaches_any_log(demo, captured):
    """What the service logs, from its request and turn threads, while secrets pass through it:
    a session created with one, turns that use it (streamed, and one that fails), an
    operator's default, and refusals of requests that carried one."""
    secret = f"sk-live-{uuid.uuid4().hex}"
    session = create(demo, "echo", {"apiKey": secret})
    assert whoami(demo, session) == fingerprint(secret)
    assert demo.turn(session, text="/whoami", stream="delta").status == 200
    failed = demo.turn(session, text="/error", agent={"options": {"apiKey": secret}})
    assert failed.stop_reason == "error"
    small = create(demo, "echo-small", {})
    assert whoami(demo, small) == "default"
    assert demo.turn(small, text="/error").stop_reason == "error"
    refused = demo.post("/v1/sessions", {"agent": {"name": "echo", "options": {"apiKey": secret, "style": "x"}}})
    assert refused.status_code == 400
    bad_turn = {"agent": {"options": {"apiKey": secret, "nope": "x"}}, "messages": [{"role": "user", "content": "hi"}]}
    assert demo.post(f"/v1/sessions/{session}/turns", bad_turn).status_code == 400
    # Positive control: the failed turn's error line, written by a turn thread, was captured.
    deadline = time.monotonic() + 30
    while not any(line.get("turn") == failed.turn_id and line["level"] == "ERROR" for line in captured()):
        assert time.monotonic() < deadline, "the failed turn was never logged: nothing was captured"
        time.sleep(0.1)
    text = "\n".join(json.dumps(line) for line in captured())
    for used in (secret, SMALL_SECRET_DEFAULT):
        assert used not in text, f"{used[:10]}... appears in the log"
        assert used[8:24] not in text, "not even part of it"


def test_rotate_secrets_reencrypts_with_the_new_first_key_and_old_key_can_go(demo, db_access):
    """Key rotation: with a new key first, `rotate_secrets` re-encrypts stored secrets; the
    service then reads them with the new key alone, and the old key no longer can."""
    import os

    import pytest
    from cryptography.fernet import Fernet
    from django.conf import settings
    from django.core.management import call_command
    from django.test import override_settings

    from agents.models import AgentOption
    from infra.crypto import SecretDecryptionError
    from sessions_app.engine.worker import effective_options
    from sessions_app.models import Session

    session_id = demo.create_session("echo", agent={"options": {"apiKey": "sk-rotate-me"}})
    old_keys = list(settings.HOSTING_ENCRYPTION_KEYS)
    new_key = Fernet.generate_key().decode()
    # Runs inside the test's transaction: the live stack keeps its key once it rolls back.
    with override_settings(HOSTING_ENCRYPTION_KEYS=[new_key, *old_keys]):
        call_command("rotate_secrets", stdout=open(os.devnull, "w"))
    session = Session.objects.select_related("agent").get(public_id=session_id)
    stored = AgentOption.objects.get(agent__name="echo-small", name="apiKey")
    with override_settings(HOSTING_ENCRYPTION_KEYS=[new_key]):
        assert effective_options(session.agent, session.options)["apiKey"] == "sk-rotate-me"
        assert stored.default_value() == "sk-small-window-default"
    with override_settings(HOSTING_ENCRYPTION_KEYS=old_keys), pytest.raises(SecretDecryptionError):
        stored.default_value()
