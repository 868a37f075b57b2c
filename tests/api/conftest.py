"""The API tier: requests through the whole Django stack (middleware, authentication, DRF
views, services, PostgreSQL) in this process, with Django's test client. No server process
and no worker: what these tests cover ends before a turn is handed to a worker."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client


class Api:
    """A tenant's view of the API: JSON in, Django test responses out."""

    def __init__(self, client: Client, token: str | None):
        self.client = client
        self.headers = {"HTTP_HOST": "127.0.0.1"}
        if token is not None:
            self.headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"

    def get(self, path: str, **headers: str):
        return self.client.get(path, **self.headers, **headers)

    def delete(self, path: str, **headers: str):
        return self.client.delete(path, **self.headers, **headers)

    def post(self, path: str, body: Any = None, *, raw: bytes | None = None, **headers: str):
        data = raw if raw is not None else json.dumps({} if body is None else body)
        return self.client.post(path, data=data, content_type="application/json", **self.headers, **headers)

    def put(self, path: str, body: Any = None, **headers: str):
        return self.client.put(
            path, data=json.dumps(body or {}), content_type="application/json", **self.headers, **headers
        )

    def create_session(self, body: Any = None) -> str:
        response = self.post("/v1/sessions", body or {"agent": {"name": "echo"}})
        assert response.status_code == 201, response.content
        return response.json()["sessionId"]


@pytest.fixture(autouse=True)
def _no_rate_limits(settings):
    # These tables send many refused requests from one address in a second.
    settings.AAP_AUTH_FAILURES_PER_MINUTE = 0
    settings.AAP_TENANT_TURNS_PER_MINUTE = 0


API_TENANT = "api-tier"


@pytest.fixture
def token(db) -> str:
    from agents.services import ECHO_AGENT, agents_apply
    from tenancy.services import tenant_create

    agents_apply([ECHO_AGENT])
    _, raw = tenant_create(name=API_TENANT)
    return raw


def own_sessions():
    """The sessions of the tenant of `token`: other tiers may have committed sessions of
    their own tenants to the test database before."""
    from sessions_app.models import Session

    return Session.objects.filter(tenant__name=API_TENANT)


def own_turns():
    from sessions_app.models import Turn

    return Turn.objects.filter(session__tenant__name=API_TENANT)


@pytest.fixture
def api(token) -> Api:
    return Api(Client(), token)


@pytest.fixture
def anonymous(db) -> Api:
    return Api(Client(), None)


def assert_refusal(response, status: int) -> str:
    """A JSON error body with one sentence, and the status code wanted."""
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) <= {"error", "details"}
    assert isinstance(body["error"], str) and body["error"].endswith((".", ")")), body
    return body["error"]


@pytest.fixture(autouse=True)
def _no_auth_cache(settings):
    """Tests revoke tokens and expect the next request to see it at once (the cache and its
    bound have their own test, tests/api/test_auth_cache.py)."""
    settings.AAP_AUTH_CACHE_SECONDS = 0
