from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrieval.chunking import tokenize
from retrieval.embedding import DEFAULT_BATCH_SIZE, Embedder, Progress
from retrieval.errors import (
    REINDEX_COMMAND,
    DocumentNotFound,
    DocumentNotReady,
    EmbedderMismatch,
    EmptyDocument,
    RetrievalError,
    UnreadableDocument,
    UnsupportedDocumentType,
)
from retrieval.index import VectorIndex
from retrieval.store import INTERRUPTED, DocumentStore
from tests.conftest import REPO, CountingEmbedder, make_pdf

TEXT = "\n\n".join(
    f"Section {i}. " + " ".join(f"Sentence {j} of section {i} is about topic {i * 7 + j}." for j in range(6))
    for i in range(5)
)


class ExplodingEmbedder:
    """Delegates to a real embedder and raises after the first batch (a failure mid-ingest)."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim

    def encode(self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE,
               progress: Progress | None = None) -> np.ndarray:
        self.inner.encode(texts[:batch_size], batch_size=batch_size, progress=progress)
        raise RuntimeError("embedding device lost")

    def encode_query(self, text: str) -> np.ndarray:
        return self.inner.encode_query(text)


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "tmp").rglob("*"))


@pytest.fixture
def store(tmp_path: Path) -> DocumentStore:
    return DocumentStore(tmp_path / "store")


def test_create_ingest_and_load(store: DocumentStore, target_tokenizer: Any, minilm: Embedder) -> None:
    record = store.create("acme", "Topics", "topics.txt", "text/plain", TEXT.encode())
    assert (record.status, record.tenant, record.title, record.kind, record.size) == (
        "queued", "acme", "Topics", "txt", len(TEXT.encode()))
    seen: list[float] = []
    ready = store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64, progress=seen.append)
    assert ready.status == "ready" and ready.progress == 1.0 and ready.embedder == minilm.name
    assert seen == sorted(seen) and seen[-1] == 1.0
    chunks = store.load_chunks(record.id)
    assert len(chunks) == ready.n_chunks > 1 and all(c.n_tokens <= 64 for c in chunks)
    assert "".join(c.text for c in chunks) == TEXT == store.load_text(record.id)
    ids = store.load_token_ids(record.id)
    assert ids.dtype == np.int32 and list(ids) == list(tokenize(TEXT, target_tokenizer).ids)
    assert ready.n_tokens == len(ids)
    index = store.load_index(record.id, minilm)
    passages = store.load_passages(record.id)  # the indexed windows: chunk id, start, end
    assert passages is not None and len(index) == len(passages) >= len(chunks)
    assert set(passages[:, 0]) == {c.id for c in chunks}
    for chunk_id, start, end in passages:
        chunk = chunks[chunk_id]
        assert chunk.start <= start < end <= chunk.end
    window = int(np.flatnonzero(passages[:, 0] == 2)[0])
    _, hit = index.search(minilm.encode([TEXT[passages[window, 1] : passages[window, 2]]]), 1)
    assert hit[0, 0] == window
    lexical = store.load_lexical(record.id)
    assert lexical is not None and lexical.n_chunks == len(chunks)
    assert store.stale(minilm) == []
    assert store.list("acme") == [ready] and store.list("other") == [] and store.list() == [ready]
    assert leftovers(store.root) == []


def test_pdf_chunks_know_their_page(store: DocumentStore, target_tokenizer: Any, minilm: Embedder) -> None:
    pages = [f"Page {n} is about {word}. " * 12 for n, word in [(1, "apples"), (2, "pears"), (3, "plums")]]
    record = store.create(None, None, "fruit.pdf", "application/pdf", make_pdf(pages, title="Fruit"))
    assert record.tenant == "default" and record.title == "Fruit"
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=48)
    chunks = store.load_chunks(record.id)
    assert {c.page for c in chunks} == {1, 2, 3}
    for c in chunks:
        assert f"Page {c.page}" in c.text


@pytest.mark.parametrize(
    ("data", "filename", "error"),
    [(b"", "a.txt", EmptyDocument), (b"\x00\x01binary" * 10, "a.txt", UnreadableDocument),
     (b"\x89PNG\r\n", "image.png", UnsupportedDocumentType)],
)
def test_bad_input_leaves_nothing(store: DocumentStore, data: bytes, filename: str, error: type) -> None:
    with pytest.raises(error):
        store.create(None, None, filename, None, data)
    assert store.list() == [] and list((store.root / "docs").iterdir()) == [] and leftovers(store.root) == []


def test_tenants_and_unknown_ids(store: DocumentStore) -> None:
    record = store.create("t1", "Doc", "a.md", None, b"# Title\n\nbody")
    assert store.get(record.id, "t1") == store.get(record.id) == record
    for call in (lambda: store.get(record.id, "t2"), lambda: store.delete(record.id, "t2"),
                 lambda: store.get("0" * 32), lambda: store.get("../etc"), lambda: store.load_text("nope")):
        with pytest.raises(DocumentNotFound):
            call()
    with pytest.raises(DocumentNotReady, match="queued"):
        store.load_chunks(record.id)
    store.delete(record.id, "t1")
    with pytest.raises(DocumentNotFound):
        store.get(record.id)
    assert list((store.root / "docs").iterdir()) == [] and leftovers(store.root) == []


def test_failure_mid_embedding_leaves_no_partial_files(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder
) -> None:
    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    with pytest.raises(RuntimeError, match="device lost"):
        store.ingest(record.id, target_tokenizer, ExplodingEmbedder(minilm), chunk_tokens=32, batch_size=2)
    failed = store.get(record.id)
    assert failed.status == "failed" and "device lost" in (failed.message or "")
    assert not (store.root / "docs" / record.id / "derived").exists() and leftovers(store.root) == []
    assert store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=32).status == "ready"


def test_failed_reindex_keeps_the_previous_index(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)
    before = [c.text for c in store.load_chunks(record.id)]
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if str(src).endswith("derived") and "tmp" in str(src):
            raise OSError("disk full")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="disk full"):
        store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=32)
    monkeypatch.undo()
    assert store.get(record.id).status == "failed" and leftovers(store.root) == []
    derived = store.root / "docs" / record.id / "derived"
    assert (derived / "chunks.jsonl").read_text().count("\n") == len(before)  # old files intact


def test_crash_mid_ingest_then_recover(store: DocumentStore, target_tokenizer: Any, minilm: Embedder) -> None:
    """A real crash: a child process dies (os._exit) while writing the index; recover() cleans up."""
    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    child = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        import numpy as np
        from tokenizers import Tokenizer
        import retrieval.index
        from retrieval.embedding import bundled_embedder_path
        from retrieval.store import DocumentStore

        class Embedder:
            name, dim = "fake", 4
            def encode(self, texts, batch_size=32, progress=None):
                return np.full((len(texts), 4), 0.5, dtype=np.float32)
            def encode_query(self, text):
                return np.full(4, 0.5, dtype=np.float32)

        def crash(self, directory):
            directory.mkdir(parents=True)
            (directory / "index.faiss").write_bytes(b"half an ind")
            os._exit(9)

        class FastTokenizer:  # the HF call interface over `tokenizers` (importing transformers is slow)
            def __init__(self):
                self.backend = Tokenizer.from_file(str(bundled_embedder_path() / "tokenizer.json"))
            def __call__(self, text, **kwargs):
                enc = self.backend.encode(text, add_special_tokens=False)
                return {"input_ids": enc.ids, "offset_mapping": enc.offsets}

        retrieval.index.VectorIndex.save = crash
        tokenizer = FastTokenizer()
        DocumentStore(Path(sys.argv[1])).ingest(sys.argv[2], tokenizer, Embedder(), 32)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", child, str(store.root), record.id], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    restarted = DocumentStore(store.root)
    assert restarted.get(record.id).status == "indexing" and leftovers(store.root) != []
    (store.root / "docs" / ("f" * 32)).mkdir()  # a dir whose row never got written
    report = restarted.recover()
    assert report.failed == [record.id] and report.removed_temp >= 1 and report.removed_orphans == 1
    after = restarted.get(record.id)
    assert (after.status, after.message) == ("failed", INTERRUPTED)
    assert leftovers(store.root) == []
    assert sorted(p.name for p in (store.root / "docs").iterdir()) == [record.id]
    assert not (store.root / "docs" / record.id / "derived").exists()
    assert restarted.load_text(record.id) == TEXT  # the source survived: re-index works
    assert restarted.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64).status == "ready"


def test_queued_documents_are_failed_by_recover(store: DocumentStore) -> None:
    record = store.create(None, "t", "a.txt", None, b"some text")
    assert store.recover().failed == [record.id]
    assert store.get(record.id).message == INTERRUPTED


def test_other_embedder_is_a_mismatch(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder, tiny_bge_m3_dir: Path
) -> None:
    from retrieval.embedding import load_embedder

    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)
    other = load_embedder(str(tiny_bge_m3_dir), device="cpu")
    with pytest.raises(EmbedderMismatch, match=REINDEX_COMMAND.replace("-", "\\-")):
        store.load_index(record.id, other)
    assert [r.id for r in store.stale(other)] == [record.id] and store.stale(minilm) == []
    store.ingest(record.id, target_tokenizer, other, chunk_tokens=64)  # what `reindex --all` does
    assert len(store.load_index(record.id, other)) == store.get(record.id).n_chunks


def test_reads_while_ingesting_in_a_thread(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder
) -> None:
    ready = store.create(None, "ready", "a.txt", None, TEXT.encode())
    store.ingest(ready.id, target_tokenizer, minilm, chunk_tokens=64)
    pending = store.create(None, "pending", "b.txt", None, (TEXT * 3).encode())
    errors: list[BaseException] = []

    def work() -> None:
        try:
            store.ingest(pending.id, target_tokenizer, minilm, chunk_tokens=32, batch_size=4)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    statuses = set()
    while thread.is_alive():
        statuses.add(store.get(pending.id).status)
        assert len(store.load_chunks(ready.id)) == store.get(ready.id).n_chunks
        assert len(store.list()) == 2
    thread.join()
    assert errors == [] and store.get(pending.id).status == "ready"
    assert "indexing" in statuses


def test_documents_indexed_before_windows_and_bm25_are_stale_and_still_searchable(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder
) -> None:
    from retrieval.retriever import Retriever

    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)
    derived = store.root / "docs" / record.id / "derived"
    chunks = store.load_chunks(record.id)
    # what an older version wrote: one vector per chunk, no windows, no lexical index
    VectorIndex.build(minilm.encode([c.text for c in chunks]), embedder_name=minilm.name).save(derived / "index")
    (derived / "passages.npy").unlink()
    (derived / "lexical.npz").unlink()
    assert [r.id for r in store.stale(minilm)] == [record.id]
    hits = Retriever(store, minilm, threshold=-1.0).retrieve("topic", [record.id], top_k=50).hits
    assert len(hits) == len(chunks) and all(h.score == pytest.approx(0.85 * h.similarity) for h in hits)
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)  # what `ragspec reindex` does
    assert store.stale(minilm) == [] and store.load_lexical(record.id) is not None


def test_a_corrupt_lexical_index_is_a_clear_error(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder
) -> None:
    from retrieval.retriever import Retriever

    record = store.create(None, "t", "a.txt", None, TEXT.encode())
    store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=64)
    (store.root / "docs" / record.id / "derived" / "lexical.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(RetrievalError, match=r"lexical index lexical\.npz is unreadable") as err:
        Retriever(store, minilm).retrieve("topic", [record.id])
    assert str(store.root) not in str(err.value)  # no server path in what a client may see


def test_ingest_many_embeds_the_documents_together_each_failing_alone(
    store: DocumentStore, target_tokenizer: Any, minilm: Embedder
) -> None:
    texts = [f"Document {i} is about {topic}. " * 9 for i, topic in enumerate(["tea", "coffee", "cocoa"])]
    alone = store.create("acme", "alone", "alone.txt", "text/plain", texts[0].encode())
    store.ingest(alone.id, target_tokenizer, minilm, chunk_tokens=32)
    records = [store.create("acme", f"d{i}", f"d{i}.txt", "text/plain", t.encode()) for i, t in enumerate(texts)]
    empty = store.create("acme", "blank", "blank.txt", "text/plain", b"Soon blank.")
    (store._doc_dir(empty.id) / "source" / "text.txt").write_text("")  # its text has no token to index
    gone = store.create("acme", "gone", "gone.txt", "text/plain", b"Deleted before it was indexed.")
    store.delete(gone.id)
    counting = CountingEmbedder(minilm)
    order = [records[0].id, empty.id, records[1].id, gone.id, records[2].id]
    results = store.ingest_many(order, target_tokenizer, counting, chunk_tokens=32)  # type: ignore[arg-type]
    assert len(counting.calls) == 1  # one embedder call for every document's passages
    assert [type(r).__name__ for r in results] == [
        "DocumentRecord", "EmptyDocument", "DocumentRecord", "DocumentNotFound", "DocumentRecord"]
    assert [store.get(r.id).status for r in records] == ["ready"] * 3
    failed = store.get(empty.id)
    assert failed.status == "failed" and failed.message is not None and "no tokens" in failed.message
    # each document indexed as alone: the same chunks and windows, vectors equal up to the batch's padding
    assert store.load_chunks(records[0].id) == store.load_chunks(alone.id)
    passages = store.load_passages(records[0].id)
    assert passages is not None and np.array_equal(passages, store.load_passages(alone.id))
    together, single = store.load_index(records[0].id, minilm), store.load_index(alone.id, minilm)
    assert np.allclose(together.vectors(), single.vectors(), atol=1e-5)
    assert leftovers(store.root) == []


def test_ingest_many_an_embedder_error_fails_every_document(store: DocumentStore, target_tokenizer: Any) -> None:
    class Broken:
        name, dim = "broken", 8

        def encode(self, texts: Sequence[str], batch_size: int = 32, progress: Progress | None = None) -> np.ndarray:
            raise RuntimeError("the embedder fell over")

    records = [store.create("acme", f"d{i}", f"d{i}.txt", "text/plain", b"Some text to index.") for i in range(2)]
    results = store.ingest_many([r.id for r in records], target_tokenizer, Broken(), chunk_tokens=32)  # type: ignore[arg-type]
    assert all(isinstance(r, RuntimeError) for r in results)
    assert [(store.get(r.id).status, store.get(r.id).message) for r in records] == \
        [("failed", "RuntimeError: the embedder fell over")] * 2
    assert leftovers(store.root) == []
