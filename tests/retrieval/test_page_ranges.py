"""PDF chunks report their page range: ``page`` (first visible character) and ``page_end`` (last one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrieval.chunking import chunk_text
from retrieval.embedding import Embedder
from retrieval.store import DocumentStore
from tests.conftest import make_pdf


def _pages(page_texts: list[str]) -> tuple[str, list[tuple[int, int, int]]]:
    """Pages joined by a blank line, as the PDF parser joins them, with their (page, start, end) spans."""
    pages, pos = [], 0
    for no, t in enumerate(page_texts, start=1):
        pages.append((no, pos, pos + len(t)))
        pos += len(t) + 2
    return "\n\n".join(page_texts), pages


def test_a_chunk_spanning_pages_reports_its_last_page(target_tokenizer: Any) -> None:
    text, pages = _pages(["one two three.", "four five six.", "seven eight nine."])
    (chunk,) = chunk_text(text, target_tokenizer, max_tokens=512, pages=pages)
    assert (chunk.page, chunk.page_end) == (1, 3)


def test_page_ranges_follow_the_visible_text(target_tokenizer: Any) -> None:
    words = {1: "one", 2: "two", 3: "three"}
    text, pages = _pages([" ".join([w] * 60) for w in words.values()])
    chunks = chunk_text(text, target_tokenizer, max_tokens=40, pages=pages)
    for c in chunks:
        first, last = c.text.split()[0], c.text.split()[-1]
        assert (c.page, c.page_end) == (
            next(p for p, w in words.items() if w == first),
            next(p for p, w in words.items() if w == last),
        ), c
    # one page: its own range; no pages (not a PDF): no range
    assert chunk_text("abc def", target_tokenizer, pages=[(1, 0, 7)])[0].page_end == 1
    assert all(c.page_end is None for c in chunk_text(text, target_tokenizer, max_tokens=40))


def test_pdf_chunks_keep_their_range_through_the_store(
    tmp_path: Path, target_tokenizer: Any, minilm: Embedder
) -> None:
    store = DocumentStore(tmp_path / "store")
    pages = [f"Page {n} is about {word}. " * 3 for n, word in [(1, "apples"), (2, "pears"), (3, "plums")]]
    record = store.create(None, None, "fruit.pdf", "application/pdf", make_pdf(pages, title="Fruit"))
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=512)
    (chunk,) = store.load_chunks(record.id)
    assert (chunk.page, chunk.page_end) == (1, 3)

    # An index written before page ranges (chunks.jsonl without "page_end") still loads: the range is unknown.
    chunks_file = store.root / "docs" / record.id / "derived" / "chunks.jsonl"
    rows = [json.loads(line) for line in chunks_file.read_text(encoding="utf-8").splitlines()]
    assert all("page_end" in row for row in rows)
    chunks_file.write_text(
        "".join(json.dumps({k: v for k, v in row.items() if k != "page_end"}) + "\n" for row in rows),
        encoding="utf-8",
    )
    (old,) = DocumentStore(tmp_path / "store").load_chunks(record.id)
    assert (old.page, old.page_end) == (1, None)
