"""A token found active is remembered for AAP_AUTH_CACHE_SECONDS: within that bound a request
needs no SQL to authenticate, and a revocation (or a disabled tenant) is refused once the
bound has passed. An expiry date is checked on every request; unknown tokens are never cached."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils import timezone

from tenancy import authentication
from tenancy.authentication import tenant_for_raw_token
from tenancy.models import ApiToken, Tenant

pytestmark = pytest.mark.django_db

BOUND = 0.5


@pytest.fixture
def token():
    authentication._cache.clear()
    tenant = Tenant.objects.create(name=f"cache-{time.monotonic_ns()}")
    raw, prefix, hashed = ApiToken.generate()
    row = ApiToken.objects.create(tenant=tenant, prefix=prefix, token_hash=hashed)
    yield raw, row
    authentication._cache.clear()


def statements(raw: str):
    with CaptureQueriesContext(connection) as queries:
        found = tenant_for_raw_token(raw)
    return found, len(queries)


@override_settings(AAP_AUTH_CACHE_SECONDS=BOUND)
def test_a_cached_token_needs_no_statement_and_a_revocation_is_refused_within_the_bound(token):
    raw, row = token
    found, count = statements(raw)
    assert found.pk == row.pk and count >= 1
    found, count = statements(raw)
    assert found.pk == row.pk and found.tenant.name == row.tenant.name and count == 0
    ApiToken.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    revoked_at = time.monotonic()
    while tenant_for_raw_token(raw) is not None:
        assert time.monotonic() - revoked_at <= BOUND + 0.2, "the revocation was not seen within the bound"
        time.sleep(0.05)
    assert tenant_for_raw_token(raw) is None  # and it stays refused


@override_settings(AAP_AUTH_CACHE_SECONDS=BOUND)
def test_a_disabled_tenant_is_refused_within_the_bound(token):
    raw, row = token
    assert tenant_for_raw_token(raw) is not None
    Tenant.objects.filter(pk=row.tenant_id).update(is_active=False)
    time.sleep(BOUND + 0.05)
    assert tenant_for_raw_token(raw) is None


@override_settings(AAP_AUTH_CACHE_SECONDS=60)
def test_an_expiry_date_is_checked_on_every_request_even_when_cached(token):
    raw, row = token
    ApiToken.objects.filter(pk=row.pk).update(expires_at=timezone.now() + timedelta(seconds=1))
    assert tenant_for_raw_token(raw) is not None
    time.sleep(1.1)
    assert tenant_for_raw_token(raw) is None


@override_settings(AAP_AUTH_CACHE_SECONDS=60)
def test_each_request_gets_its_own_instances(token):
    raw, _ = token
    first, second = tenant_for_raw_token(raw), tenant_for_raw_token(raw)
    assert first is not second and first.tenant is not second.tenant
    first.tenant._aap_rate_state = "mine"
    assert not hasattr(second.tenant, "_aap_rate_state")


@override_settings(AAP_AUTH_CACHE_SECONDS=0)
def test_with_no_cache_every_request_reads_the_token(token):
    raw, _ = token
    tenant_for_raw_token(raw)
    assert statements(raw)[1] >= 1
    assert not authentication._cache
