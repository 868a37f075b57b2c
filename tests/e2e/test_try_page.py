"""The /try/ chat page in headless Chromium against the real stack (Daphne + Celery +
PostgreSQL + Redis): sign in, options, a streamed turn, thinking, a client tool, a permission,
cancel, reload-and-re-attach and history. Screenshots land in test-artefacts/try-page/."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from ..support import ROOT, side_redis_db
from .observed import observed_stack

pytestmark = pytest.mark.e2e

ARTEFACTS = ROOT / "test-artefacts" / "try-page"
STOPS = "[data-testid=stop]"


@pytest.fixture(scope="module")
def try_stack(pg_stack, log_dir):
    stack = observed_stack(pg_stack, log_dir, "try", {"AAP_TRY_PAGE": "true"}, redis_db=side_redis_db(2))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def artefacts():
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    return ARTEFACTS


def signed_in(browser, stack, token: str):
    """A fresh browser context on /try/, signed in with `token`, the echo agent picked."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(stack.base_url + "/try/")
    page.fill("[data-testid=token]", token)
    page.click("[data-testid=sign-in]")
    page.wait_for_selector("[data-testid=agent] option[value=echo]", state="attached")
    page.select_option("[data-testid=agent]", "echo")
    return context, page


def new_session(page) -> str:
    page.click("[data-testid=new-session]")
    page.wait_for_function("() => document.querySelector('[data-testid=session-id]').textContent.startsWith('sess_')")
    return page.text_content("[data-testid=session-id]")


def send(page, text: str) -> None:
    page.fill("[data-testid=message]", text)
    page.click("[data-testid=send]")


def wait_stops(page, count: int) -> str:
    page.wait_for_function("n => document.querySelectorAll('[data-testid=stop]').length >= n", arg=count)
    return page.locator(STOPS).nth(count - 1).text_content()


def last_text(page) -> str:
    return page.locator("[data-testid=msg-assistant]").last.locator("[data-testid=text]").all_text_contents()[-1]


