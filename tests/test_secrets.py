"""Secret options: "***" in every answer, ciphertext at rest, "***" on input keeps the stored
value, and never a plaintext in a response, history row, event or log line.

The last test greps every log the stacks wrote during the run for the secrets used here, so
it runs after the tests above it (and after test_admin/test_commands, which sort earlier).
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

SECRET = f"sk-live-{uuid.uuid4().hex}"
ROTATED = f"sk-rotated-{uuid.uuid4().hex}"
SMALL_SECRET_DEFAULT = "sk-small-window-default"  # tests/agents.yaml
USED_SECRETS = [SECRET, ROTATED, SMALL_SECRET_DEFAULT]


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
def secret_session(pg_stack):
    client = pg_stack.client("demo")
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
    from hosting import crypto

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


def test_agent_secret_default_is_ciphertext_at_rest(pg_stack, db_access):
    from django.db import connection

    from hosting import crypto

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


def test_zz_no_secret_reaches_any_log(pg_stack, log_dir):
    logs = sorted(log_dir.glob("*.log"))
    assert any(path.name.startswith("pg-") for path in logs), f"no pg stack logs in {log_dir}"
    for path in logs:
        text = path.read_text(errors="replace")
        for secret in USED_SECRETS:
            assert secret not in text, f"{secret[:10]}... appears in {path.name}"


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
    from hosting.crypto import SecretDecryptionError
    from sessions_app.models import Session
    from sessions_app.services.validation import effective_options

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
    with override_settings(HOSTING_ENCRYPTION_KEYS=old_keys):
        with pytest.raises(SecretDecryptionError):
            stored.default_value()
