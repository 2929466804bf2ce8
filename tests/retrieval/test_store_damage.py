"""Damaged index files of a ready document: every reader of ``derived/`` answers ``IndexDamaged`` naming
the document and ``ragspec reindex <id>``, never a server path; re-indexing repairs it. PDFs over the
page cap are refused before any page's text is read."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from retrieval.embedding import Embedder
from retrieval.errors import IndexDamaged, TooManyPages
from retrieval.parsing import parse_document
from retrieval.retriever import Retriever
from retrieval.store import DocumentStore
from tests.conftest import make_pdf

TEXT = "\n\n".join(f"Part {i}. The tower number {i} stands {i * 10} metres tall near the river." for i in range(8))

# file under derived/ -> bytes that damage it
DAMAGE: dict[str, bytes] = {
    "chunks.jsonl": b'{"id": 0, "start": 0, "te',
    "tokens.npy": b"\x93NUMPY garbage",
    "passages.npy": b"not numpy at all",
    "lexical.npz": b"PK\x03\x04 truncated",
    "index/index.faiss": b"\x00garbage" * 8,
    "index/index.json": b"{not json",
}
READERS: dict[str, Callable[[DocumentStore, str, Embedder], Any]] = {
    "chunks.jsonl": lambda s, d, e: s.load_chunks(d),
    "tokens.npy": lambda s, d, e: s.load_token_ids(d),
    "passages.npy": lambda s, d, e: s.load_passages(d),
    "lexical.npz": lambda s, d, e: s.load_lexical(d),
    "index/index.faiss": lambda s, d, e: s.load_index(d, e),
    "index/index.json": lambda s, d, e: s.load_index(d, e),
}


@pytest.fixture
def store(tmp_path: Path) -> DocumentStore:
    return DocumentStore(tmp_path / "store", max_pdf_pages=3)


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_file_names_the_reindex_command_and_no_path(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder, name: str
) -> None:
    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)
    (store.root / "docs" / record.id / "derived" / name).write_bytes(DAMAGE[name])
    with pytest.raises(IndexDamaged) as err:
        READERS[name](store, record.id, minilm)
    message = str(err.value)
    assert f"ragspec reindex {record.id}" in message
    assert str(store.root) not in message and "/" not in message.replace(f"ragspec reindex {record.id}", "")
    if name != "tokens.npy":  # the prompt builder reads those, not the retriever
        with pytest.raises(IndexDamaged):  # the same through the retriever, as a question meets it
            Retriever(store, minilm).retrieve("How tall is tower 3?", [record.id])
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)  # what `ragspec reindex` does
    assert Retriever(store, minilm).retrieve("How tall is tower 3?", [record.id]).hits


def test_pdf_pages_are_counted_before_any_is_read(monkeypatch: pytest.MonkeyPatch, store: DocumentStore) -> None:
    from pypdf import PageObject

    def no_reading(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("a page's text was read before the page count was checked")

    data = make_pdf([f"Page {i}" for i in range(5)])
    with monkeypatch.context() as patch:
        patch.setattr(PageObject, "extract_text", no_reading)
        with pytest.raises(TooManyPages, match="the PDF has 5 pages; at most 3 are accepted"):
            store.create(None, None, "long.pdf", "application/pdf", data)
    assert store.list() == []  # nothing stored
    assert parse_document(data, "long.pdf", max_pages=5).pages is not None  # at the cap: accepted
