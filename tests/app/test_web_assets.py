"""The web page's assets and what it offers, mostly without a browser: the static files are self-contained
(no CDN, no HTML injection, scripts that parse), the SSE parser the page uses (checked on its own in Node)
copes with chunk boundaries that split lines, CRLF pairs and multi-byte text, and the page lists exactly the
API's modes. In headless Chromium against the real service (the module's ``server``, tests/app/conftest.py):
the page offers the modes and token limit the server has, and fits a 400 px wide window.

The walk-through of the page (upload, ask, stream, stop, history) is in tests/app/test_web_page.py, its collection
picker in tests/app/test_web_collections.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.app.browser import Browser, open_browser, open_page
from tests.app.live import ThreadServer
from tests.conftest import REPO

STATIC = REPO / "app" / "static"
NODE = shutil.which("node")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


# ---------------------------------------------------------------------------------------------------
# Static checks that need no server.


def test_static_files_are_self_contained() -> None:
    """No CDN or remote asset: the page works offline; scripts parse."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    refs = ("static/style.css", "static/sse.js", "static/app.js", "static/collections.js", "static/history.js",
            "static/capabilities.js", "static/favicon.svg")
    for ref in refs:
        assert ref in html
        assert (STATIC / ref.removeprefix("static/")).is_file()
    # the loading state is in the markup, so it shows before any script has run (capabilities.js ends it)
    assert '<html lang="en" data-loading="1">' in html and 'id="page-loading"' in html
    assert '<p id="doc-empty" class="empty">Loading documents…</p>' in html
    docs = (STATIC / "docs.html").read_text(encoding="utf-8")
    for ref in ("static/docs.js", "static/docs.css", "static/swagger/swagger-ui-bundle.js", "static/favicon.svg"):
        assert ref in docs
    scripts = ("app.js", "sse.js", "collections.js", "history.js", "capabilities.js", "docs.js")
    for name in ("index.html", "style.css", "docs.html", "docs.css", *scripts):
        text = (STATIC / name).read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
    for name in scripts:
        text = (STATIC / name).read_text(encoding="utf-8")
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "document.write" not in text, name
    if NODE:
        for name in scripts:
            run = subprocess.run([NODE, "--check", str(STATIC / name)], capture_output=True, text=True)
            assert run.returncode == 0, run.stderr


