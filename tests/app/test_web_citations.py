"""Answers people can check, on the page in headless Chromium (tests/app/browser.py) against the real service:
[n] markers after the cited sentences link to their sources, each source marks the passage that supports the
answer (whole sentences, never the question's words), PDF sources show their page range, and a follow-up
question lists its sources."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.browser import Browser, Page, open_browser
from tests.app.live import LIGHTHOUSE, ThreadServer, upload_text, wait_indexed
from tests.conftest import make_pdf

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

CRANE = ["The harbour crane was built in 1921.", "It lifted ships of up to 80 tonnes.", "It was scrapped in 1988."]
TURN = "document.querySelector('#turns li.turn:last-child')"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


@pytest.fixture(scope="module")
def documents(client: httpx.Client) -> dict[str, str]:
    lighthouse = upload_text(client, LIGHTHOUSE, title="Varnholm")
    response = client.post("/v1/documents", files={"file": ("crane.pdf", make_pdf(CRANE), "application/pdf")})
    assert response.status_code == 202, response.text
    crane = response.json()["id"]
    for doc_id in (lighthouse, crane):
        assert wait_indexed(client, doc_id)["status"] == "ready"
    return {"lighthouse": lighthouse, "crane": crane}


def _open(page: Page, server: ThreadServer, tick: str) -> None:
    page.call("Page.navigate", url=server.url + "/")
    page.wait_for("document.documentElement.dataset.ready === '1'", "the page script starting")
    item = f"document.querySelector('#doc-list li.doc[data-id=\"{tick}\"]')"
    page.wait_for(f"{item} && {item}.dataset.status === 'ready'", "the document being listed as ready")
    page.js(
        "document.querySelectorAll('#doc-list .doc-check').forEach((c) => { if (c.checked) c.click(); }); "
        f"{item}.querySelector('.doc-check').click(); true"
    )
    page.js("document.getElementById('mode').value = 'auto'; document.getElementById('max-tokens').value = '40'")


def _ask(page: Page, question: str, turns: int) -> dict[str, Any]:
    page.call("Runtime.evaluate", expression="document.getElementById('question').focus()")
    page.call("Input.insertText", text=question)
    page.js("document.getElementById('ask-btn').click()")
    state = page.wait_for(
        f"document.querySelectorAll('#turns li.turn').length === {turns} && {TURN}.dataset.state !== 'streaming' "
        f"&& {TURN}.dataset.state",
        "the answer finishing",
    )
    assert state == "done", page.js(f"{TURN}.querySelector('.answer-status').textContent")
    return dict(page.js(
        f"""(() => {{
          const turn = {TURN};
          const answer = turn.querySelector('.answer-text');
          return {{
            text: answer.textContent,
            links: Array.from(answer.querySelectorAll('a.cite')).map((a) => ({{
              text: a.textContent, href: a.getAttribute('href'),
              before: a.previousSibling ? a.previousSibling.textContent : '',
            }})),
            sources: Array.from(turn.querySelectorAll('.source')).map((li) => ({{
              id: li.id, cited: li.classList.contains('cited'),
              meta: li.querySelector('.source-meta') ? li.querySelector('.source-meta').textContent : '',
              text: li.querySelector('.source-text').textContent,
              marks: Array.from(li.querySelectorAll('mark')).map((m) => m.textContent),
            }})),
            empty: turn.querySelectorAll('.source-list li.empty').length,
          }};
        }})()"""
    ))


def test_answers_link_citations_to_highlighted_sources(
    server: ThreadServer, client: httpx.Client, browser: Browser, documents: dict[str, str], tmp_path: Path
) -> None:
    page = browser.page
    _open(page, server, documents["lighthouse"])
    question = "Who built the lighthouse of Varnholm, and when?"
    shown = _ask(page, question, 1)

    # the page's answer is the service's answer (the same greedy tokens) with its [n] links after the sentences
    api = client.post("/v1/ask", json={"question": question, "document_ids": [documents["lighthouse"]],
                                       "max_tokens": 40}).json()
    assert api["citations"], api
    assert shown["text"] == api["cited_answer"]
    assert re.sub(r"\[\d+\]", "", shown["text"]) == api["answer"]
    assert [link["text"] for link in shown["links"]] == [f"[{c['source'] + 1}]" for c in api["citations"]]
    for link, c in zip(shown["links"], api["citations"], strict=True):
        n = c["source"] + 1
        assert link["href"] == f"#{shown['sources'][c['source']]['id']}"
        assert link["before"].endswith(api["answer"][c["start"] : c["end"]][-10:])
        assert shown["sources"][c["source"]]["cited"], f"source {n} is marked as cited"

    # highlights: the supporting sentences of the source, whole words, not the question's words
    marked = [(s["text"], m) for s in shown["sources"] for m in s["marks"]]
    assert marked
    for text, m in marked:
        assert len(m.split()) >= 3 and m in text
        start = text.index(m)
        assert not (start > 0 and text[start - 1].isalnum()) and not text[start + len(m) :][:1].isalnum()
    assert any("Kessling" in m for _, m in marked)

    # a [n] link opens its source and brings it into view
    page.js(f"{TURN}.querySelectorAll('.source details').forEach((d) => {{ d.open = false; }}); true")
    page.js(f"{TURN}.querySelector('.answer-text a.cite').click(); true")
    first = api["citations"][0]["source"]
    assert page.js(f"{TURN}.querySelectorAll('.source details')[{first}].open") is True
    page.screenshot(tmp_path / "citations.png")
    assert page.exceptions() == []


def test_follow_up_sources_and_pdf_page_ranges(
    server: ThreadServer, browser: Browser, documents: dict[str, str]
) -> None:
    page = browser.page
    _open(page, server, documents["lighthouse"])
    page.js("document.getElementById('new-conversation').click(); true")
    first = _ask(page, "Who built the lighthouse of Varnholm?", 1)
    assert first["sources"] and not first["empty"]
    follow_up = _ask(page, "And when was it automated?", 2)
    assert follow_up["sources"] and not follow_up["empty"], "the follow-up lists the sources it was answered from"
    assert any("automated" in s["text"] for s in follow_up["sources"])

    _open(page, server, documents["crane"])
    page.js("document.getElementById('new-conversation').click(); true")
    crane = _ask(page, "When was the harbour crane built and scrapped?", 1)
    (source,) = crane["sources"]
    assert "pp. 1–3" in source["meta"], source["meta"]
    assert json.dumps(page.exceptions()) == "[]"