def api(stack, token: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_the_page_is_off_unless_enabled(pg_stack):
    response = httpx.get(pg_stack.base_url + "/try/", timeout=10)
    assert response.status_code == 404
    assert "AAP_TRY_PAGE" in response.json()["error"]


def test_a_streamed_turn_with_options_keeps_the_token_out_of_urls(chromium, try_stack, artefacts):
    token = try_stack.tokens["demo"]

    def scenario(browser):
        context, page = signed_in(browser, try_stack, token)
        requests = []
        page.on("request", lambda request: requests.append(request.url))
        try:
            page.select_option("[data-testid=option-style]", "upper")
            page.fill("[data-testid=option-signature]", "from-the-page")
            page.fill("[data-testid=option-apiKey]", "sk-typed-in-the-browser")
            session = new_session(page)
            send(page, "/slow 6 300")
            # Deltas show while the turn runs: a tick is on screen before its turn_stop.
            page.wait_for_selector("text=tick 2")
            assert page.locator(STOPS).count() == 0
            assert wait_stops(page, 1) == "stop: end_turn"
            streamed = last_text(page)
            send(page, "/whoami")
            wait_stops(page, 2)
            whoami = last_text(page)
            send(page, "hello browser")
            wait_stops(page, 3)
            page.screenshot(path=str(artefacts / "streamed-turn.png"), full_page=True)
            stored = {
                key: page.evaluate(f"sessionStorage.getItem('aap.{key}')") for key in ("token", "session", "turn")
            }
            return session, streamed, whoami, last_text(page), stored, requests, page.url
        finally:
            context.close()

    session, streamed, whoami, hello, stored, requests, url = chromium.call(scenario)
    assert streamed == "".join(f"tick {i} " for i in range(1, 7))
    digest = hashlib.sha256(b"sk-typed-in-the-browser").hexdigest()[:8]
    assert whoami == f"style=upper signature=from-the-page apiKey={digest}"
    assert hello == "echo: HELLO BROWSER -- from-the-page"
    # The token stays in this tab's session storage; no URL ever carries it or the secret.
    assert json.loads(stored["token"]) == token
    assert "sk-typed-in-the-browser" not in (stored["session"] or "") and stored["turn"] is None
    assert not [u for u in [*requests, url] if token in u or "sk-typed" in u]
    with api(try_stack, token) as client:
        info = client.get(f"/v1/sessions/{session}").json()
        assert info["agent"]["options"] == {"style": "upper", "signature": "from-the-page", "apiKey": "***"}
        history = client.get(f"/v1/sessions/{session}/history", params={"type": "full"}).json()["history"]["full"]
    assert history[-1] == {"role": "assistant", "content": [{"type": "text", "text": hello}]}


def test_thinking_is_shown_apart_from_the_answer(chromium, try_stack, artefacts):
    def scenario(browser):
        context, page = signed_in(browser, try_stack, try_stack.tokens["demo"])
        try:
            new_session(page)
            send(page, "/think about the page")
            wait_stops(page, 1)
            page.screenshot(path=str(artefacts / "thinking.png"), full_page=True)
            bubble = page.locator("[data-testid=msg-assistant]").last
            return bubble.locator("[data-testid=thinking]").all_text_contents(), last_text(page)
        finally:
            context.close()

    thinking, text = chromium.call(scenario)
    assert thinking == ["thinking about: about the page"]
    assert text == "echo: about the page"


def test_a_client_tool_call_is_answered_from_the_page(chromium, try_stack, artefacts):
    token = try_stack.tokens["demo"]

    def scenario(browser):
        context, page = signed_in(browser, try_stack, token)
        try:
            session = new_session(page)  # with the page's sample client tool, `lookup`
            send(page, '/tool lookup {"q": "aap"}')
            assert wait_stops(page, 1) == "stop: tool_use"
            # A reload keeps what the agent waits for: the pending call is read from history.
            page.reload()
            page.wait_for_selector("[data-testid=pending-call]")
            page.fill("[data-testid=tool-result]", "Agent Application Protocol")
            page.screenshot(path=str(artefacts / "client-tool.png"), full_page=True)
            page.click("[data-testid=send-result]")
            assert wait_stops(page, 1) == "stop: end_turn"  # the history shown after the reload has no stop lines
            return session, last_text(page)
        finally:
            context.close()

    session, text = chromium.call(scenario)
    assert text == "tool lookup returned: Agent Application Protocol"
    with api(try_stack, token) as client:
        history = client.get(f"/v1/sessions/{session}/history", params={"type": "full"}).json()["history"]["full"]
    call = history[1]["content"][0]
    assert (call["name"], call["input"]) == ("lookup", {"q": "aap"})
    assert history[2] == {"role": "tool", "toolCallId": call["toolCallId"], "content": "Agent Application Protocol"}


def test_a_permission_is_granted_from_the_page(chromium, try_stack, artefacts):
    def scenario(browser):
        context, page = signed_in(browser, try_stack, try_stack.tokens["demo"])
        try:
            page.check("[data-testid=tool-add]")  # enabled, not trusted: the agent must ask
            new_session(page)
            send(page, "/think which tool adds")
            wait_stops(page, 1)
            send(page, '/tool add {"a": 2, "b": 3}')
            assert wait_stops(page, 2) == "stop: tool_use"
            page.screenshot(path=str(artefacts / "permission.png"), full_page=True)
            page.click("[data-testid=grant]")
            assert wait_stops(page, 3) == "stop: end_turn"
            return page.locator("[data-testid=msg-tool]").last.text_content(), last_text(page)
        finally:
            context.close()

    tool, text = chromium.call(scenario)
    assert tool.endswith("→ 5")
    assert text == "tool add returned: 5"


def test_a_turn_is_cancelled_from_the_page(chromium, try_stack, artefacts):
    token = try_stack.tokens["demo"]

    def scenario(browser):
        context, page = signed_in(browser, try_stack, token)
        try:
            session = new_session(page)
            send(page, "/slow 200 100")
            page.wait_for_selector("text=tick 3")
            page.click("[data-testid=cancel]")
            stop = wait_stops(page, 1)
            page.screenshot(path=str(artefacts / "cancelled.png"), full_page=True)
            return session, stop, last_text(page)
        finally:
            context.close()

    session, stop, shown = chromium.call(scenario)
    assert stop == "stop: end_turn (cancelled)"
    with api(try_stack, token) as client:
        history = client.get(f"/v1/sessions/{session}/history", params={"type": "full"}).json()["history"]["full"]
    kept = history[-1]["content"][0]["text"]
    assert kept == shown and kept.startswith("tick 1 tick 2 tick 3") and "tick 200" not in kept


def test_a_reload_reattaches_to_the_running_turn_and_reads_history(chromium, try_stack, artefacts):
    token = try_stack.tokens["demo"]

    def scenario(browser):
        context, page = signed_in(browser, try_stack, token)
        try:
            session = new_session(page)
            send(page, "/slow 12 250")
            page.wait_for_selector("text=tick 2")
            page.reload()
            # After the reload: the history so far, then the running turn replayed and followed.
            page.wait_for_selector("text=tick 12")
            assert wait_stops(page, 1) == "stop: end_turn"
            users = page.locator("[data-testid=msg-user]").all_text_contents()
            page.click("[data-testid=load-history]")
            page.wait_for_function(
                "() => document.querySelector('[data-testid=history]').textContent.includes('tick 12')"
            )
            page.screenshot(path=str(artefacts / "reattached.png"), full_page=True)
            return session, users, last_text(page), json.loads(page.text_content("[data-testid=history]"))
        finally:
            context.close()

    session, users, text, shown_history = chromium.call(scenario)
    assert users == ["/slow 12 250"]
    assert text == "".join(f"tick {i} " for i in range(1, 13))
    with api(try_stack, token) as client:
        history = client.get(f"/v1/sessions/{session}/history", params={"type": "full"}).json()["history"]["full"]
    assert shown_history == history


def test_a_wrong_token_is_told_and_not_kept(chromium, try_stack):
    def scenario(browser):
        context = browser.new_context()
        page = context.new_page()
        try:
            page.goto(try_stack.base_url + "/try/")
            page.fill("[data-testid=token]", "not-a-token")
            page.click("[data-testid=sign-in]")
            page.wait_for_function("() => document.querySelector('[data-testid=status]').textContent.length > 0")
            return page.text_content("[data-testid=status]"), page.evaluate("sessionStorage.getItem('aap.token')")
        finally:
            context.close()

    status, stored = chromium.call(scenario)
    assert "token" in status.lower()
    assert stored is None


def test_the_page_has_an_icon_and_a_reload_shows_the_session_it_reattached_to(chromium, try_stack):
    token = try_stack.tokens["demo"]

    def scenario(browser):
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        failures, icons = [], []
        context.on("response", lambda r: failures.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        context.on("response", lambda r: icons.append(r.status) if r.url.endswith("/icon.svg") else None)
        page = context.new_page()
        page.on("console", lambda message: failures.append(message.text) if message.type == "error" else None)
        page.set_default_timeout(30_000)
        try:
            page.goto(try_stack.base_url + "/try/")
            page.fill("[data-testid=token]", token)
            page.click("[data-testid=sign-in]")
            page.wait_for_selector("[data-testid=agent] option[value=echo]", state="attached")
            page.select_option("[data-testid=agent]", "echo")
            page.check("[data-testid=tool-add]")
            page.check("[data-testid=trust-add]")
            session = new_session(page)
            page.reload()
            page.wait_for_function(
                "s => document.querySelector('[data-testid=session-id]').textContent === s", arg=session
            )
            boxes = {box: page.is_checked(f"[data-testid={box}]") for box in ("tool-add", "trust-add", "tool-clock")}
            return boxes, failures, icons
        finally:
            context.close()

    boxes, failures, icons = chromium.call(scenario)
    assert boxes == {"tool-add": True, "trust-add": True, "tool-clock": False}
    assert failures == [], "no 404 (a /favicon.ico) and no error in the console"
    assert icons and set(icons) <= {200, 304}
