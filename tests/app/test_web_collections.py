"""The web page's collection picker, driven in headless Chromium (tests/app/browser.py) against the real service (the
module's ``server``, tests/app/conftest.py): create a collection on the page, upload two files into it through its
file input (one multipart request with ``collection_id``), follow them until both are ready, ask the collection
(``collection_ids``, not the ticked documents: the page says which) and read a streamed answer whose sources carry
the files' titles; a reload resumes the conversation with the collection chosen again; a document is taken out of
the collection, ticking a library document switches back to asking documents, and the collection is deleted.

The page's static files (collections.js included) are checked in tests/app/test_web_assets.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.app.browser import Browser, Page, open_browser, open_page
from tests.app.live import LIGHTHOUSE, ThreadServer

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

CRANE = (
    "The Harbour Crane of Ostmark\n\n"
    "The harbour crane of Ostmark was built in 1921. It lifted ships of up to 80 tonnes and was driven by steam "
    "until 1950. It was scrapped in 1988, and its hook hangs in the town hall.\n"
)
NAME = "Coast <b>&</b> harbours"  # markup in a name is shown as text, never rendered
TURN = "document.querySelector('#turns li.turn:last-child')"
COLLECTION_DOCS = "document.querySelectorAll('#collection-doc-list li.doc')"

# every multipart upload the page sends: its files' names and collection_id
RECORD_UPLOADS = """(() => {
  window.__uploads = [];
  const send = XMLHttpRequest.prototype.send;
  XMLHttpRequest.prototype.send = function (body) {
    if (body instanceof FormData) {
      window.__uploads.push({files: body.getAll('file').map((f) => f.name), collection_id: body.get('collection_id')});
    }
    return send.call(this, body);
  };
  return true;
})()"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def _type(page: Page, element_id: str, text: str) -> None:
    page.call("Runtime.evaluate", expression=f"document.getElementById('{element_id}').focus()")
    page.call("Input.insertText", text=text)


def _ask(page: Page, question: str, turns: int) -> str:
    _type(page, "question", question)
    page.js("document.getElementById('ask-btn').click()")
    state = page.wait_for(
        f"document.querySelectorAll('#turns li.turn').length === {turns} && {TURN}.dataset.state !== 'streaming' "
        f"&& {TURN}.dataset.state",
        f"the answer to {question!r}",
    )
    assert state == "done", page.js(f"{TURN}.querySelector('.answer-status').textContent")
    return str(page.js(f"{TURN}.querySelector('.answer-text').textContent"))


def _chosen(page: Page) -> str:
    """The id of the collection the page's radio group has chosen ('' : the ticked documents)."""
    return str(page.js("document.querySelector('#collection-list .collection-pick:checked').value"))


