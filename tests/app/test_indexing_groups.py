"""The indexing worker embeds documents queued together in one embedder call (many small files at once: full
batches), a group bounded by ``group_docs`` and ``group_bytes`` (a document failing in a group fails alone:
tests/retrieval/test_store.py). A real store, the bundled MiniLM and the target's tokenizer; the worker is held at
its first document until every upload is queued."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.serving.indexing import IndexingConfig, IndexingJobs
from retrieval.embedding import Embedder
from retrieval.store import DocumentStore
from tests.retrieval.conftest import minilm, target_tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.real_model


class GatedEmbedder:
    """Counts the documents' passages per call; the first call waits until the test opens the gate."""

    def __init__(self, inner: Embedder) -> None:
        self.inner, self.name, self.dim = inner, inner.name, inner.dim
        self.calls: list[int] = []
        self.gate = threading.Event()

    def encode(self, texts: Sequence[str], batch_size: int = 32, progress: Any = None) -> np.ndarray:
        self.gate.wait(30)
        self.calls.append(len(texts))
        return self.inner.encode(texts, batch_size, progress)

    def encode_query(self, text: str) -> np.ndarray:
        return self.inner.encode_query(text)


def run(tmp_path: Path, tokenizer: Any, embedder: GatedEmbedder, config: IndexingConfig,
        texts: list[bytes]) -> tuple[DocumentStore, list[str], list[str]]:
    store = DocumentStore(tmp_path / "store")
    ready: list[str] = []
    jobs = IndexingJobs(store, tokenizer, embedder, config, on_ready=ready.extend)  # type: ignore[arg-type]
    try:
        ids = []
        for i, data in enumerate(texts):
            ids.append(store.create("t", f"d{i}", f"d{i}.txt", "text/plain", data).id)
            jobs.submit(ids[-1])
        embedder.gate.set()
        end = time.monotonic() + 60
        while jobs.pending and time.monotonic() < end:
            time.sleep(0.02)
        assert jobs.pending == 0
    finally:
        jobs.stop()
    return store, ids, ready


def test_documents_queued_together_are_embedded_together(tmp_path: Path, target_tokenizer: Any,  # noqa: F811
                                                        minilm: Embedder) -> None:  # noqa: F811
    embedder = GatedEmbedder(minilm)
    texts = [f"Note {i} says the river froze in winter {i}.".encode() for i in range(10)]
    store, ids, ready = run(tmp_path, target_tokenizer, embedder, IndexingConfig(64, 0, group_docs=4), texts)
    assert [store.get(d).status for d in ids] == ["ready"] * 10 and sorted(ready) == sorted(ids)
    # the first document alone (the worker took it before the others came), then groups of at most 4
    assert len(embedder.calls) == 4 and sum(embedder.calls) == sum(store.get(d).n_chunks for d in ids)


def test_a_group_is_bounded_by_bytes(tmp_path: Path, target_tokenizer: Any,  # noqa: F811
                                                                   minilm: Embedder) -> None:  # noqa: F811
    embedder = GatedEmbedder(minilm)
    texts = [b"First.", b"A small note about tea.", b"x" * 3000, b"Another small note about coffee.", b"Last."]
    config = IndexingConfig(64, 0, group_docs=32, group_bytes=2000)
    store, ids, ready = run(tmp_path, target_tokenizer, embedder, config, texts)
    # [first] (taken before the others came), [tea] (with the next file the group would pass 2000 bytes), the
    # 3000-byte file alone, [coffee, last]
    assert len(embedder.calls) == 4, embedder.calls
    assert [store.get(d).status for d in ids] == ["ready"] * 5 and sorted(ready) == sorted(ids)
