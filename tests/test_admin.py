"""Django admin, in-process (pytest-django's admin_client, inside the test's transaction):
secrets are write-only, API tokens are shown once and stored hashed, the lists render."""

from __future__ import annotations

import hashlib
import re
import uuid

import pytest

SMALL_SECRET_DEFAULT = "sk-small-window-default"  # tests/agents.yaml
ADMIN_SECRET = f"sk-admin-{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def seeded(pg_stack, settings):
    """The seeded tenants and agents (committed by the stack fixture); a fast hasher for admin_user."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def form_errors(response) -> str:
    context = response.context or {}
    parts = []
    if "adminform" in context:
        parts.append(str(context["adminform"].form.errors))
    for formset in context.get("inline_admin_formsets", []):
        parts.append(str(formset.formset.errors) + str(formset.formset.non_form_errors()))
    return " ".join(parts) or response.content.decode()[:2000]


def agent_form(name: str, *, option: dict, option_pk: int | None = None, agent_pk: int | None = None) -> dict:
    data = {
        "name": name, "title": "Admin-made", "version": "1.0.0", "description": "", "enabled": "on",
        "runtime_kind": "echo", "runtime_config": "{}", "client_tools": "on",
        "options-TOTAL_FORMS": "1", "options-INITIAL_FORMS": "1" if option_pk else "0",
        "options-MIN_NUM_FORMS": "0", "options-MAX_NUM_FORMS": "1000",
        "server_tools-TOTAL_FORMS": "0", "server_tools-INITIAL_FORMS": "0",
        "server_tools-MIN_NUM_FORMS": "0", "server_tools-MAX_NUM_FORMS": "1000",
        "_save": "Save",
    }
    fields = {"name": "apiKey", "type": "secret", "title": "", "description": "", "choices": "[]", "default": "", "position": "0"}
    fields.update(option)
    if option_pk:
        fields.update(id=str(option_pk), agent=str(agent_pk))
    data.update({f"options-0-{key}": value for key, value in fields.items()})
    return data


def test_agent_change_page_never_shows_a_stored_secret_default(admin_client, db_access):
    from agents.models import Agent, AgentOption

    agent = Agent.objects.get(name="echo-small")
    stored = AgentOption.objects.get(agent=agent, name="apiKey").default
    response = admin_client.get(f"/admin/agents/agent/{agent.pk}/change/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "echo-small" in html
    assert SMALL_SECRET_DEFAULT not in html
    assert stored not in html and stored[:16] not in html, "not even the ciphertext"
    assert "*** stored" in html, "the form says a secret is stored without showing it"


def test_a_secret_default_entered_in_admin_is_encrypted_and_write_only(admin_client, db_access):
    from agents.models import Agent, AgentOption
    from hosting import crypto

    name = f"t2-admin-{uuid.uuid4().hex[:6]}"
    response = admin_client.post("/admin/agents/agent/add/", agent_form(name, option={"default": ADMIN_SECRET}))
    assert response.status_code == 302, form_errors(response)
    agent = Agent.objects.get(name=name)
    option = AgentOption.objects.get(agent=agent, name="apiKey")
    assert ADMIN_SECRET not in option.default and crypto.decrypt(option.default) == ADMIN_SECRET

    page = admin_client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert ADMIN_SECRET not in page and option.default not in page

    # Saving the form with the secret left blank keeps it; "***" too; "clear secret" removes it.
    for kept in ("", "***"):
        data = agent_form(name, option={"default": kept}, option_pk=option.pk, agent_pk=agent.pk)
        response = admin_client.post(f"/admin/agents/agent/{agent.pk}/change/", data)
        assert response.status_code == 302, form_errors(response)
        assert crypto.decrypt(AgentOption.objects.get(pk=option.pk).default) == ADMIN_SECRET
    data = agent_form(name, option={"clear_secret": "on"}, option_pk=option.pk, agent_pk=agent.pk)
    assert admin_client.post(f"/admin/agents/agent/{agent.pk}/change/", data).status_code == 302
    assert AgentOption.objects.get(pk=option.pk).default == ""


def test_an_invalid_tool_schema_is_refused_by_the_agent_form(admin_client, db_access):
    from agents.models import Agent

    name = f"t2-admin-{uuid.uuid4().hex[:6]}"
    data = agent_form(name, option={"type": "text", "name": "note"})
    data.update({
        "server_tools-TOTAL_FORMS": "1", "server_tools-0-name": "clock", "server_tools-0-title": "",
        "server_tools-0-description": "Time.", "server_tools-0-implementation": "clock",
        "server_tools-0-parameters": '{"type": "nonsense"}', "server_tools-0-settings": "{}",
        "server_tools-0-enabled": "on", "server_tools-0-position": "0",
    })
    response = admin_client.post("/admin/agents/agent/add/", data)
    assert response.status_code == 200
    assert "not a valid JSON Schema" in response.content.decode()
    assert not Agent.objects.filter(name=name).exists()


def test_an_api_token_added_in_admin_is_shown_once_and_stored_as_a_hash(admin_client, db_access):
    from hosting.authentication import tenant_for_raw_token
    from hosting.models import ApiToken, Tenant

    demo = Tenant.objects.get(name="demo")
    data = {"tenant": str(demo.pk), "name": "from-admin", "expires_at_0": "", "expires_at_1": "", "_save": "Save"}
    response = admin_client.post("/admin/hosting/apitoken/add/", data, follow=True)
    assert response.status_code == 200
    shown = [str(message) for message in response.context["messages"]]
    raws = [m.group(0) for text in shown for m in [re.search(r"aap_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}", text)] if m]
    assert len(raws) == 1, shown
    raw = raws[0]

    token = ApiToken.objects.get(name="from-admin", tenant=demo)
    assert token.token_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert raw.startswith(token.prefix)
    stored = [str(value) for value in ApiToken.objects.filter(pk=token.pk).values().get().values()]
    assert not any(raw in value for value in stored), "the token itself is not stored"
    assert tenant_for_raw_token(raw).pk == token.pk, "the shown token authenticates"

    for page in (f"/admin/hosting/apitoken/{token.pk}/change/", "/admin/hosting/apitoken/",
                 f"/admin/hosting/tenant/{demo.pk}/change/"):
        html = admin_client.get(page).content.decode()
        assert token.prefix in html, page
        assert raw not in html and token.token_hash not in html, f"{page} shows the token again"


def test_tenant_admin_lists_the_tenants(admin_client, db_access):
    response = admin_client.get("/admin/hosting/tenant/")
    assert response.status_code == 200
    html = response.content.decode()
    assert ">demo<" in html and ">other<" in html


def test_agent_admin_lists_agents_and_who_may_use_them(admin_client, db_access):
    response = admin_client.get("/admin/agents/agent/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "echo-private" in html and "echo-off" in html
    row = html[html.index("echo-private"):]
    assert "other" in row[: row.index("</tr>")]
