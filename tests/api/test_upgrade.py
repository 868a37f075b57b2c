"""A database of the previous release upgrades in place: migrated to that release's migrations
and holding its rows, it migrates to the latest, and the current code reads every row.

Tenants and tokens live in the `tenancy` package under the app label of the release before,
`hosting` (docs/adr/0005-tenancy-keeps-the-app-label-hosting.md): their tables, migration
records, content types and permissions stay as they are. The test owns its database: a
PostgreSQL database of its own, the default connection while the test runs."""

from __future__ import annotations

import hashlib
import json
import secrets

import pytest

# Every app's last migration at the previous release, the one before tenancy left the
# `hosting` package: the schema an upgrading database has.
PREVIOUS_RELEASE = [
    ("admin", "0003_logentry_add_action_flag_choices"),
    ("agents", "0004_mcptoollist"),
    ("auth", "0012_alter_user_first_name_max_length"),
    ("axes", "0010_accessattemptexpiration"),
    ("contenttypes", "0002_remove_content_type_name"),
    ("hosting", "0003_tenant_weight"),
    ("sessions", "0001_initial"),
    ("sessions_app", "0006_one_queue"),
]


@pytest.fixture
def own_database(django_db_blocker):
    """A new PostgreSQL database, empty, as the default connection until the test ends."""
    from django.contrib.contenttypes.models import ContentType
    from django.db import connections
    from django.db.utils import load_backend

    with django_db_blocker.unblock():
        suite = connections["default"]
        if suite.vendor != "postgresql":
            pytest.fail("the API tier runs on PostgreSQL: run it with 'make test-fast' or 'make test'")
        name = f"aap_upgrade_{secrets.token_hex(6)}"
        options = {key: value for key, value in suite.settings_dict["OPTIONS"].items() if key != "pool"}
        settings_dict = {**suite.settings_dict, "NAME": name, "ENGINE": "django.db.backends.postgresql"}
        settings_dict["OPTIONS"] = options
        own = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, alias="default")
        with own._nodb_cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        connections["default"] = own
        ContentType.objects.clear_cache()  # its cache is per alias: ids of this database only
        try:
            yield own
        finally:
            connections["default"] = suite
            ContentType.objects.clear_cache()
            own.close()
            with own._nodb_cursor() as cursor:
                cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_database_of_the_previous_release_migrates_and_the_current_code_reads_it(own_database):
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management import call_command
    from django.core.management.sql import emit_post_migrate_signal
    from django.db.migrations.executor import MigrationExecutor
    from django.db.migrations.recorder import MigrationRecorder
    from django.test import RequestFactory

    from agents.models import Agent
    from sessions_app.models import Session
    from tenancy import authentication
    from tenancy.models import ApiToken, Tenant

    # The previous release's schema, and what its `migrate` added after the migrations.
    executor = MigrationExecutor(own_database)
    executor.migrate(PREVIOUS_RELEASE)
    before = executor.loader.project_state(PREVIOUS_RELEASE).apps
    emit_post_migrate_signal(0, False, "default", apps=before, plan=[])

    # Its rows, written with its models.
    tenant = before.get_model("hosting", "Tenant").objects.create(name="kept", title="Kept", max_sessions=7, weight=3)
    raw = "aap_0a1b2c3d_" + secrets.token_urlsafe(32)
    before.get_model("hosting", "ApiToken").objects.create(
        tenant=tenant, name="ci", prefix="aap_0a1b2c3d", token_hash=hashlib.sha256(raw.encode()).hexdigest()
    )
    agent = before.get_model("agents", "Agent").objects.create(name="kept-agent", runtime_kind="echo")
    agent.tenants.add(tenant)
    session = before.get_model("sessions_app", "Session").objects.create(
        tenant=tenant, agent=agent, options={"style": "loud"}, message_seq=1
    )
    said = json.dumps({"role": "user", "content": "kept across the upgrade"})
    before.get_model("sessions_app", "Message").objects.create(
        session=session, kind="full", seq=1, role="user", data=said
    )
    tenant_type = before.get_model("contenttypes", "ContentType").objects.get(app_label="hosting", model="tenant")

    # The upgrade, as an operator runs it.
    call_command("migrate", interactive=False, verbosity=0)

    applied = MigrationRecorder(own_database).applied_migrations()
    assert set(PREVIOUS_RELEASE) <= set(applied)
    assert not {app for app, _ in applied} & {"tenancy", "infra"}, "migrations were recorded under a new label"
    assert MigrationExecutor(own_database).migration_plan(executor.loader.graph.leaf_nodes()) == []

    # The current code reads what the previous release wrote.
    kept = Tenant.objects.get(name="kept")
    assert (kept.title, kept.max_sessions, kept.weight) == ("Kept", 7, 3)
    request = RequestFactory().get("/v1/meta", HTTP_AUTHORIZATION=f"Bearer {raw}")
    try:
        user, token = authentication.BearerTokenAuthentication().authenticate(request)
    finally:
        authentication._cache.pop(hashlib.sha256(raw.encode()).hexdigest(), None)
    assert user.tenant.name == "kept" and token.pk == ApiToken.objects.get(prefix="aap_0a1b2c3d").pk
    assert list(Agent.objects.for_tenant(kept).values_list("name", flat=True)) == ["kept-agent"]
    stored = Session.objects.select_related("tenant", "agent").get(public_id=session.public_id)
    assert (stored.tenant, stored.agent.name, stored.options) == (kept, "kept-agent", {"style": "loud"})
    assert [message.data for message in stored.messages.all()] == [said]

    # The admin's content types and permissions are the same rows, none made again.
    assert ContentType.objects.get_for_model(Tenant).pk == tenant_type.pk
    assert not ContentType.objects.filter(app_label__in=["tenancy", "infra"]).exists()
    assert Permission.objects.filter(content_type=tenant_type.pk, codename="change_tenant").count() == 1
