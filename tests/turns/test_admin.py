"""Django admin, in-process (pytest-django's admin_client, inside the test's transaction):
secrets are write-only, API tokens are shown once and stored hashed, the lists render."""

from __future__ import annotations

import hashlib
import json
import re
import uuid

import pytest

SMALL_SECRET_DEFAULT = "sk-small-window-default"  # tests/agents.yaml
ADMIN_SECRET = f"sk-admin-{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def seeded(engine, settings):
    """The seeded tenants and agents (committed by the engine fixture); a fast hasher for admin_user."""
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
        "name": name,
        "title": "Admin-made",
        "version": "1.0.0",
        "description": "",
        "enabled": "on",
        "runtime_kind": "echo",
        "runtime_config": "{}",
        "client_tools": "on",
        "options-TOTAL_FORMS": "1",
        "options-INITIAL_FORMS": "1" if option_pk else "0",
        "options-MIN_NUM_FORMS": "0",
        "options-MAX_NUM_FORMS": "1000",
        "server_tools-TOTAL_FORMS": "0",
        "server_tools-INITIAL_FORMS": "0",
        "server_tools-MIN_NUM_FORMS": "0",
        "server_tools-MAX_NUM_FORMS": "1000",
        "_save": "Save",
    }
    fields = {
        "name": "apiKey",
        "type": "secret",
        "title": "",
        "description": "",
        "choices": "[]",
        "default": "",
        "position": "0",
    }
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
    from infra import crypto

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
    data.update(
        {
            "server_tools-TOTAL_FORMS": "1",
            "server_tools-0-name": "clock",
            "server_tools-0-title": "",
            "server_tools-0-description": "Time.",
            "server_tools-0-implementation": "clock",
            "server_tools-0-parameters": '{"type": "nonsense"}',
            "server_tools-0-settings": "{}",
            "server_tools-0-enabled": "on",
            "server_tools-0-position": "0",
        }
    )
    response = admin_client.post("/admin/agents/agent/add/", data)
    assert response.status_code == 200
    assert "not a valid JSON Schema" in response.content.decode()
    assert not Agent.objects.filter(name=name).exists()


def test_an_api_token_added_in_admin_is_shown_once_and_stored_as_a_hash(admin_client, db_access):
    from tenancy.authentication import tenant_for_raw_token
    from tenancy.models import ApiToken, Tenant

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

    for page in (
        f"/admin/hosting/apitoken/{token.pk}/change/",
        "/admin/hosting/apitoken/",
        f"/admin/hosting/tenant/{demo.pk}/change/",
    ):
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
    row = html[html.index("echo-private") :]
    assert "other" in row[: row.index("</tr>")]


# --- what a first-timer meets ------------------------------------------------------------------


def test_a_secret_typed_in_a_form_with_an_error_is_never_rendered_back(admin_client, db_access):
    from agents.models import Agent

    name = f"t16-admin-{uuid.uuid4().hex[:6]}"
    typed_masked = f"sk-masked-{uuid.uuid4().hex}"
    typed_plain = f"sk-plain-{uuid.uuid4().hex}"
    for fields in ({"secret_value": typed_masked}, {"default": typed_plain}):
        data = agent_form(name, option={"type": "secret", **fields})
        data["version"] = "not a version"  # the bad field
        response = admin_client.post("/admin/agents/agent/add/", data)
        assert response.status_code == 200
        html = response.content.decode()
        assert "Use a semantic version such as 1.0.0." in html
        assert typed_masked not in html and typed_plain not in html
    assert not Agent.objects.filter(name=name).exists()


