"""The browsable API docs, rendered by headless Chromium from the real stack, break no rule of
their Content-Security-Policy (the page and the document themselves: tests/turns/test_openapi.py)."""

from __future__ import annotations


def _docs_violations(browser, url: str) -> list[str]:
    """Open /v1/docs in headless Chromium; the Content-Security-Policy violations it logged."""
    violations: list[str] = []
    context = browser.new_context()
    try:
        page = context.new_page()
        page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
        page.goto(url)
        page.wait_for_selector("text=AAP v3 hosting API", timeout=30_000)
        page.get_by_text("/v1/sessions/{session_id}/turns", exact=True).first.wait_for(timeout=30_000)
    finally:
        context.close()
    return violations


def test_the_docs_page_renders_under_its_content_security_policy(pg_stack, chromium):
    assert chromium.call(_docs_violations, pg_stack.base_url + "/v1/docs") == []
