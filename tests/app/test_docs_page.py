"""``/docs`` in headless Chromium with API keys on: Swagger UI comes from this server alone (no CDN: every
request the browser makes goes to the server), says that a key is needed, and shows the routes once the key
is entered; "Try it out" requests carry the key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.app.browser import Browser, open_browser
from tests.app.live import ThreadServer

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

KEY = "key-docs-page-1"


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"api_keys": KEY}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def requested(browser: Browser) -> list[str]:
    browser.page.call("Runtime.evaluate", expression="0")  # flush pending events
    events = browser.page.events
    return [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]


def test_docs_work_offline_and_with_an_api_key(server: ThreadServer, browser: Browser) -> None:
    page = browser.page
    page.call("Network.enable")
    page.call("Page.navigate", url=server.url + "/docs")
    page.wait_for(
        "(document.getElementById('docs-status') || {}).dataset && "
        "document.getElementById('docs-status').dataset.state === 'error'",
        "the docs page asking for a key",
    )
    assert "needs an API key" in page.js("document.getElementById('docs-status').textContent")
    assert page.js("typeof SwaggerUIBundle") == "function", "Swagger UI's script was not served"
    assert page.js("document.querySelectorAll('.opblock').length") == 0

    # a wrong key is refused in words; the right one shows the routes
    page.js("document.getElementById('api-key').value = 'not-a-key'")
    page.js("document.getElementById('key-form').requestSubmit()")
    page.wait_for("document.getElementById('docs-status').textContent.includes('refused')", "the wrong key refused")
    page.js(f"document.getElementById('api-key').value = {KEY!r}")
    page.js("document.getElementById('key-form').requestSubmit()")
    page.wait_for("document.querySelectorAll('.opblock').length > 0", "Swagger UI listing the routes")
    paths = page.js("Array.from(document.querySelectorAll('.opblock-summary-path')).map((e) => e.textContent)")
    for path in ("/v1/ask", "/v1/sessions", "/v1/sessions/{session_id}", "/v1/documents", "/v1/capabilities"):
        assert any(p.replace("\u200b", "") == path for p in paths), (path, paths)
    stylesheet = page.js(
        "Array.from(document.styleSheets).some((s) => (s.href || '').endsWith('/static/swagger/swagger-ui.css'))"
    )
    assert stylesheet, "Swagger UI's stylesheet was not served"

    # "Try it out" on GET /v1/capabilities: the request carries the key (a 200, not a 401)
    block = "document.querySelector('#operations-ask-capabilities_v1_capabilities_get')"
    page.wait_for(f"!!{block}", "the capabilities route's block")
    page.js(f"{block}.querySelector('.opblock-summary-control').click()")
    page.wait_for(f"!!{block}.querySelector('.try-out__btn')", "the Try it out button", timeout=30)
    page.js(f"{block}.querySelector('.try-out__btn').click()")
    page.wait_for(f"!!{block}.querySelector('.execute')", "the Execute button", timeout=30)
    page.js(f"{block}.querySelector('.execute').click()")
    status = page.wait_for(
        f"{block}.querySelector('.live-responses-table tbody .response-col_status') && "
        f"{block}.querySelector('.live-responses-table tbody .response-col_status').textContent.trim()",
        "the response of Try it out",
        timeout=60,
    )
    assert status.startswith("200"), status

    # the key is kept for the next visit (shared with the main page), and nothing came from elsewhere
    page.call("Page.reload")
    page.wait_for("document.querySelectorAll('.opblock').length > 0", "the routes after a reload")
    urls = requested(browser)
    assert urls and all(u.startswith(server.url + "/") or u.startswith("data:") for u in urls), [
        u for u in urls if not u.startswith(server.url)
    ]
    assert page.exceptions() == []


def test_docs_assets_are_public_and_openapi_needs_the_key(server: ThreadServer) -> None:
    with server.client() as anonymous:
        assert anonymous.get("/docs").status_code == 200
        bundle = anonymous.get("/static/swagger/swagger-ui-bundle.js")
        assert bundle.status_code == 200 and "SwaggerUIBundle" in bundle.text
        assert anonymous.get("/static/swagger/swagger-ui.css").status_code == 200
        assert anonymous.get("/openapi.json").status_code == 401
    with server.client(KEY) as client:
        assert client.get("/openapi.json").json()["paths"]["/v1/sessions"]