def test_page_creates_a_collection_uploads_into_it_and_asks_it(
    server: ThreadServer, client: httpx.Client, browser: Browser, tmp_path: Path
) -> None:
    page = browser.page
    open_page(page, server.url + "/")
    assert _chosen(page) == ""
    assert page.js("document.getElementById('ask-target').textContent").startswith("Asking: the ticked documents")
    assert page.js("document.getElementById('collection-panel').hidden") is True

    # Create a collection: it is listed, chosen, and questions go to it (said above the question box).
    _type(page, "collection-name", NAME)
    page.js("document.querySelector('#collection-form button[type=submit]').click()")
    cid = page.wait_for("document.querySelector('#collection-list .collection-pick:checked').value",
                        "the new collection being chosen")
    assert client.get(f"/v1/collections/{cid}").json()["name"] == NAME
    item = f"document.querySelector('#collection-list li.collection[data-id=\"{cid}\"]')"
    assert page.js(f"{item}.querySelector('.collection-name').textContent") == NAME
    assert page.js("document.querySelectorAll('#collection-list b, .collections b').length") == 0
    assert page.js(f"{item}.querySelector('.collection-counts').textContent") == "0/0 ready"
    assert page.js("document.getElementById('collection-panel').hidden") is False
    assert page.js("document.getElementById('collection-name').value") == ""
    target = page.js("document.getElementById('ask-target').textContent")
    assert target == f"Asking: collection “{NAME}” (0 documents)", target

    # Upload two files through the collection's file input: one multipart request, with the collection's id.
    page.js(RECORD_UPLOADS)
    paths = [tmp_path / "varnholm.txt", tmp_path / "ostmark-crane.txt"]
    paths[0].write_text(LIGHTHOUSE, encoding="utf-8")
    paths[1].write_text(CRANE, encoding="utf-8")
    root = page.call("DOM.getDocument")["root"]["nodeId"]
    node = page.call("DOM.querySelector", nodeId=root, selector="#collection-file-input")["nodeId"]
    page.call("DOM.setFileInputFiles", files=[str(p) for p in paths], nodeId=node)
    assert page.js("window.__uploads") == [{"files": ["varnholm.txt", "ostmark-crane.txt"], "collection_id": cid}]

    # Both are listed under the collection and followed until indexed (the page polls the collection's documents).
    page.wait_for(f"{COLLECTION_DOCS}.length === 2 && [...{COLLECTION_DOCS}].every((li) => "
                  "!li.dataset.id.startsWith('col-upload-'))", "the server accepting both files")
    statuses = page.wait_for(
        f"[...{COLLECTION_DOCS}].every((li) => ['ready', 'failed'].includes(li.dataset.status)) && "
        f"[...{COLLECTION_DOCS}].map((li) => li.dataset.status)",
        "both files being indexed",
    )
    assert statuses == ["ready", "ready"], page.snapshot()
    docs = page.js(f"[...{COLLECTION_DOCS}].map((li) => [li.dataset.id, li.querySelector('.doc-title').textContent])")
    titles = {title: doc_id for doc_id, title in docs}
    assert set(titles) == {"varnholm.txt", "ostmark-crane.txt"}
    assert page.js(f"[...{COLLECTION_DOCS}].every((li) => li.querySelector('.doc-progress').hidden)")
    listed = client.get(f"/v1/collections/{cid}/documents").json()["data"]
    assert {d["id"] for d in listed} == set(titles.values())
    assert all(d["collection_ids"] == [cid] for d in listed)
    page.wait_for(f"{item}.querySelector('.collection-counts').textContent === '2/2 ready'", "the counts: 2/2 ready")
    assert page.js("document.getElementById('ask-target').textContent") == f"Asking: collection “{NAME}” (2 documents)"
    # the library lists them too, unticked: the question goes to the collection, not to ticked documents
    library = "document.querySelectorAll('#doc-list li.doc')"
    page.wait_for(f"{library}.length === 2", "the library listing the uploads")
    assert page.js(f"[...{library}].every((li) => !li.querySelector('.doc-check').checked)")

    # 400 px wide, with the collection's panel open: nothing overflows sideways
    page.call("Emulation.setDeviceMetricsOverride", width=400, height=800, deviceScaleFactor=1, mobile=False)
    try:
        assert page.js("document.documentElement.scrollWidth") <= 400
    finally:
        page.call("Emulation.clearDeviceMetricsOverride")

    # Ask the collection: a streamed answer whose sources carry the files' titles.
    page.js("document.getElementById('max-tokens').value = '16'; document.getElementById('mode').value = 'auto'")
    page.call("Runtime.evaluate", expression="document.getElementById('new-conversation').click()")
    answer = _ask(page, "Who built the lighthouse of Varnholm?", 1)
    assert answer.strip()
    sources = page.js(
        f"""Array.from({TURN}.querySelectorAll('.source')).map((li) => ({{
              doc: li.dataset.documentId, title: li.querySelector('.source-title').textContent,
              text: li.querySelector('.source-text').textContent}}))"""
    )
    assert sources, "no sources were shown"
    assert all(s["title"] in titles and titles[s["title"]] == s["doc"] for s in sources), sources
    assert any(s["title"] == "varnholm.txt" and "Kessling" in s["text"] for s in sources), sources
    stats = page.js(
        f"Object.fromEntries(Array.from({TURN}.querySelectorAll('.stats .stat'))"
        ".map((d) => [d.querySelector('dt').textContent, d.querySelector('dd').textContent]))"
    )
    assert stats["Documents"] == "2" and stats["Context"] in {"whole documents", "best chunks"}, stats
    page.screenshot(tmp_path / "collection-answer.png")
    session_id = page.js("RagspecPage.state.sessionId")
    kept = client.get(f"/v1/sessions/{session_id}").json()["turns"]
    assert [(t["documents"], t["collection_ids"]) for t in kept] == [([], [cid])]  # the collection, not documents

    # A reload resumes the conversation and asks its collection again; a follow-up keeps it.
    open_page(page, server.url + "/")
    assert page.js("document.querySelectorAll('#turns li.turn').length") == 1
    page.wait_for(f"document.querySelector('#collection-list .collection-pick:checked').value === '{cid}'",
                  "the conversation's collection being chosen again")
    page.wait_for(f"{COLLECTION_DOCS}.length === 2", "the collection's documents being listed again")
    page.js("document.getElementById('max-tokens').value = '8'")
    _ask(page, "When was it automated?", 2)
    kept = client.get(f"/v1/sessions/{session_id}").json()["turns"]
    assert [t["collection_ids"] for t in kept] == [[cid], [cid]]

    # Remove a document from the collection: it leaves the collection (and the count), not the library.
    crane = f"[...{COLLECTION_DOCS}].find((li) => li.querySelector('.doc-title').textContent === 'ostmark-crane.txt')"
    page.js(f"{crane}.querySelector('.doc-remove').click()")
    page.wait_for(f"{COLLECTION_DOCS}.length === 1 && "
                  f"{item}.querySelector('.collection-counts').textContent === '1/1 ready'", "the removal")
    assert page.js("document.getElementById('ask-target').textContent") == f"Asking: collection “{NAME}” (1 document)"
    assert [d["id"] for d in client.get(f"/v1/collections/{cid}/documents").json()["data"]] == [titles["varnholm.txt"]]
    assert client.get(f"/v1/documents/{titles['ostmark-crane.txt']}").status_code == 200

    # Ticking a library document asks the ticked documents instead.
    page.js(f"document.querySelector('#doc-list li.doc[data-id=\"{titles['ostmark-crane.txt']}\"] .doc-check').click()")
    assert _chosen(page) == ""
    assert page.js("document.getElementById('ask-target').textContent") == "Asking: the ticked documents (1 document)"
    assert page.js("document.getElementById('collection-panel').hidden") is True

    # Delete the collection (two clicks); its documents stay in the library.
    page.js(f"{item}.querySelector('.collection-pick').click()")
    assert _chosen(page) == cid
    page.js("document.getElementById('collection-delete').click()")
    assert page.js("document.getElementById('collection-delete').textContent") == "Confirm delete"
    assert client.get(f"/v1/collections/{cid}").status_code == 200
    page.js("document.getElementById('collection-delete').click()")
    page.wait_for(f"!{item}", "the collection leaving the list")
    assert client.get(f"/v1/collections/{cid}").status_code == 404
    assert _chosen(page) == ""
    assert page.js("document.getElementById('ask-target').textContent").startswith("Asking: the ticked documents")
    assert {d["id"] for d in client.get("/v1/documents").json()["documents"]} == set(titles.values())
    assert page.exceptions() == []