def test_options_keep_only_what_their_type_uses(admin_client, db_access):
    from agents.models import Agent, AgentOption

    name = f"t16-admin-{uuid.uuid4().hex[:6]}"
    data = agent_form(
        name, option={"type": "select", "name": "style", "choices": "plain\n upper \n\n", "default": "upper"}
    )
    response = admin_client.post("/admin/agents/agent/add/", data)
    assert response.status_code == 302, form_errors(response)
    option = AgentOption.objects.get(agent__name=name, name="style")
    assert option.choices == ["plain", "upper"] and option.default == "upper"

    # Turned into a text option: the hidden choices are dropped, not an error.
    agent = Agent.objects.get(name=name)
    data = agent_form(
        name,
        option={"type": "text", "name": "style", "choices": "plain\nupper", "default": "hi"},
        option_pk=option.pk,
        agent_pk=agent.pk,
    )
    response = admin_client.post(f"/admin/agents/agent/{agent.pk}/change/", data)
    assert response.status_code == 302, form_errors(response)
    option.refresh_from_db()
    assert option.choices == [] and option.default == "hi"

    # A select default outside its choices says so.
    data = agent_form(
        name,
        option={"type": "select", "name": "style", "choices": "a\nb", "default": "c"},
        option_pk=option.pk,
        agent_pk=agent.pk,
    )
    response = admin_client.post(f"/admin/agents/agent/{agent.pk}/change/", data)
    assert response.status_code == 200 and "The default must be one of the choices." in response.content.decode()


def test_a_malformed_json_field_says_where_and_shows_an_example(admin_client, db_access):
    name = f"t16-admin-{uuid.uuid4().hex[:6]}"
    data = agent_form(name, option={"type": "text", "name": "note"})
    data["runtime_config"] = "{window: 5}"
    response = admin_client.post("/admin/agents/agent/add/", data)
    assert response.status_code == 200
    html = response.content.decode()
    assert "This is not valid JSON" in html and "line 1, column 2" in html
    assert "Example: {&quot;window&quot;: 20}" in html
    # The help beside the field shows each runtime kind's example and schema.
    for kind in ("echo", "openai", "acp"):
        assert f'data-kind="{kind}"' in html
    assert "systemPrompt" in html and "&quot;command&quot;" in html


def test_an_openai_agent_without_a_model_is_refused_at_save_time(admin_client, db_access):
    from agents.models import Agent

    name = f"t16-llm-{uuid.uuid4().hex[:6]}"
    data = agent_form(name, option={"type": "text", "name": "note"})
    data.update(runtime_kind="openai", runtime_config="{}")
    response = admin_client.post("/admin/agents/agent/add/", data)
    assert response.status_code == 200
    assert "An openai agent needs a model to call" in response.content.decode()
    assert not Agent.objects.filter(name=name).exists()

    # Either source of a model is enough (a model option the application may set, or the configuration).
    data = agent_form(name, option={"type": "text", "name": "model", "default": ""})
    data.update(runtime_kind="openai", runtime_config="{}")
    assert admin_client.post("/admin/agents/agent/add/", data).status_code == 302
    other = f"t16-llm-{uuid.uuid4().hex[:6]}"
    data = agent_form(other, option={"type": "text", "name": "note"})
    data.update(runtime_kind="openai", runtime_config='{"model": "gpt-4o-mini"}')
    assert admin_client.post("/admin/agents/agent/add/", data).status_code == 302


def test_a_tenant_added_in_admin_gets_a_first_token_shown_once(admin_client, db_access):
    from tenancy.authentication import tenant_for_raw_token
    from tenancy.models import ApiToken, Tenant

    name = f"t16-tenant-{uuid.uuid4().hex[:6]}"
    response = admin_client.post(
        "/admin/hosting/tenant/add/",
        {
            "name": name,
            "title": "From admin",
            "is_active": "on",
            "weight": "1",
            "_save": "Save",
            "tokens-TOTAL_FORMS": "0",
            "tokens-INITIAL_FORMS": "0",
            "tokens-MIN_NUM_FORMS": "0",
            "tokens-MAX_NUM_FORMS": "1000",
        },
        follow=True,
    )
    assert response.status_code == 200, form_errors(response)
    shown = " ".join(str(message) for message in response.context["messages"])
    raw = re.search(r"aap_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}", shown).group(0)
    tenant = Tenant.objects.get(name=name)
    assert tenant_for_raw_token(raw).pk == ApiToken.objects.get(tenant=tenant).pk
    page = admin_client.get(f"/admin/hosting/tenant/{tenant.pk}/change/").content.decode()
    assert raw not in page


