"""Questions over collections in the retrieval library: the collection's index follows the catalogue (added, removed,
re-indexed, deleted documents; attribute filters), candidates are scored exactly as a named document's chunks, and a
process killed while it syncs leaves an index that the next one completes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from retrieval.collection_index import CollectionIndexConfig
from retrieval.embedding import Embedder
from retrieval.errors import CollectionNotFound
from retrieval.filters import parse_filter
from retrieval.library import CollectionIndexes
from retrieval.retriever import Retriever
from retrieval.store import DocumentStore
from tests.retrieval.test_retriever import ANIMALS, SPACE

TOPICS = ["bread baking", "river fishing", "chess openings", "tax forms", "bicycle repair", "opera singing",
          "glacier melting", "coffee roasting", "railway signals", "knitting patterns", "volcano eruptions",
          "tennis serves"]


def distractor(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Notes number {i} about {topic}. This page describes {topic} in plain words, with tips on {topic} "
            f"that beginners ask about. Chapter {i} ends with a short list of books on {topic}.")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory, target_tokenizer: Any, minilm: Embedder) -> Any:
    root = tmp_path_factory.mktemp("library")
    store = DocumentStore(root)
    col = store.create_collection("zoo", "everything")
    animals = store.create("zoo", "Animals", "animals.txt", None, ANIMALS.encode(),
                           attributes={"topic": "animals", "year": 2024}, collection_ids=[col.id])
    space = store.create("zoo", "Space", "space.md", None, SPACE.encode(),
                         attributes={"topic": "space", "year": 2023}, collection_ids=[col.id])
    others = [store.create("zoo", f"Notes {i}", f"n{i}.txt", None, distractor(i).encode(),
                           attributes={"topic": "notes", "year": 2000 + i}, collection_ids=[col.id]) for i in range(24)]
    for record in (animals, space, *others):
        store.ingest(record.id, target_tokenizer, minilm, chunk_tokens=24)
    return store, col.id, animals.id, space.id, [r.id for r in others]


def indexes(store: DocumentStore, minilm: Embedder, tmp_path: Path, **config: Any) -> CollectionIndexes:
    return CollectionIndexes(tmp_path / "collections", store, minilm, CollectionIndexConfig(**config))


def test_a_collection_question_finds_what_the_named_document_finds(library: Any, minilm: Embedder,
                                                                   tmp_path: Path) -> None:
    store, col, animals, space, _ = library
    retriever = Retriever(store, minilm)
    lib = indexes(store, minilm, tmp_path)
    total = store.member_counts([col]).ready_tokens
    for question, doc in [("How long do parrots live?", animals), ("Why is Mars red?", space),
                          ("What causes the ocean tides?", space)]:
        named = retriever.rank([question], [doc]).relevant()
        over = retriever.rank_library([question], lib, [col], total_tokens=total, candidates=16).relevant()
        assert over.hits and named.hits
        best_named = max(named.hits, key=lambda h: h.score)
        best_over = max(over.hits, key=lambda h: h.score)
        assert (best_over.document_id, best_over.chunk_id) == (best_named.document_id, best_named.chunk_id)
        assert best_over.similarity == pytest.approx(best_named.similarity, abs=1e-6)  # the same fine scoring
    lib.close()


def test_filters_deletion_and_reindexing_follow_the_catalogue(library: Any, minilm: Embedder, tmp_path: Path,
                                                              target_tokenizer: Any) -> None:
    store, col, animals, space, others = library
    retriever = Retriever(store, minilm)
    lib = indexes(store, minilm, tmp_path)
    total = store.member_counts([col]).ready_tokens
    only_space = set(store.member_stamps([col], where=parse_filter({"type": "eq", "key": "topic", "value": "space"})))
    assert only_space == {space}
    hits = retriever.rank_library(["parrots"], lib, [col], total_tokens=total, allowed=only_space).hits
    assert hits and {h.document_id for h in hits} == {space}
    newer = set(store.member_stamps([col], where=parse_filter({"type": "gte", "key": "year", "value": 2020})))
    assert newer == {animals, space, *others[20:]}

    # taken out of the collection: gone from the next question, nothing else lost
    store.remove_from_collection(col, animals, "zoo")
    hits = retriever.rank_library(["How long do parrots live?"], lib, [col], total_tokens=total).hits
    assert animals not in {h.document_id for h in hits}
    assert store.get(animals).status == "ready"
    store.add_to_collection(col, [animals], "zoo")
    hits = retriever.rank_library(["How long do parrots live?"], lib, [col], total_tokens=total).hits
    assert max(hits, key=lambda h: h.score).document_id == animals

    # re-indexed with other chunks: the index holds the new ones only
    store.ingest(space, target_tokenizer, minilm, chunk_tokens=12)
    hits = retriever.rank_library(["Why is Mars red?"], lib, [col], total_tokens=total).hits
    chunks = store.load_chunks(space)
    assert all(h.text == chunks[h.chunk_id].text for h in hits if h.document_id == space)
    with lib.synced(col) as index:
        assert index.documents()[space] == store.get(space).updated_at
    lib.close()


def test_deleted_documents_and_collections(tmp_path: Path, target_tokenizer: Any, minilm: Embedder) -> None:
    store = DocumentStore(tmp_path / "store")
    col = store.create_collection("t", "c")
    a = store.create("t", "A", "a.txt", None, ANIMALS.encode(), collection_ids=[col.id])
    b = store.create("t", "B", "b.txt", None, SPACE.encode(), collection_ids=[col.id])
    for r in (a, b):
        store.ingest(r.id, target_tokenizer, minilm, chunk_tokens=24)
    retriever = Retriever(store, minilm)
    lib = indexes(store, minilm, tmp_path)
    assert {h.document_id for h in retriever.rank_library(["parrots"], lib, [col.id], total_tokens=100).hits} \
        == {a.id, b.id}
    store.delete(a.id)
    assert {h.document_id for h in retriever.rank_library(["parrots"], lib, [col.id], total_tokens=100).hits} \
        == {b.id}
    store.delete_collection(col.id)
    with pytest.raises(CollectionNotFound):
        retriever.rank_library(["parrots"], lib, [col.id], total_tokens=100)
    lib.forget(col.id)
    assert not (tmp_path / "collections" / col.id).exists()
    lib.close()


def _sync_forever(root: str, db_root: str, col: str) -> None:  # a child process: syncs, to be killed mid-way
    from retrieval.embedding import load_embedder

    store = DocumentStore(Path(db_root))
    lib = CollectionIndexes(Path(root), store, load_embedder("bundled", device="cpu"), save_after_s=0.0)
    while True:
        lib.sync(col)
        with lib.synced(col) as index:
            index.set_synced_version(-1)  # sync again and again: add and remove documents in a loop
            for doc_id in list(index.documents())[:2]:
                index.remove(doc_id)


def test_a_process_killed_while_syncing_leaves_an_index_the_next_one_completes(library: Any, minilm: Embedder,
                                                                              tmp_path: Path) -> None:
    store, col, animals, _, _ = library
    root = tmp_path / "collections"
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_sync_forever, args=(str(root), str(store.root), col))
    child.start()
    deadline = time.monotonic() + 120
    while not (root / col / "vectors").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    lib = CollectionIndexes(root, store, minilm)
    with lib.synced(col) as index:
        assert index.documents() == store.member_stamps([col])
        assert index.n_live == sum(store.get(d).n_chunks for d in index.documents())
    retriever = Retriever(store, minilm)
    total = store.member_counts([col]).ready_tokens
    hits = retriever.rank_library(["How long do parrots live?"], lib, [col], total_tokens=total).hits
    assert max(hits, key=lambda h: h.score).document_id == animals
    lib.close()
