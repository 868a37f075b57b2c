"""Bearer-token authentication of the AAP API: every way a token can be wrong ends in a 401."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import httpx
import pytest

from ..support import committed


def manage(*args: str) -> str:
    """A management command, committed (test_commands.py also runs them as separate processes)."""
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    committed(lambda: call_command(*args, stdout=out))
    return out.getvalue()


def new_token(tenant: str, *extra: str) -> tuple[str, str]:
    """`create_token`: returns (raw token, visible prefix)."""
    out = manage("create_token", tenant, *extra)
    prefix = re.search(r"Created token (\S+) ", out).group(1)
    raw = out.strip().splitlines()[-1]
    assert raw.startswith(prefix)
    return raw, prefix


def call(engine, method: str, path: str, authorization: str | None, body=None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization is not None else {}
    return engine.request(method, path, headers=headers, json=body)


def assert_401(response: httpx.Response, what: str) -> None:
    assert response.status_code == 401, f"{what}: {response.status_code} {response.text}"
    assert response.headers.get("WWW-Authenticate", "").startswith("Bearer"), f"{what}: {response.headers}"
    assert response.headers["content-type"].startswith("application/json"), what
    assert response.json()["error"].strip(), what


@pytest.fixture(scope="module")
def demo_session(engine):
    client = engine.client("demo")
    session = client.create_session("echo", messages=[{"role": "user", "content": "kept"}])
    client.close()
    return session


def protected_requests(session: str) -> list[tuple[str, str, dict | None]]:
    return [
        ("GET", "/v1/sessions", None),
        ("POST", "/v1/sessions", {"agent": {"name": "echo"}}),
        ("GET", f"/v1/sessions/{session}", None),
        ("DELETE", f"/v1/sessions/{session}", None),
        ("GET", f"/v1/sessions/{session}/history?type=full", None),
        ("POST", f"/v1/sessions/{session}/turns", {"messages": [{"role": "user", "content": "hi"}]}),
        ("GET", f"/v1/sessions/{session}/turns/turn_x/events", None),
        ("POST", f"/v1/sessions/{session}/turns/turn_x/cancel", None),
    ]


UNKNOWN_TOKEN = "aap_00000000_" + "A" * 43
BAD_AUTHORIZATION = {
    "missing": None,
    "empty": "",
    "scheme only": "Bearer",
    "two tokens": f"Bearer {UNKNOWN_TOKEN} {UNKNOWN_TOKEN}",
    "basic scheme": "Basic ZGVtbzpkZW1v",
    "unknown token": f"Bearer {UNKNOWN_TOKEN}",
    "garbage token": "Bearer !!not-a-token!!",
}


@pytest.mark.parametrize("case", list(BAD_AUTHORIZATION))
def test_every_endpoint_refuses_a_request_without_a_valid_token(engine, demo_session, case):
    for method, path, body in protected_requests(demo_session):
        assert_401(call(engine, method, path, BAD_AUTHORIZATION[case], body), f"{case}: {method} {path}")
    # Nothing was deleted or created by the refused requests.
    client = engine.client("demo")
    assert client.history(demo_session) == [{"role": "user", "content": "kept"}]
    client.close()


def test_a_valid_token_without_the_bearer_scheme_is_refused(engine, demo_session):
    raw = engine.tokens["demo"]
    for authorization in (raw, f"Token {raw}", f"Bearer: {raw}"):
        assert_401(call(engine, "GET", f"/v1/sessions/{demo_session}", authorization), authorization[:12])
    response = call(engine, "GET", f"/v1/sessions/{demo_session}", f"bearer {raw}")
    assert response.status_code == 200, "the scheme name is case-insensitive (RFC 7235)"


def test_refusals_never_echo_the_token(engine):
    response = call(engine, "GET", "/v1/sessions", f"Bearer {UNKNOWN_TOKEN}")
    assert_401(response, "unknown token")
    assert UNKNOWN_TOKEN not in response.text


def test_meta_answers_without_a_token_but_refuses_a_bad_one(engine):
    assert call(engine, "GET", "/v1/meta", None).status_code == 200
    # ("Bearer" with no token is no token: see tests/e2e/test_interop.py.)
    for authorization in (f"Bearer {UNKNOWN_TOKEN}", "Basic ZGVtbzpkZW1v"):
        assert_401(call(engine, "GET", "/v1/meta", authorization), f"meta with {authorization!r}")


def test_revoked_token_is_refused(engine, demo_session, db_access):
    raw, prefix = new_token("demo", "--name", "to-revoke")
    assert call(engine, "GET", f"/v1/sessions/{demo_session}", f"Bearer {raw}").status_code == 200
    out = manage("revoke_token", prefix)
    assert prefix in out
    for method, path, body in protected_requests(demo_session):
        assert_401(call(engine, method, path, f"Bearer {raw}", body), f"revoked: {method} {path}")
    # Only that token: the tenant's other tokens still work.
    assert call(engine, "GET", f"/v1/sessions/{demo_session}", f"Bearer {engine.tokens['demo']}").status_code == 200


def test_expired_token_is_refused(engine, demo_session, db_access):
    from django.utils import timezone

    from tenancy.models import ApiToken

    raw, prefix = new_token("demo", "--expires-in-days", "1")
    expires_at = ApiToken.objects.get(prefix=prefix).expires_at
    assert expires_at is not None and timedelta(hours=23) < expires_at - timezone.now() <= timedelta(days=1)
    assert call(engine, "GET", "/v1/sessions", f"Bearer {raw}").status_code == 200

    committed(lambda: ApiToken.objects.filter(prefix=prefix).update(expires_at=timezone.now() - timedelta(seconds=1)))
    for method, path, body in protected_requests(demo_session):
        assert_401(call(engine, method, path, f"Bearer {raw}", body), f"expired: {method} {path}")


def test_token_of_a_deactivated_tenant_is_refused(engine, db_access):
    from tenancy.models import Tenant
    from tenancy.services import tenant_create

    name = f"t2-inactive-{uuid.uuid4().hex[:8]}"
    _, raw = committed(lambda: tenant_create(name=name))
    assert call(engine, "GET", "/v1/sessions", f"Bearer {raw}").status_code == 200
    committed(lambda: Tenant.objects.filter(name=name).update(is_active=False))
    assert_401(call(engine, "GET", "/v1/sessions", f"Bearer {raw}"), "inactive tenant")


def test_last_use_of_a_token_is_recorded(engine, db_access):
    from tenancy.models import ApiToken

    raw, prefix = new_token("demo")
    assert ApiToken.objects.get(prefix=prefix).last_used_at is None
    assert call(engine, "GET", "/v1/sessions", f"Bearer {raw}").status_code == 200
    assert ApiToken.objects.get(prefix=prefix).last_used_at is not None
