"""The admin in a real browser (headless Chromium over Playwright) against the running
PostgreSQL stack, as a first-time operator uses it: add an agent with each option type and a
mistake, read the error without ever getting the secret back, add a tenant and call the API
with its first token, then read that tenant's conversation on the session's page."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

pytestmark = pytest.mark.e2e

TOKEN_RE = re.compile(r"aap_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}")


@pytest.fixture(scope="module")
def operator(pg_stack):
    """A superuser of the stack's database: (username, password)."""
    username, password = f"op-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    pg_stack.manage(
        "shell",
        "-v",
        "0",
        "-c",
        f"from django.contrib.auth.models import User; User.objects.create_superuser({username!r}, '', {password!r})",
    )
    return username, password


def visible(page, selector: str) -> bool:
    return page.locator(selector).is_visible()


def test_a_first_time_operator_walks_the_admin(pg_stack, operator, chromium):
    # Playwright's objects live on the browser's thread: the whole walk runs there.
    chromium.call(walk, pg_stack, operator, timeout=300)


def walk(browser, pg_stack, operator):
    context = browser.new_context(base_url=pg_stack.base_url)
    try:
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.goto("/admin/login/")
        page.fill("#id_username", operator[0])
        page.fill("#id_password", operator[1])
        page.click("input[type=submit]")
        page.wait_for_selector("#user-tools")
        walk_admin(page, pg_stack)
    finally:
        context.close()


def walk_admin(page, pg_stack):
    secret = f"sk-browser-{uuid.uuid4().hex}"
    agent = f"browser-{uuid.uuid4().hex[:6]}"

    # --- an agent with a select, a text and a secret option, and a malformed runtime config ---
    page.goto("/admin/agents/agent/add/")
    page.fill("#id_name", agent)
    page.fill("#id_title", "Made in a browser")
    page.select_option("#id_runtime_kind", "echo")
    page.fill("#id_runtime_config", "{window: 5}")
    for _ in range(3):
        page.click("#options-group .add-row a")

    page.fill("#id_options-0-name", "style")
    page.select_option("#id_options-0-type", "select")
    assert visible(page, "#id_options-0-choices") and visible(page, "#id_options-0-default")
    assert not visible(page, "#id_options-0-secret_value")
    page.fill("#id_options-0-choices", "plain\nupper")
    page.fill("#id_options-0-default", "upper")

    page.fill("#id_options-1-name", "signature")
    page.select_option("#id_options-1-type", "text")
    assert not visible(page, "#id_options-1-choices") and not visible(page, "#id_options-1-secret_value")
    page.fill("#id_options-1-default", "from the browser")

    page.fill("#id_options-2-name", "apiKey")
    page.select_option("#id_options-2-type", "secret")
    assert visible(page, "#id_options-2-secret_value")
    assert not visible(page, "#id_options-2-default") and not visible(page, "#id_options-2-choices")
    assert page.get_attribute("#id_options-2-secret_value", "type") == "password"
    page.fill("#id_options-2-secret_value", secret)
    page.click("input[name=_save]")

    page.wait_for_selector(".errornote")
    html = page.content()
    assert "This is not valid JSON" in html and "line 1, column 2" in html
    assert secret not in html, "the secret typed before the error is not sent back"
    assert page.input_value("#id_options-2-secret_value") == ""
    # The rest of what was typed is kept, and each option still shows its own inputs.
    assert page.input_value("#id_options-0-choices") == "plain\nupper"
    assert visible(page, "#id_options-0-choices") and not visible(page, "#id_options-1-choices")
    assert visible(page, "#id_options-2-secret_value")

    page.fill("#id_runtime_config", '{"window": 5}')
    page.fill("#id_options-2-secret_value", secret)
    page.click("input[name=_save]")
    page.wait_for_selector(".messagelist .success")
    assert secret not in page.content()
    page.click(f"text={agent}")
    page.wait_for_selector("#id_options-2-secret_value")
    assert secret not in page.content()
    assert "*** stored" in (page.get_attribute("#id_options-2-secret_value", "placeholder") or "")

    # --- a tenant, and its first token against the API ----------------------------------------
    tenant = f"browser-tenant-{uuid.uuid4().hex[:6]}"
    page.goto("/admin/hosting/tenant/add/")
    page.fill("#id_name", tenant)
    page.click("input[name=_save]")
    message = page.locator(".messagelist").inner_text()
    token = TOKEN_RE.search(message).group(0)
    api = httpx.Client(base_url=pg_stack.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    meta = {a["name"]: a for a in api.get("/v1/meta").json()["agents"]}
    options = {o["name"]: o for o in meta[agent]["options"]}
    assert options["style"]["options"] == ["plain", "upper"] and options["apiKey"]["default"] == "***"
    created = api.post("/v1/sessions", json={"agent": {"name": agent}})
    assert created.status_code == 201, created.text
    session_id = created.json()["sessionId"]
    turn = api.post(
        f"/v1/sessions/{session_id}/turns", json={"messages": [{"role": "user", "content": "hello from the tenant"}]}
    )
    assert turn.status_code == 200, turn.text
    assert "echo: HELLO FROM THE TENANT -- from the browser" in turn.text
    page.goto("/admin/hosting/tenant/")
    assert token not in page.content()

    # --- the session's page shows the conversation ---------------------------------------------
    page.goto(f"/admin/sessions_app/session/?q={session_id}")
    page.click(f"text={session_id}")
    conversation = page.locator(".aap-conversation")
    conversation.wait_for()
    text = conversation.inner_text()
    assert "hello from the tenant" in text
    assert "echo: HELLO FROM THE TENANT -- from the browser" in text
    assert "stop reason end_turn" in text
    assert secret not in page.content()
