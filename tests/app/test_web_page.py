"""The web page at ``/``, driven in headless Chromium over the DevTools protocol against the real service.

One real server (uvicorn on a free loopback port, bundled models, a temporary data dir) and one browser
serve the whole module. The browser walks the page as a person would: upload a text file, watch it get
indexed, ask a question, read the streamed answer with its sources and statistics, stop a long answer,
start a new conversation and delete the document. The SSE parser the page uses is also checked on its own
(in Node) against chunk boundaries that split lines, CRLF pairs and multi-byte text.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.app.live import DEADLINE_S, ThreadServer
from tests.conftest import REPO

STATIC = REPO / "app" / "static"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NODE = shutil.which("node")


# ---------------------------------------------------------------------------------------------------
# A small DevTools-protocol client (websocket JSON-RPC), enough to drive one page.


class CDPError(RuntimeError):
    pass


class Page:
    """One Chromium page target, spoken to over its DevTools websocket."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self._ws = connect(ws_url, max_size=None, open_timeout=30)
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def close(self) -> None:
        self._ws.close()

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CDPError(f"{method}: no reply in {timeout} s")
            reply = json.loads(self._ws.recv(timeout=remaining))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            if "method" in reply:
                self.events.append(reply)

    def js(self, expression: str) -> Any:
        """Evaluate an expression in the page (promises awaited) and return its JSON value."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise CDPError(f"page exception in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = DEADLINE_S) -> Any:
        """Poll ``expression`` until it is truthy; fail the test with ``what`` and the page state if never."""
        deadline = time.monotonic() + timeout
        last_error = ""
        while True:
            try:
                value = self.js(expression)
            except CDPError as exc:  # e.g. the document is being replaced during a navigation
                value, last_error = None, str(exc)
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{what} did not happen within {timeout:.0f} s; last error: {last_error[:500]}; "
                    f"page state: {self.snapshot()}"
                )
            time.sleep(0.1)

    def snapshot(self) -> str:
        return str(self.js("document.querySelector('main') ? document.querySelector('main').innerText : ''"))[
            :2000
        ]

    def exceptions(self) -> list[str]:
        self.call("Runtime.evaluate", expression="0")  # flush pending events into self.events
        return [
            json.dumps(e["params"].get("exceptionDetails", {}))[:500]
            for e in self.events
            if e.get("method") == "Runtime.exceptionThrown"
        ]

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@dataclass
class Browser:
    proc: subprocess.Popen[bytes]
    profile: Path
    page: Page
    logs: list[str] = field(default_factory=list)

    def close(self) -> None:
        try:
            self.page.close()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            shutil.rmtree(self.profile, ignore_errors=True)


def launch_chromium() -> Browser:
    profile = Path(tempfile.mkdtemp(prefix="ragspec-chromium-"))
    args = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        "about:blank",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            shutil.rmtree(profile, ignore_errors=True)
            pytest.fail(f"chromium did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    port = int(port_file.read_text().splitlines()[0])
    ws_url = ""
    while not ws_url:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            targets = json.load(resp)
        ws_url = next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), "")
        if not ws_url:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("chromium has no page target")
            time.sleep(0.05)
    page = Page(ws_url)
    page.call("Page.enable")
    page.call("Runtime.enable")
    page.call("DOM.enable")
    return Browser(proc=proc, profile=profile, page=page)


# ---------------------------------------------------------------------------------------------------
# The real service: the module's `server` (tests/app/conftest.py), with these settings.


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_new_tokens": 512}  # the page asks for a 512-token answer, to stop it midway


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed (apt-get install chromium); .ci/run installs it")
    b = launch_chromium()
    try:
        yield b
    finally:
        b.close()


def _api(server: ThreadServer, method: str, path: str) -> Any:
    req = urllib.request.Request(server.url + path, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def _listed_ids(server: ThreadServer) -> set[str]:
    body = _api(server, "GET", "/v1/documents")
    docs = body["documents"] if isinstance(body, dict) else body
    return {d["id"] for d in docs}


DOCUMENT = (
    "The Lighthouse of Varnholm\n\n"
    "The lighthouse of Varnholm was built in 1872 by the engineer Ada Kessling. Its lamp burned whale oil "
    "until 1911, when it was converted to paraffin. The keeper, Tomas Brenner, kept the light for forty "
    "years and recorded every storm in a green logbook.\n\n"
    "In 1953 the lighthouse was automated, and the keeper's cottage became a small museum. The museum "
    "shows the green logbook, the original brass lens and a model of the island.\n"
)


# ---------------------------------------------------------------------------------------------------
# The page in a real browser.


@pytest.mark.browser
@pytest.mark.real_model
def test_page_uploads_asks_and_streams_an_answer_with_sources(
    server: ThreadServer, browser: Browser, tmp_path: Path
) -> None:
    page = browser.page
    index = urllib.request.urlopen(server.url + "/", timeout=10)
    assert index.status == 200 and "text/html" in index.headers["Content-Type"]

    page.call("Page.navigate", url=server.url + "/")
    page.wait_for("document.documentElement.dataset.ready === '1'", "the page script starting")
    page.wait_for("document.getElementById('health').dataset.state === 'ok'", "the health badge turning ok")

    # Upload a small text file through the real file input (DevTools sets its files and fires "change").
    doc_path = tmp_path / "varnholm.txt"
    doc_path.write_text(DOCUMENT, encoding="utf-8")
    root = page.call("DOM.getDocument")["root"]["nodeId"]
    input_node = page.call("DOM.querySelector", nodeId=root, selector="#file-input")["nodeId"]
    page.call("DOM.setFileInputFiles", files=[str(doc_path)], nodeId=input_node)

    item = "document.querySelector('#doc-list li.doc')"
    title = page.wait_for(
        f"{item} && {item}.querySelector('.doc-title').textContent", "the upload being listed"
    )
    assert title == "varnholm.txt"
    status = page.wait_for(
        f"{item} && ['ready', 'failed'].includes({item}.dataset.status) && {item}.dataset.status",
        "indexing finishing",
    )
    message = page.js(f"{item}.querySelector('.doc-message').textContent")
    assert status == "ready", f"indexing failed: {message}"
    assert page.js(f"{item}.querySelector('.doc-check').checked"), "an uploaded document is ticked once ready"
    assert page.js(f"{item}.querySelector('.doc-progress').hidden"), "the progress bar goes away when ready"
    doc_id = page.js(f"{item}.dataset.id")
    assert doc_id in _listed_ids(server)

    # Ask; count the answer's text updates as they stream in.
    page.js(
        """(() => {
          window.__answerUpdates = 0;
          window.__statuses = [];
          new MutationObserver((records) => {
            for (const r of records) {
              if (r.type === 'characterData') window.__answerUpdates += 1;
              const status = r.target.closest && r.target.closest('.answer-status');
              if (status) window.__statuses.push(status.textContent);
            }
          }).observe(document.getElementById('turns'), {subtree: true, characterData: true, childList: true});
          return true;
        })()"""
    )
    page.js(
        "document.getElementById('max-tokens').value = '32'; document.getElementById('mode').value = 'auto'"
    )
    page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
    page.call("Input.insertText", text="Who built the lighthouse of Varnholm?")
    page.js("document.getElementById('ask-btn').click()")
    assert page.js("document.getElementById('stop-btn').disabled") is False, "Stop is enabled while answering"

    turn = "document.querySelector('#turns li.turn:last-child')"
    state = page.wait_for(
        f"{turn} && {turn}.dataset.state !== 'streaming' && {turn}.dataset.state", "the answer finishing"
    )
    status_text = page.js(f"{turn}.querySelector('.answer-status').textContent")
    assert state == "done", f"the answer ended as {state}: {status_text}"

    answer = page.js(f"{turn}.querySelector('.answer-text').textContent")
    assert answer.strip(), "the streamed answer is empty"
    assert page.js("window.__answerUpdates") >= 1

    sources = page.js(
        f"""Array.from({turn}.querySelectorAll('.source')).map((li) => ({{
              doc: li.dataset.documentId,
              title: li.querySelector('.source-title').textContent,
              meta: li.querySelector('.source-meta') ? li.querySelector('.source-meta').textContent : '',
              text: li.querySelector('.source-text').textContent,
              marks: Array.from(li.querySelectorAll('mark')).map((m) => m.textContent.toLowerCase()),
            }}))"""
    )
    assert sources, "no sources were shown"
    assert all(s["doc"] == doc_id and s["title"] == "varnholm.txt" for s in sources)
    assert any("Kessling" in s["text"] for s in sources), sources
    assert "score" in sources[0]["meta"]
    assert any(m in ("built", "lighthouse", "varnholm") for s in sources for m in s["marks"]), "no highlights"

    stats = page.js(
        f"Object.fromEntries(Array.from({turn}.querySelectorAll('.stats .stat'))"
        ".map((d) => [d.querySelector('dt').textContent, d.querySelector('dd').textContent]))"
    )
    for name in ("Tokens/s", "Acceptance length", "First token", "Prefix cache"):
        assert name in stats, stats
    assert re.fullmatch(r"hit \([\d,]+ tokens\)|miss", stats["Prefix cache"]), stats
    # while the prompt was read, the status line said how far (progress events of the stream)
    statuses = page.js("window.__statuses")
    reading = r"Reading the documents… \d+% \([\d,]+ of [\d,]+ tokens.*\)"
    assert any(re.fullmatch(reading, t) for t in statuses), statuses
    assert page.js("document.getElementById('ask-btn').disabled") is False
    assert page.js("document.getElementById('stop-btn').disabled") is True

    page.screenshot(tmp_path / "answer.png")
    assert page.exceptions() == []

    # Stop aborts the request at once (the service cancels generation on disconnect); the page recovers.
    session_line = page.js("document.getElementById('session-line').textContent")
    assert "1 question" in session_line
    page.js("document.getElementById('max-tokens').value = '512'")
    page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
    page.call("Input.insertText", text="Tell me everything about the museum and the keeper, in detail.")
    page.js("document.getElementById('ask-btn').click(); document.getElementById('stop-btn').click(); true")
    state = page.wait_for(
        f"document.querySelectorAll('#turns li.turn').length === 2 && {turn}.dataset.state !== 'streaming' "
        f"&& {turn}.dataset.state",
        "Stop taking effect",
    )
    assert state == "stopped"
    assert page.js(f"{turn}.querySelector('.answer-status').textContent") == "Stopped."
    assert page.js("document.getElementById('ask-btn').disabled") is False

    # A follow-up in the same session is answered after the stopped one.
    page.js("document.getElementById('max-tokens').value = '8'")
    page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
    page.call("Input.insertText", text="And when was it automated?")
    page.js("document.getElementById('ask-btn').click()")
    state = page.wait_for(
        f"document.querySelectorAll('#turns li.turn').length === 3 && {turn}.dataset.state !== 'streaming' "
        f"&& {turn}.dataset.state",
        "the follow-up answer finishing",
    )
    assert state == "done", page.js(f"{turn}.querySelector('.answer-status').textContent")
    assert page.js(f"{turn}.querySelector('.answer-text').textContent").strip()
    follow_up_line = page.js("document.getElementById('session-line').textContent")
    assert "3 questions" in follow_up_line and follow_up_line[:16] == session_line[:16]

    # New conversation: the log empties and the session id changes.
    page.js("document.getElementById('new-conversation').click()")
    assert page.js("document.querySelectorAll('#turns li.turn').length") == 0
    assert page.js("document.getElementById('session-line').textContent")[:16] != session_line[:16]

    # Delete takes two clicks; then the document is gone from the page and from the service.
    page.js(f"{item}.querySelector('.doc-delete').click()")
    assert page.js(f"{item}.querySelector('.doc-delete').textContent") == "Confirm delete"
    page.js(f"{item}.querySelector('.doc-delete').click()")
    page.wait_for("document.querySelectorAll('#doc-list li.doc').length === 0", "the document being deleted")
    assert doc_id not in _listed_ids(server)
    assert page.exceptions() == []


@pytest.mark.browser
@pytest.mark.real_model
def test_page_shows_errors_as_text(server: ThreadServer, browser: Browser) -> None:
    """A failed upload and a server error are shown as plain text; markup in them is never rendered."""
    page = browser.page
    page.call("Page.navigate", url=server.url + "/")
    page.wait_for("document.documentElement.dataset.ready === '1'", "the page script starting")

    # Asking with nothing ticked is refused on the page.
    page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
    page.call("Input.insertText", text="anything?")
    page.js("document.getElementById('ask-btn').click()")
    assert "Tick at least one" in page.js("document.getElementById('ask-error').textContent")

    # Whitespace is refused on the page; a title past the service's limit is refused by the service, and its
    # error shows as text in a failed item (the markup in the title is never rendered).
    title = "<img src=x onerror=alert(1)>" + "x" * 600
    listed = page.js("document.querySelectorAll('#doc-list li.doc').length")
    page.js("document.getElementById('paste-box').open = true")
    page.js(f"document.getElementById('paste-title').value = {json.dumps(title)}")
    page.js("document.getElementById('paste-text').value = '   '")
    page.js("document.getElementById('paste-form').requestSubmit()")
    assert page.js("document.querySelectorAll('#doc-list li.doc').length") == listed
    page.js("document.getElementById('paste-text').value = 'Some text.'")
    page.js("document.getElementById('paste-form').requestSubmit()")
    item = "document.querySelector('#doc-list li.doc[data-status=\"failed\"]')"
    page.wait_for(f"!!{item}", "the rejected upload being shown")
    assert page.js(f"{item}.querySelector('.doc-title').textContent") == title
    assert page.js("document.querySelectorAll('#doc-list img').length") == 0
    assert page.js(f"{item}.querySelector('.doc-message').textContent").startswith("Upload failed:")
    page.js(f"{item}.querySelector('.doc-delete').click()")  # a local failure is dismissed in one click
    assert page.js(f"{item}") is None
    assert page.exceptions() == []


# ---------------------------------------------------------------------------------------------------
# Static checks that need no server.


def test_static_files_are_self_contained() -> None:
    """No CDN or remote asset: the page works offline; scripts parse."""
    html = (STATIC / "index.html").read_text(encoding="utf-8")
    for ref in ("static/style.css", "static/sse.js", "static/app.js"):
        assert ref in html
        assert (STATIC / ref.removeprefix("static/")).is_file()
    for name in ("index.html", "app.js", "style.css", "sse.js"):
        text = (STATIC / name).read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
    app_js = (STATIC / "app.js").read_text(encoding="utf-8")
    assert "innerHTML" not in app_js and "insertAdjacentHTML" not in app_js and "document.write" not in app_js
    if NODE:
        for name in ("app.js", "sse.js"):
            run = subprocess.run([NODE, "--check", str(STATIC / name)], capture_output=True, text=True)
            assert run.returncode == 0, run.stderr


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
    from app.sse import frame

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
    """The page offers exactly the modes /v1/ask takes (each one is served: none answers 'not available')."""
    import re
    from typing import get_args

    from app.schemas import AskMode

    html = (STATIC / "index.html").read_text()
    select = html[html.index('<select id="mode"') : html.index("</select>", html.index('<select id="mode"'))]
    assert re.findall(r'<option value="([a-z_]+)"', select) == list(get_args(AskMode))