def test_a_failed_upload_into_a_collection_shows_as_text(
    server: ThreadServer, client: httpx.Client, browser: Browser, tmp_path: Path
) -> None:
    """One bad file refuses the whole request: every file of it shows the service's error, dismissed in one click."""
    page = browser.page
    created = client.post("/v1/collections", json={"name": "Refusals"}).json()
    open_page(page, server.url + "/")
    item = f"document.querySelector('#collection-list li.collection[data-id=\"{created['id']}\"]')"
    page.wait_for(f"!!{item}", "the collection being listed")
    page.js(f"{item}.querySelector('.collection-pick').click()")
    good, bad = tmp_path / "fine.txt", tmp_path / "<i>empty.txt"
    good.write_text("Owls hunt at night.", encoding="utf-8")
    bad.write_text("", encoding="utf-8")
    root = page.call("DOM.getDocument")["root"]["nodeId"]
    node = page.call("DOM.querySelector", nodeId=root, selector="#collection-file-input")["nodeId"]
    page.call("DOM.setFileInputFiles", files=[str(good), str(bad)], nodeId=node)
    messages = page.wait_for(
        f"{COLLECTION_DOCS}.length === 2 && [...{COLLECTION_DOCS}].every((li) => li.dataset.status === 'failed') && "
        f"[...{COLLECTION_DOCS}].map((li) => li.querySelector('.doc-message').textContent)",
        "the refused upload being shown",
    )
    assert all(m.startswith("Upload failed:") for m in messages), messages
    assert page.js("document.querySelectorAll('#collection-doc-list i').length") == 0
    assert client.get(f"/v1/collections/{created['id']}").json()["document_counts"]["total"] == 0
    page.js(f"{COLLECTION_DOCS}[0].querySelector('.doc-remove').click()")
    assert page.js(f"{COLLECTION_DOCS}.length") == 1
    assert page.exceptions() == []
