"""A collection's index on synthetic vectors: exact and graph search against brute force, filters inside the search,
documents added and removed without a rebuild, compaction, snapshots and a snapshot older than the index's own
records (a crash between them), and FTS5 candidates whatever a question holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from retrieval.collection_index import CollectionIndex, CollectionIndexConfig, DocumentEntry, chunk_vectors
from retrieval.lexical import terms

DIM = 16
WORDS = ["alpha", "beta", "gamma", "delta", "renewal", "contract", "march", "report", "zeta", "omega"]


def clustered(rng: np.random.Generator, n: int) -> np.ndarray:
    centres = rng.standard_normal((8, DIM)).astype(np.float32)
    x = centres[rng.integers(0, 8, n)] + 0.3 * rng.standard_normal((n, DIM)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def entry(rng: np.random.Generator, n_chunks: int, doc: int) -> DocumentEntry:
    texts = [f"{WORDS[doc % len(WORDS)]} {WORDS[(doc + c) % len(WORDS)]} doc{doc} chunk{c}" for c in range(n_chunks)]
    return DocumentEntry(clustered(rng, n_chunks), [terms(t) for t in texts])


def build(tmp: Path, n_docs: int, chunks: int, config: CollectionIndexConfig,
          seed: int = 0) -> tuple[CollectionIndex, dict[str, DocumentEntry]]:
    rng = np.random.default_rng(seed)
    index = CollectionIndex.open(tmp, DIM, config)
    docs = {}
    for d in range(n_docs):
        docs[f"d{d}"] = entry(rng, chunks, d)
        index.add(f"d{d}", float(d), docs[f"d{d}"])
    return index, docs


def brute(docs: dict[str, DocumentEntry], q: np.ndarray, k: int,
          allowed: set[str] | None = None) -> list[tuple[str, int]]:
    scored = [(float(v @ q), d, c) for d, e in docs.items() if allowed is None or d in allowed
              for c, v in enumerate(e.vectors)]
    scored.sort(key=lambda t: -t[0])
    return [(d, c) for _, d, c in scored[:k]]


def recall(got: list[tuple[str, int, float]], want: list[tuple[str, int]]) -> float:
    return len({(d, c) for d, c, _ in got} & set(want)) / max(len(want), 1)


GRAPH = CollectionIndexConfig(exact_max=200, exact_share=0.02, hnsw_m=16, hnsw_ef_construction=80, ef_search=64)


def test_chunk_vectors_are_the_normalized_mean_of_their_windows() -> None:
    w = np.array([[1, 0], [0, 1], [1, 0], [0, 0]], dtype=np.float32)
    got = chunk_vectors(w, np.array([0, 0, 1, 2]), 4)
    np.testing.assert_allclose(got[0], [2**-0.5, 2**-0.5], rtol=1e-6)
    np.testing.assert_allclose(got[1], [1, 0])
    assert not got[2].any() and not got[3].any()  # a zero window, a chunk without windows: zero


def test_flat_search_is_exact_and_respects_allowed(tmp_path: Path) -> None:
    index, docs = build(tmp_path, 20, 10, CollectionIndexConfig())
    assert index.kind == "flat"
    rng = np.random.default_rng(1)
    for q in clustered(rng, 5):
        got = index.search(q, 10)
        assert [(d, c) for d, c, _ in got] == brute(docs, q, 10)
        allowed = {"d3", "d7"}
        got = index.search(q, 10, allowed)
        assert {d for d, _, _ in got} <= allowed and len(got) == 10
        assert [(d, c) for d, c, _ in got] == brute(docs, q, 10, allowed)


def test_graph_search_recall_with_and_without_filters(tmp_path: Path) -> None:
    index, docs = build(tmp_path, 100, 30, GRAPH)  # 3,000 vectors: HNSW above exact_max
    assert index.kind == "hnsw"
    rng = np.random.default_rng(2)
    queries = clustered(rng, 20)
    assert np.mean([recall(index.search(q, 10), brute(docs, q, 10)) for q in queries]) >= 0.95
    ten_percent = {f"d{i}" for i in range(0, 100, 10)}  # 300 rows: above exact_max, above exact_share -> graph
    one_percent = {"d42"}  # 30 rows: exact
    for allowed in (ten_percent, one_percent):
        results = [index.search(q, 10, allowed) for q in queries]
        assert all(len(r) == 10 and {d for d, _, _ in r} <= allowed for r in results)
        assert np.mean([recall(r, brute(docs, q, 10, allowed)) for r, q in zip(results, queries, strict=True)]) >= 0.95


def test_removal_is_immediate_and_compaction_drops_dead_vectors(tmp_path: Path) -> None:
    index, docs = build(tmp_path, 40, 10, GRAPH)
    q = docs["d5"].vectors[3]
    assert index.search(q, 1)[0][:2] == ("d5", 3)
    assert index.remove("d5") and not index.remove("d5")
    assert all(d != "d5" for d, _, _ in index.search(q, 50))
    assert all(d != "d5" for d, _ in index.lexical(["doc5"], 50))
    assert index.n_vectors == 400  # dead until compaction
    for d in range(6, 16):  # a quarter dead: due for compaction, which the owner runs off the question path
        index.remove(f"d{d}")
    assert index.needs_compaction() and index.n_vectors == 400 and index.n_live == 290
    assert all(d not in {f"d{i}" for i in range(5, 16)} for d, _, _ in index.search(q, 100))  # dead rows skipped
    index.compact()
    assert index.n_vectors == index.n_live == 290 and not index.needs_compaction()
    del docs["d5"]
    for d in range(6, 16):
        del docs[f"d{d}"]
    for q in clustered(np.random.default_rng(3), 5):
        assert recall(index.search(q, 10), brute(docs, q, 10)) >= 0.9
    # re-adding a document replaces it (a new slot)
    index.add("d1", 99.0, docs["d2"])
    assert index.documents()["d1"] == 99.0
    got = index.search(docs["d2"].vectors[0], 2)
    assert {d for d, _, _ in got} == {"d1", "d2"}


def test_a_snapshot_older_than_the_records_is_completed_at_open(tmp_path: Path) -> None:
    index, docs = build(tmp_path, 10, 5, CollectionIndexConfig())
    index.save()
    rng = np.random.default_rng(4)
    late = entry(rng, 5, 77)
    index.add("late", 1.0, late)  # recorded in SQLite, not in the snapshot (a crash before the next save)
    index.remove("d0")
    index.close()
    asked: list[str] = []

    def reload(doc_id: str, stamp: float) -> DocumentEntry | None:
        asked.append(doc_id)
        return late if doc_id == "late" else None

    again = CollectionIndex.open(tmp_path, DIM, CollectionIndexConfig(), reload=reload)
    assert asked == ["late"]
    assert set(again.documents()) == {f"d{i}" for i in range(1, 10)} | {"late"}
    assert again.search(late.vectors[2], 1)[0][:2] == ("late", 2)
    assert all(d != "d0" for d, _, _ in again.search(docs["d0"].vectors[0], 60))
    # a document whose files are gone at open is dropped from the index, FTS rows too
    again.close()
    gone = CollectionIndex.open(tmp_path, DIM, CollectionIndexConfig(), reload=lambda d, s: None)
    assert "late" not in gone.documents() and gone.lexical(["doc77"], 5) == []


def test_a_damaged_snapshot_is_rebuilt_from_the_documents(tmp_path: Path) -> None:
    index, docs = build(tmp_path, 4, 3, CollectionIndexConfig())
    index.save()
    index.close()
    (tmp_path / "vectors" / "vectors.faiss").write_bytes(b"garbage")
    again = CollectionIndex.open(tmp_path, DIM, CollectionIndexConfig(), reload=lambda d, s: docs[d])
    assert set(again.documents()) == set(docs)
    assert again.search(docs["d2"].vectors[1], 1)[0][:2] == ("d2", 1)


@pytest.mark.parametrize("question", ['"renewal', 'contract* AND NEAR(march report)', "-march: report OR",
                                      "renewal's \"contract\" (march)", "^zeta + omega", "NOT AND OR NEAR"])
def test_lexical_candidates_take_any_question(tmp_path: Path, question: str) -> None:
    index, _ = build(tmp_path, 10, 4, CollectionIndexConfig())
    got = index.lexical(terms(question), 5)
    assert isinstance(got, list)
    if {"renewal", "contract", "march", "report", "zeta", "omega"} & set(terms(question)):
        assert got


def test_lexical_candidates_and_stats_follow_the_allowed_documents(tmp_path: Path) -> None:
    index, docs = build(tmp_path, 30, 4, CollectionIndexConfig())
    got = index.lexical(["renewal"], 100)
    assert got and all(d in {f"d{i}" for i in range(30)} for d, _ in got)
    assert {d for d, _ in index.lexical(["renewal"], 100, {"d4", "d14"})} <= {"d4", "d14"}
    assert index.lexical(["renewal"], 100, {"d0"}) == []  # d0's chunks never say "renewal" (WORDS[0..3])
    stats = index.term_stats(["renewal", "nowhere"])
    assert stats.n_chunks == 120 and stats.df["nowhere"] == 0
    assert stats.df["renewal"] == sum(1 for e in docs.values() for t in e.terms if "renewal" in t)


def test_the_most_common_terms_leave_a_candidate_search_past_its_postings_budget(tmp_path: Path) -> None:
    index, _ = build(tmp_path, 30, 4, CollectionIndexConfig(lexical_postings=10))
    stats = index.term_stats(["renewal", "doc7"])
    assert stats.df["renewal"] > 10 >= stats.df["doc7"]
    got = index.lexical(["renewal", "doc7"], 50)  # "renewal" is in too many chunks: only doc7's are searched
    assert got and {d for d, _ in got} == {"d7"}
    assert index.lexical(["renewal"], 50)  # the rarest term always stays
