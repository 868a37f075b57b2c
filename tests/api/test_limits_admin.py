"""Operators set a tenant's limits in Django admin; the admin login locks out after
repeated wrong passwords (django-axes). In-process, inside the test's transaction."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_tenant_limits_are_edited_in_admin(admin_client):
    from infra.limits import limits_for
    from tenancy.models import Tenant

    tenant = Tenant.objects.create(name="admin-limits")
    page = admin_client.get(f"/admin/hosting/tenant/{tenant.pk}/change/").content.decode()
    assert "Limits" in page and "max_running_turns" in page and "tokens_per_day" in page
    form = {
        "name": "admin-limits",
        "title": "",
        "is_active": "on",
        "max_running_turns": "3",
        "max_queued_turns": "",
        "turns_per_minute": "0",
        "max_sessions": "10",
        "tokens_per_day": "50000",
        "weight": "3",
        "tokens-TOTAL_FORMS": "0",
        "tokens-INITIAL_FORMS": "0",
        "tokens-MIN_NUM_FORMS": "0",
        "tokens-MAX_NUM_FORMS": "1000",
        "_save": "Save",
    }
    response = admin_client.post(f"/admin/hosting/tenant/{tenant.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    tenant.refresh_from_db()
    limits = limits_for(tenant)
    assert (limits.max_running_turns, limits.turns_per_minute, limits.max_sessions, limits.tokens_per_day) == (
        3,
        0,
        10,
        50000,
    )
    assert tenant.max_queued_turns is None  # empty: the service's default
    assert tenant.weight == 3 and "Scheduling" in page

    form["max_running_turns"] = "-1"
    refused = admin_client.post(f"/admin/hosting/tenant/{tenant.pk}/change/", form)
    assert refused.status_code == 200 and "greater than or equal to 0" in refused.content.decode()


def test_admin_login_locks_out_after_repeated_wrong_passwords(client, django_user_model, settings):
    django_user_model.objects.create_superuser("ops", "ops@example.com", "right-password")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        wrong = client.post("/admin/login/", {"username": "ops", "password": "wrong"})
        assert wrong.status_code == 200  # the login form again, with its error
    locked = client.post("/admin/login/", {"username": "ops", "password": "wrong"})
    assert locked.status_code == 429
    # Locked out: even the right password is refused now, without logging in.
    again = client.post("/admin/login/", {"username": "ops", "password": "right-password"})
    assert again.status_code == 429
    assert "_auth_user_id" not in client.session