def test_page_controls_are_labelled_and_collections_load_before_history() -> None:
    """Every control of the page's markup has a label (a ``<label for>``, a wrapping label or an aria-label), so it is
    named to a screen reader and reached by keyboard; the collection picker is a radio group under a legend, its file
    input takes several files; collections.js builds on app.js and is loaded before history.js (which resumes a
    conversation's collection through it) and capabilities.js (which waits for it before ending the loading state)."""
    from html.parser import HTMLParser

    html = (STATIC / "index.html").read_text(encoding="utf-8")

    class Controls(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.labels: set[str] = set()
            self.controls: list[dict[str, str | None]] = []
            self.open_labels = 0
            self.templates = 0
            self.scripts: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            a = dict(attrs)
            if tag == "template":
                self.templates += 1
            elif tag == "label":
                self.open_labels += 1
                if a.get("for"):
                    self.labels.add(str(a["for"]))
            elif tag == "script" and a.get("src"):
                self.scripts.append(str(a["src"]))
            elif tag in {"input", "select", "textarea"} and a.get("type") != "hidden" and not self.templates:
                self.controls.append({**a, "wrapped": "1" if self.open_labels else None})

        def handle_endtag(self, tag: str) -> None:
            if tag == "template":
                self.templates -= 1
            elif tag == "label":
                self.open_labels -= 1

    parsed = Controls()
    parsed.feed(html)
    unlabelled = [c for c in parsed.controls
                  if not (c.get("id") in parsed.labels or c.get("wrapped") or c.get("aria-label"))]
    assert unlabelled == []
    ids = {c.get("id") for c in parsed.controls}
    assert {"collection-name", "collection-file-input", "target-documents", "question"} <= ids
    files = next(c for c in parsed.controls if c.get("id") == "collection-file-input")
    assert files["type"] == "file" and "multiple" in files
    picker = html[html.index('<fieldset class="ask-about">') : html.index("</fieldset>")]
    assert "<legend>" in picker and 'type="radio" name="ask-target"' in picker
    assert 'aria-describedby="ask-target"' in html and 'id="ask-target"' in html
    order = [s.removeprefix("static/") for s in parsed.scripts]
    assert order.index("app.js") < order.index("collections.js") < order.index("history.js") < order.index(
        "capabilities.js")
    # the collection's documents and the choice go through the API's routes, relative to the page
    script = (STATIC / "collections.js").read_text(encoding="utf-8")
    for route in ("'v1/collections'", "'documents'", "'collection_id'", "'v1/documents'"):
        assert route in script, route
    assert "collection_ids: [collection.id]" in (STATIC / "app.js").read_text(encoding="utf-8")


SSE_CHECK = r"""
const fs = require('fs');
const vm = require('vm');
const ctx = {};
vm.runInNewContext(fs.readFileSync(process.argv[1], 'utf8'), ctx);
const stream = JSON.parse(fs.readFileSync(0, 'utf8'));
const results = [];
for (const size of [1, 2, 3, 5, 7, 64, 100000]) {
  const events = [];
  const parser = ctx.RagspecSSE.createParser((ev) => events.push(ev));
  for (let i = 0; i < stream.length; i += size) parser.push(stream.slice(i, i + size));
  parser.end();
  results.push(events);
}
process.stdout.write(JSON.stringify(results));
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_sse_parser_handles_any_chunking() -> None:
    from app.api.sse import encode
    from app.api.sse import frame as sse_frame

    def frame(data: Any, event: str | None = None) -> str:  # the server's frames, as they go on the wire
        return encode(sse_frame(data, event))

    stream = (
        ": keep-alive\n\n"
        + frame([{"document_id": "d1", "chunk_id": "d1:0", "text": "a\nb", "score": 0.5}], event="sources")
        + frame({"text": "Hé"}, event="token").replace("\n", "\r\n")
        + frame({"text": " wörld ✓"}, event="token").replace("\n", "\r")
        + 'id: 7\nretry: 100\nevent: stats\ndata: {"ttft_ms": 1}\n\n'
        + "event: nodata\n\n"
        + frame({}, event="done")
        + "data: tail without blank line"
    )
    assert NODE is not None
    run = subprocess.run(
        [NODE, "-e", SSE_CHECK, str(STATIC / "sse.js")],
        input=json.dumps(stream),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    expected = [
        {
            "event": "sources",
            "data": json.dumps(
                [{"document_id": "d1", "chunk_id": "d1:0", "text": "a\nb", "score": 0.5}],
                ensure_ascii=False,
                separators=(",", ":"),
            ),
            "id": "",
        },
        {"event": "token", "data": '{"text":"Hé"}', "id": ""},
        {"event": "token", "data": '{"text":" wörld ✓"}', "id": ""},
        {"event": "stats", "data": '{"ttft_ms": 1}', "id": "7"},
        {"event": "done", "data": "{}", "id": "7"},
        {"event": "message", "data": "tail without blank line", "id": "7"},
    ]
    for events in json.loads(run.stdout):
        assert events == expected


def test_mode_choices_are_the_api_modes() -> None:
    """The page lists exactly the modes /v1/ask takes (capabilities.js hides those the server cannot serve)."""
    import re
    from typing import get_args

    from app.schemas import AskMode

    html = (STATIC / "index.html").read_text()
    select = html[html.index('<select id="mode"') : html.index("</select>", html.index('<select id="mode"'))]
    assert re.findall(r'<option value="([a-z_]+)"', select) == list(get_args(AskMode))


# ---------------------------------------------------------------------------------------------------
# The page in a real browser: the server's modes and limits, a narrow window.


@pytest.mark.browser
@pytest.mark.real_model
def test_page_offers_the_servers_modes_and_limits_and_fits_a_narrow_window(
    server: ThreadServer, browser: Browser, tmp_path: Path
) -> None:
    page = browser.page
    drafters = server.app.state.services.drafters
    config = drafters.config
    drafters.config = type(config)(**{**config.__dict__, "draft_model": None})  # as a process without RAPID's LM
    try:
        page.call("Emulation.setDeviceMetricsOverride", width=400, height=800, deviceScaleFactor=1, mobile=False)
        open_page(page, server.url + "/")
    finally:
        drafters.config = config
    try:
        options = page.js(
            "Array.from(document.getElementById('mode').options).map((o) => [o.value, o.hidden && o.disabled])"
        )
        assert dict(options) == {
            "auto": False, "autoregressive": False, "racer": False, "rapid": True, "rapid_kv": False,
            "combined": False, "suffix": False, "prompt_lookup": False,
        }
        assert page.js("document.getElementById('max-tokens').max") == str(server.settings.max_new_tokens)
        assert page.js("document.querySelector('link[rel=icon]').href").endswith("/static/favicon.svg")

        # 400 px wide: nothing overflows sideways, and the question box can be scrolled to and typed in
        assert page.js("document.documentElement.scrollWidth") <= 400
        page.js("document.getElementById('question').scrollIntoView({block: 'center'})")
        box = page.js(
            "(() => { const r = document.getElementById('question').getBoundingClientRect();"
            " return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width}; })()"
        )
        assert box["left"] >= 0 and box["right"] <= 400 and box["width"] >= 200, box
        assert box["top"] >= 0 and box["bottom"] <= 800, box
        hit = page.js(
            f"document.elementFromPoint({(box['left'] + box['right']) / 2}, {(box['top'] + box['bottom']) / 2}).id"
        )
        assert hit == "question", "something covers the question box"
        page.screenshot(tmp_path / "narrow.png")
    finally:
        page.call("Emulation.clearDeviceMetricsOverride")
    assert page.exceptions() == []
