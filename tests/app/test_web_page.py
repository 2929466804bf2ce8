"""The web page at ``/``, driven in headless Chromium over the DevTools protocol against the real service.

One real server (uvicorn on a free loopback port, bundled models, a temporary data dir) and one browser
serve the whole module. The browser walks the page as a person would: upload a text file, watch it get
indexed, ask a question, read the streamed answer with its sources and statistics, stop a long answer,
start a new conversation and delete the document; errors show as plain text; a conversation survives a
reload, continues and is deleted from the history list.

The page's static files, its SSE parser, its modes and limits and a narrow window are checked in
tests/app/test_web_assets.py.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.app.browser import Browser, open_browser, open_page
from tests.app.live import LIGHTHOUSE, ThreadServer

# ---------------------------------------------------------------------------------------------------
# The real service: the module's `server` (tests/app/conftest.py), with these settings.


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_new_tokens": 512}  # the page asks for a 512-token answer, to stop it midway


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def _api(server: ThreadServer, method: str, path: str) -> Any:
    req = urllib.request.Request(server.url + path, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def _listed_ids(server: ThreadServer) -> set[str]:
    body = _api(server, "GET", "/v1/documents")
    docs = body["documents"] if isinstance(body, dict) else body
    return {d["id"] for d in docs}


DOCUMENT = LIGHTHOUSE


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
    # marks are the passages supporting the answer's cited sentences (tests/app/test_web_citations.py), never
    # the question's words one by one
    assert all(len(m.split()) >= 3 for s in sources for m in s["marks"]), sources

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
# Conversation history.


def _ask(page: Any, question: str, turns: int) -> str:
    page.js("document.getElementById('max-tokens').value = '8'")
    page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
    page.call("Input.insertText", text=question)
    page.js("document.getElementById('ask-btn').click()")
    turn = "document.querySelector('#turns li.turn:last-child')"
    state = page.wait_for(
        f"document.querySelectorAll('#turns li.turn').length === {turns} && {turn}.dataset.state !== 'streaming' "
        f"&& {turn}.dataset.state",
        f"the answer to {question!r}",
    )
    assert state == "done", page.js(f"{turn}.querySelector('.answer-status').textContent")
    return str(page.js(f"{turn}.querySelector('.answer-text').textContent"))


@pytest.mark.browser
@pytest.mark.real_model
def test_conversation_survives_a_reload_continues_and_is_deleted(server: ThreadServer, browser: Browser) -> None:
    from tests.app.live import upload_text, wait_indexed

    with server.client() as client:
        doc_id = upload_text(client, DOCUMENT, title="Varnholm")
        assert wait_indexed(client, doc_id)["status"] == "ready"
    page = browser.page
    open_page(page, server.url + "/")
    assert page.js("document.getElementById('page-loading').hidden") is True
    assert page.js("document.documentElement.dataset.loading") is None
    item = f"document.querySelector('#doc-list li.doc[data-id=\"{doc_id}\"]')"
    page.wait_for(f"!!{item}", "the document being listed")
    page.js(f"{item}.querySelector('.doc-check').click()")
    page.js("document.getElementById('new-conversation').click()")

    first = _ask(page, "Who built the lighthouse of Varnholm?", 1)
    live_links = page.js("document.querySelectorAll('#turns li.turn:last-child .answer-text a.cite').length")
    session_id = page.js("RagspecPage.state.sessionId")
    # the engineering stats come collapsed under their toggle
    box = "document.querySelector('#turns li.turn:last-child .stats-box')"
    assert page.js(f"!{box}.hidden && !{box}.open") is True
    page.js(f"{box}.querySelector('summary').click()")
    assert page.js(f"{box}.open") is True

    # a reload shows the conversation again, its sources too, and lists it as the current one
    open_page(page, server.url + "/")
    assert page.js("document.querySelectorAll('#turns li.turn').length") == 1
    assert page.js("document.querySelector('#turns .question-bubble').textContent").endswith(
        "Who built the lighthouse of Varnholm?"
    )
    # the answer as it was shown, with its [n] links to the sources (kept with the turn)
    assert page.js("document.querySelector('#turns .answer-text').textContent") == first
    assert page.js("document.querySelectorAll('#turns .answer-text a.cite').length") == live_links
    assert page.js("document.querySelectorAll('#turns .source').length") >= 1
    assert page.js("RagspecPage.state.sessionId") == session_id
    assert "1 question" in page.js("document.getElementById('session-line').textContent")
    entry = f"document.querySelector('#history-list li[data-id=\"{session_id}\"]')"
    assert page.js(f"{entry}.querySelector('.history-title').textContent") == "Who built the lighthouse of Varnholm?"
    assert page.js(f"{entry}.querySelector('.history-open').getAttribute('aria-current')") == "true"
    assert page.js(f"{item}.querySelector('.doc-check').checked"), "the conversation's document is ticked again"

    # ... and continues: the follow-up joins the same session on the server
    _ask(page, "When was it automated?", 2)
    assert page.js("RagspecPage.state.sessionId") == session_id
    assert "2 questions" in page.js("document.getElementById('session-line').textContent")
    kept = _api(server, "GET", f"/v1/sessions/{session_id}")
    assert [t["question"] for t in kept["turns"]] == [
        "Who built the lighthouse of Varnholm?", "When was it automated?"
    ]
    page.wait_for(f"{entry} && {entry}.querySelector('.history-meta').textContent.startsWith('2 questions')",
                  "the list counting the follow-up")

    # a new conversation, then the old one resumed from the list
    page.js("document.getElementById('new-conversation').click()")
    assert page.js("document.querySelectorAll('#turns li.turn').length") == 0
    page.js(f"{entry}.querySelector('.history-open').click()")
    page.wait_for("document.querySelectorAll('#turns li.turn').length === 2", "the conversation being resumed")
    assert page.js("RagspecPage.state.sessionId") == session_id

    # delete takes two clicks; the conversation is gone from the page, the server and the next reload
    page.js(f"{entry}.querySelector('.history-delete').click()")
    assert page.js(f"{entry}.querySelector('.history-delete').textContent") == "Confirm delete"
    page.js(f"{entry}.querySelector('.history-delete').click()")
    page.wait_for(f"!{entry}", "the conversation leaving the list")
    assert page.js("document.querySelectorAll('#turns li.turn').length") == 0
    assert page.js("RagspecPage.state.sessionId") != session_id
    try:
        _api(server, "GET", f"/v1/sessions/{session_id}")
        raise AssertionError("the deleted session is still served")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
    open_page(page, server.url + "/")
    assert page.js("document.querySelectorAll('#turns li.turn').length") == 0
    assert page.exceptions() == []


def hold_first_get(url_pattern: str) -> str:
    """A script for ``Page.addScriptToEvaluateOnNewDocument``: the page's first GET whose URL matches the JS regex
    ``url_pattern`` is answered only once the test sets ``window.__release`` (then ``window.__answered`` is set)."""
    return """(() => {
  const real = window.fetch.bind(window);
  let held = false;
  window.fetch = async (input, init) => {
    const response = await real(input, init);
    const href = String(input && input.url ? input.url : input);
    if (!held && PATTERN.test(href) && !(init && init.method && init.method !== 'GET')) {
      held = true;
      while (!window.__release) await new Promise((r) => setTimeout(r, 20));
      window.__answered = true;
    }
    return response;
  };
})();""".replace("PATTERN", url_pattern)


HOLD_THE_FIRST_LIST = hold_first_get(r"/v1\/documents$/")  # the page's first document list


@pytest.mark.browser
def test_an_upload_survives_a_document_list_answered_after_it(
    server: ThreadServer, browser: Browser, tmp_path: Path
) -> None:
    """The page's document list, asked before an upload and answered after the server accepted it, must not drop
    the new document (it did, and then nothing polled it: the list stayed empty)."""
    page = browser.page
    script = page.call("Page.addScriptToEvaluateOnNewDocument", source=HOLD_THE_FIRST_LIST)["identifier"]
    try:
        page.call("Page.navigate", url=server.url + "/")
        page.wait_for("document.documentElement.dataset.ready === '1'", "the page script starting")
        doc_path = tmp_path / "late-list.txt"
        doc_path.write_text("Owls hunt at night and sleep by day.", encoding="utf-8")
        root = page.call("DOM.getDocument")["root"]["nodeId"]
        input_node = page.call("DOM.querySelector", nodeId=root, selector="#file-input")["nodeId"]
        page.call("DOM.setFileInputFiles", files=[str(doc_path)], nodeId=input_node)
        item = "[...document.querySelectorAll('#doc-list li.doc')].find((li) => li.textContent.includes('late-list'))"
        doc_id = page.wait_for(f"{item} && !{item}.dataset.id.startsWith('upload-') && {item}.dataset.id",
                               "the server accepting the upload")
        assert doc_id not in {"", None}
        page.js("window.__release = true")  # the list asked before the upload arrives now, without it
        done = f"{item} && ['ready', 'failed'].includes({item}.dataset.status) && {item}.dataset.status"
        status = page.wait_for(done, "the upload staying listed until indexed")
        assert status == "ready" and doc_id in _listed_ids(server)
    finally:
        page.call("Page.removeScriptToEvaluateOnNewDocument", identifier=script)
        page.call("Page.navigate", url=server.url + "/")


HOLD_THE_RESUME = hold_first_get(r"/v1\/sessions\/[^/?]+$/")  # the page's resume of the remembered conversation


@pytest.mark.browser
@pytest.mark.real_model
def test_a_new_conversation_survives_a_resume_answered_after_it(server: ThreadServer, browser: Browser) -> None:
    """After a reload the page resumes the remembered conversation; answered only after the user started a new
    one and asked, that resume must not replace it (it did, and aborted the new answer: a page test hung)."""
    from tests.app.live import upload_text, wait_indexed

    with server.client() as client:
        doc_id = upload_text(client, DOCUMENT, title="Varnholm resumed")
        assert wait_indexed(client, doc_id)["status"] == "ready"
    page = browser.page
    item = f"document.querySelector('#doc-list li.doc[data-id=\"{doc_id}\"]')"

    def tick() -> None:
        page.wait_for(f"!!{item}", "the document being listed")
        page.js(f"if (!{item}.querySelector('.doc-check').checked) {item}.querySelector('.doc-check').click(); true")

    open_page(page, server.url + "/")
    tick()
    page.js("document.getElementById('new-conversation').click()")
    _ask(page, "Who built the lighthouse of Varnholm?", 1)
    old_session = page.js("RagspecPage.state.sessionId")
    script = page.call("Page.addScriptToEvaluateOnNewDocument", source=HOLD_THE_RESUME)["identifier"]
    try:
        page.call("Page.navigate", url=server.url + "/")
        page.wait_for("document.documentElement.dataset.ready === '1'", "the page script starting")
        tick()
        page.js("document.getElementById('new-conversation').click()")
        _ask(page, "When was it automated?", 1)
        page.js("window.__release = true")
        page.wait_for("window.__answered === true", "the held resume being answered")
        time.sleep(1.0)  # let the page handle the late answer (nothing to poll for when it rightly does nothing)
        assert page.js("document.querySelectorAll('#turns li.turn').length") == 1
        assert page.js("document.querySelector('#turns .question-bubble').textContent").endswith(
            "When was it automated?")
        assert page.js("RagspecPage.state.sessionId") != old_session
        assert page.js("document.querySelector('#turns li.turn').dataset.state") == "done"
    finally:
        page.call("Page.removeScriptToEvaluateOnNewDocument", identifier=script)
        page.call("Page.navigate", url=server.url + "/")
