from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from retrieval.errors import REINDEX_COMMAND, EmbedderMismatch, RetrievalError
from retrieval.index import IndexConfig, VectorIndex, gpu_available

DIM = 24


def unit_vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :k]


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(t)) / len(t) for f, t in zip(found, truth, strict=True)]))


def test_flat_index_is_exact() -> None:
    vectors, queries = unit_vectors(300, 0), unit_vectors(20, 1)
    index = VectorIndex.build(vectors, embedder_name="e", config=IndexConfig(exact_max=1000))
    assert index.kind == "flat" and len(index) == 300
    scores, ids = index.search(queries, 5)
    np.testing.assert_array_equal(ids, exact_top_k(vectors, queries, 5))
    np.testing.assert_allclose(scores, np.take_along_axis(queries @ vectors.T, ids, axis=1), atol=1e-5)
    np.testing.assert_allclose(index.scores_all(queries[0]), vectors @ queries[0], atol=1e-5)


@pytest.mark.parametrize(("approximate", "n"), [("hnsw", 800), ("ivf", 2500)])
def test_approximate_index_above_threshold(approximate: str, n: int, tmp_path: Path) -> None:
    vectors, queries = unit_vectors(n, 2), unit_vectors(30, 3)
    config = IndexConfig(exact_max=200, approximate=approximate)  # type: ignore[arg-type]
    index = VectorIndex.build(vectors, embedder_name="e", config=config)
    assert index.kind == approximate and len(index) == n
    _, ids = index.search(queries, 10)
    assert recall(ids, exact_top_k(vectors, queries, 10)) >= 0.8
    np.testing.assert_allclose(index.scores_all(queries[0]), vectors @ queries[0], atol=1e-5)
    index.save(tmp_path / "ix")
    loaded = VectorIndex.load(tmp_path / "ix", embedder_name="e", dim=DIM, config=config)
    assert loaded.kind == approximate
    np.testing.assert_array_equal(loaded.search(queries, 10)[1], ids)


def test_save_load_round_trip_and_sidecar(tmp_path: Path) -> None:
    vectors = unit_vectors(50, 4)
    index = VectorIndex.build(vectors, embedder_name="model-a (flag, mean pooling)")
    index.save(tmp_path / "ix")
    sidecar = VectorIndex.read_sidecar(tmp_path / "ix")
    assert sidecar["embedder"] == "model-a (flag, mean pooling)" and sidecar["dim"] == DIM
    assert sidecar["count"] == 50 and sidecar["kind"] == "flat"
    loaded = VectorIndex.load(tmp_path / "ix", embedder_name="model-a (flag, mean pooling)", dim=DIM)
    np.testing.assert_array_equal(loaded.vectors(), vectors)
    loaded.add(unit_vectors(5, 5))
    assert len(loaded) == 55 and loaded.search(vectors[3], 1)[1][0, 0] == 3


def test_loading_with_another_embedder_is_a_clear_error(tmp_path: Path) -> None:
    VectorIndex.build(unit_vectors(10, 6), embedder_name="model-a").save(tmp_path / "ix")
    with pytest.raises(EmbedderMismatch) as info:
        VectorIndex.load(tmp_path / "ix", embedder_name="model-b", dim=DIM, doc_id="doc1")
    message = str(info.value)
    assert "model-a" in message and "model-b" in message and REINDEX_COMMAND in message and "doc1" in message
    with pytest.raises(EmbedderMismatch, match="dim 32"):
        VectorIndex.load(tmp_path / "ix", embedder_name="model-a", dim=32)


def test_missing_or_corrupt_index_files(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="missing"):
        VectorIndex.load(tmp_path / "nothing")
    VectorIndex.build(unit_vectors(10, 7), embedder_name="e").save(tmp_path / "ix")
    (tmp_path / "ix" / "index.faiss").write_bytes(b"not faiss")
    with pytest.raises(RetrievalError, match="unreadable"):
        VectorIndex.load(tmp_path / "ix", embedder_name="e")


def test_small_and_empty_searches() -> None:
    index = VectorIndex.build(unit_vectors(3, 8), embedder_name="e")
    _, ids = index.search(unit_vectors(1, 9), 5)
    assert ids.shape == (1, 5) and sorted(ids[0, :3]) == [0, 1, 2] and list(ids[0, 3:]) == [-1, -1]
    empty = VectorIndex.build(np.zeros((0, DIM), dtype=np.float32), embedder_name="e")
    assert empty.search(unit_vectors(1, 9), 2)[1].tolist() == [[-1, -1]]
    with pytest.raises(ValueError, match="dimension"):
        index.search(np.ones(DIM + 1, dtype=np.float32), 1)


def test_gpu_index_when_available() -> None:
    vectors = unit_vectors(100, 10)
    if not gpu_available():
        with pytest.raises(RetrievalError, match="GPU"):
            VectorIndex.build(vectors, embedder_name="e", config=IndexConfig(use_gpu=True))
        assert not VectorIndex.build(vectors, embedder_name="e").on_gpu
        return
    index = VectorIndex.build(vectors, embedder_name="e", config=IndexConfig(use_gpu=True))
    assert index.on_gpu
    np.testing.assert_array_equal(index.search(vectors[:5], 1)[1][:, 0], np.arange(5))