def test_usage_reads_as_llm_usage_and_view_site_leads_to_the_api_docs(admin_client, db_access):
    tenants = admin_client.get("/admin/hosting/tenant/").content.decode()
    assert "LLM prompt tokens" in tenants and "LLM completion tokens" in tenants
    index = admin_client.get("/admin/").content.decode()
    assert 'href="/v1/docs"' in index
    assert admin_client.get("/v1/docs").status_code == 200


def test_a_sessions_page_shows_its_conversation(admin_client, db_access, demo):
    from sessions_app.models import Session

    session_id = demo.create_session("echo", agent={"tools": [{"name": "clock", "trust": True}]})
    first = demo.turn(session_id, text="hello <b>admin</b>")
    assert first.stop_reason == "end_turn"
    second = demo.turn(session_id, text="/tool clock {}")
    assert second.stop_reason == "end_turn"
    session = Session.objects.get(public_id=session_id)
    html = admin_client.get(f"/admin/sessions_app/session/{session.pk}/change/").content.decode()
    assert "hello &lt;b&gt;admin&lt;/b&gt;" in html, "the user's text, escaped"
    assert "echo: hello &lt;b&gt;admin&lt;/b&gt;" in html
    assert 'class="aap-tool-call">tool call <b>clock</b>' in html
    assert "tool clock returned:" in html
    assert html.count('class="aap-stop-reason">end_turn<') == 2
    assert first.turn_id in html and second.turn_id in html
    assert "LLM usage" in html


def test_an_agents_file_with_an_openai_agent_without_a_model_is_refused(db_access):
    from agents.models import Agent
    from agents.services import AgentFileError, agents_apply

    name = f"t16-file-{uuid.uuid4().hex[:6]}"
    entry = {"name": name, "runtime": {"kind": "openai", "config": {"systemPrompt": "Hi."}}}
    with pytest.raises(AgentFileError, match=f"Agent '{name}': An openai agent needs a model to call"):
        agents_apply([entry])
    assert not Agent.objects.filter(name=name).exists()
    agents_apply([{**entry, "options": [{"type": "text", "name": "model", "default": "gpt-4o-mini"}]}])
    assert Agent.objects.filter(name=name, runtime_kind="openai").exists()


def test_mcp_servers_taking_an_undeclared_option_are_refused_by_the_agent_form(admin_client, db_access):
    from agents.models import Agent

    name = f"t31-mcp-{uuid.uuid4().hex[:6]}"
    server = {"name": "tickets", "type": "http", "url": "https://mcp.example.com/mcp"}
    server["headers"] = [{"name": "Authorization", "option": "ticketsToken", "prefix": "Bearer "}]
    data = agent_form(name, option={"type": "text", "name": "note"})
    data.update(runtime_kind="openai", runtime_config=json.dumps({"model": "gpt-4o-mini", "mcpServers": [server]}))
    response = admin_client.post("/admin/agents/agent/add/", data)
    assert response.status_code == 200
    assert "option &#x27;ticketsToken&#x27;, which this agent does not declare" in response.content.decode()
    assert not Agent.objects.filter(name=name).exists()


def test_saving_an_agent_with_mcp_servers_in_admin_lists_their_tools(
    admin_client, db_access, django_capture_on_commit_callbacks
):
    from agents.models import Agent, McpToolList

    name = f"t31-mcp-{uuid.uuid4().hex[:6]}"
    server = {"name": "tickets", "type": "http", "url": "http://127.0.0.1:9/mcp"}
    data = agent_form(name, option={"type": "text", "name": "note"})
    data.update(runtime_kind="openai", runtime_config=json.dumps({"model": "gpt-4o-mini", "mcpServers": [server]}))
    with django_capture_on_commit_callbacks(execute=True):
        assert admin_client.post("/admin/agents/agent/add/", data).status_code == 302
    agent = Agent.objects.get(name=name)
    listed = McpToolList.objects.get(agent=agent)
    assert listed.revision == agent.updated_at and listed.tools == []
    assert "loopback" in listed.problems["tickets"]  # a private address the operator did not allow
