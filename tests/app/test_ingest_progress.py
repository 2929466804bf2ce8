"""Indexing progress moves with the work: per embedding batch in GET /v1/documents/{id} and on the page.

A document of several embedding batches is indexed by the module's real server while a client polls it;
the server's embedder pauses after each batch (``tests/app/slow_indexing.py``) so that every step can be
seen. The page is checked in headless Chromium: its progress bar takes the intermediate values.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from retrieval.embedding import DEFAULT_BATCH_SIZE
from tests.app.browser import Browser, open_browser
from tests.app.live import DEADLINE_S, ThreadServer, upload_text
from tests.app.slow_indexing import long_text, slow_indexing

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]

EMBEDDING = re.compile(r"^embedding passages: (\d+) of (\d+)$")


def watch(client: httpx.Client, doc_id: str, every_s: float = 0.05) -> list[dict[str, Any]]:
    """Every record the document showed while polled, until it left queued / indexing."""
    seen: list[dict[str, Any]] = []
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        record = client.get(f"/v1/documents/{doc_id}").json()
        seen.append(record)
        if record["status"] not in ("queued", "indexing"):
            return seen
        time.sleep(every_s)
    raise AssertionError(f"document {doc_id} was still indexing after {DEADLINE_S} s")


def test_api_progress_moves_per_embedding_batch(server: ThreadServer, client: httpx.Client) -> None:
    with slow_indexing(server, pause_s=0.4) as embedder:
        doc_id = upload_text(client, long_text(), title="Records")
        seen = watch(client, doc_id)
    final = seen[-1]
    assert (final["status"], final["progress"], final["message"]) == ("ready", 1.0, None)
    progress = [r["progress"] for r in seen]
    assert progress == sorted(progress), f"progress went back: {progress}"
    embedding = [m.groups() for r in seen if r["message"] and (m := EMBEDDING.match(r["message"]))]
    totals = {int(total) for _, total in embedding}
    assert len(totals) == 1, totals
    total = totals.pop()
    batches = -(-total // DEFAULT_BATCH_SIZE)
    assert batches >= 4 and embedder.batches == batches  # a document of several batches
    done = sorted({int(d) for d, _ in embedding})
    # every batch shows (0 before the first, then one step per batch), each with its own progress value
    assert done == [min(k * DEFAULT_BATCH_SIZE, total) for k in range(batches + 1)], done
    inside = sorted({p for p in progress if 0 < p < 1})
    assert len(inside) >= batches, inside
    stages = [r["message"] for r in seen if r["status"] == "indexing"]
    assert stages.index(f"embedding passages: 0 of {total}") < stages.index(f"embedding passages: {total} of {total}")


# ---- the page ---------------------------------------------------------------------------------------

RECORDER = """
(() => {
  window.__progress = [];
  setInterval(() => {
    const li = [...document.querySelectorAll('#doc-list li.doc')]
      .find((el) => el.querySelector('.doc-title').textContent === 'records.txt');
    if (!li) return;
    const bar = li.querySelector('.doc-progress');
    window.__progress.push({
      status: li.dataset.status, hidden: bar.hidden, value: bar.hasAttribute('value') ? bar.value : null,
      message: li.querySelector('.doc-message').textContent,
    });
  }, 50);
  return true;
})()
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with open_browser() as b:
        yield b


def _choose_file(page: Any, path: Path, attempts: int = 3) -> None:
    """Set the page's file input to ``path`` (DevTools fires "change"; the page lists the upload at once). A node
    id read while the page was still settling can be stale, and then nothing happens: the input is looked up
    again and set again, until the upload is listed."""
    listed = ("[...document.querySelectorAll('#doc-list li.doc .doc-title')]"
              f".some((el) => el.textContent === {json.dumps(path.name)})")
    for attempt in range(attempts):
        root = page.call("DOM.getDocument")["root"]["nodeId"]
        input_node = page.call("DOM.querySelector", nodeId=root, selector="#file-input")["nodeId"]
        page.call("DOM.setFileInputFiles", files=[str(path)], nodeId=input_node)
        try:
            page.wait_for(listed, "the upload being listed", timeout=30.0)
            return
        except pytest.fail.Exception:
            if attempt == attempts - 1:
                raise


@pytest.mark.browser
def test_page_progress_bar_moves_while_indexing(server: ThreadServer, browser: Browser, tmp_path: Path) -> None:
    page = browser.page
    page.call("Page.navigate", url=server.url + "/")
    page.wait_for("document.documentElement.dataset.ready === '1'", "the page script starting")
    assert page.js(RECORDER)
    path = tmp_path / "records.txt"
    path.write_text(long_text(), encoding="utf-8")
    with slow_indexing(server, pause_s=0.8):  # the page polls every 700 ms
        _choose_file(page, path)
        page.wait_for(
            "window.__progress.length && ['ready', 'failed'].includes(window.__progress.at(-1).status)",
            "the upload being indexed",
        )
    samples: list[dict[str, Any]] = page.js("window.__progress")
    assert samples[-1]["status"] == "ready" and samples[-1]["hidden"], samples[-1]
    indexing = [s for s in samples if s["status"] == "indexing"]
    assert indexing and not any(s["hidden"] for s in indexing)
    values = [s["value"] for s in indexing]
    assert values == sorted(values), values
    shown = sorted({v for v in values if 0 < v < 1})
    assert len(shown) >= 3, f"the bar took {shown} while indexing: {json.dumps(indexing[:5])}"
    assert any(s["message"].startswith("embedding passages:") for s in indexing), indexing[-1]
    assert page.exceptions() == []
