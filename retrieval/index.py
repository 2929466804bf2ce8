"""FAISS inner-product index over normalized vectors (inner product == cosine similarity).

Exact ``IndexFlatIP`` up to ``IndexConfig.exact_max`` vectors, HNSW (``IndexHNSWFlat``, inner product)
or IVF (``IndexIVFFlat``) above it. When faiss is a GPU build and sees a GPU, flat and IVF indexes are
searched on the GPU (faiss has no GPU HNSW). A sidecar ``index.json`` records the embedder's name and
dimension: loading with another embedder raises :class:`EmbedderMismatch`, which names the re-index
command.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np

from retrieval.errors import EmbedderMismatch, RetrievalError

logger = logging.getLogger(__name__)

IndexKind = Literal["flat", "hnsw", "ivf"]
INDEX_FILE = "index.faiss"
SIDECAR_FILE = "index.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class IndexConfig:
    """How to index: exact below ``exact_max`` vectors, else ``approximate`` (hnsw or ivf)."""

    exact_max: int = 20_000
    approximate: Literal["hnsw", "ivf"] = "hnsw"
    hnsw_m: int = 32
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 128
    ivf_nprobe: int = 16
    use_gpu: bool | None = None  # None: when faiss has GPU support and a GPU is present


def gpu_available() -> bool:
    """A faiss GPU build that sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


@functools.cache
def _gpu_resources() -> Any:
    return faiss.StandardGpuResources()


class VectorIndex:
    """Inner-product index of one document's chunk vectors; ids are chunk ids (0..n-1 in add order)."""

    def __init__(
        self, index: Any, *, kind: IndexKind, dim: int, embedder_name: str, config: IndexConfig
    ) -> None:
        self._cpu_index = index
        self.kind: IndexKind = kind
        self.dim = dim
        self.embedder_name = embedder_name
        self.config = config
        self._configure()
        self._search_index = self._to_device(index)

    # --- building -------------------------------------------------------------------------------

    @classmethod
    def build(
        cls, vectors: np.ndarray, *, embedder_name: str, config: IndexConfig | None = None
    ) -> VectorIndex:
        """Index ``vectors`` [n, d] (normalized float32); the kind follows from n and ``config``."""
        config = config or IndexConfig()
        vectors = _as_matrix(vectors)
        n, dim = vectors.shape
        kind: IndexKind = "flat" if n <= config.exact_max else config.approximate
        index: Any
        if kind == "flat":
            index = faiss.IndexFlatIP(dim)
        elif kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = config.hnsw_ef_construction
        else:
            nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(vectors)
        index.add(vectors)
        logger.debug("built %s index of %d vectors (dim %d)", kind, n, dim)
        return cls(index, kind=kind, dim=dim, embedder_name=embedder_name, config=config)

    def _configure(self) -> None:
        if self.kind == "hnsw":
            self._cpu_index.hnsw.efSearch = self.config.hnsw_ef_search
        elif self.kind == "ivf":
            self._cpu_index.nprobe = self.config.ivf_nprobe
            self._cpu_index.make_direct_map()  # for reconstruct (exact scores over all chunks)

    def _to_device(self, index: Any) -> Any:
        use_gpu = self.config.use_gpu if self.config.use_gpu is not None else gpu_available()
        if not use_gpu or self.kind == "hnsw":
            return index
        if not gpu_available():
            raise RetrievalError("a GPU index was requested but faiss has no GPU support here")
        return faiss.index_cpu_to_gpu(_gpu_resources(), 0, index)

    @property
    def on_gpu(self) -> bool:
        return self._search_index is not self._cpu_index

    def __len__(self) -> int:
        return int(self._cpu_index.ntotal)

    def add(self, vectors: np.ndarray) -> None:
        """Append vectors; their ids continue after the existing ones."""
        vectors = _as_matrix(vectors)
        self._check_dim(vectors)
        self._cpu_index.add(vectors)
        if self.on_gpu:
            self._search_index = self._to_device(self._cpu_index)

    # --- searching ------------------------------------------------------------------------------

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by inner product: scores [m, k] float32 (descending), ids [m, k] int64 (-1 = no hit)."""
        queries = _as_matrix(queries)
        self._check_dim(queries)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if len(self) == 0:
            m = queries.shape[0]
            return np.full((m, k), -np.inf, dtype=np.float32), np.full((m, k), -1, dtype=np.int64)
        scores, ids = self._search_index.search(queries, k)
        return scores.astype(np.float32, copy=False), ids.astype(np.int64, copy=False)

    def scores_all(self, query: np.ndarray) -> np.ndarray:
        """Exact inner product of ``query`` [d] with every indexed vector: [n] float32, by id."""
        query = _as_matrix(query)
        self._check_dim(query)
        n = len(self)
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        if self.kind == "flat":  # the index's own storage, no copy
            vectors = faiss.rev_swig_ptr(self._cpu_index.get_xb(), n * self.dim).reshape(n, self.dim)
        else:
            vectors = self.vectors()
        return (vectors @ query[0]).astype(np.float32)

    def vectors(self) -> np.ndarray:
        """All indexed vectors [n, d] in id order (a copy)."""
        n = len(self)
        if n == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.asarray(self._cpu_index.reconstruct_n(0, n), dtype=np.float32)

    def _check_dim(self, x: np.ndarray) -> None:
        if x.shape[1] != self.dim:
            raise ValueError(f"vectors of dimension {x.shape[1]} for an index of dimension {self.dim}")

    # --- persistence ----------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write ``index.faiss`` and the sidecar ``index.json`` into ``directory`` (created if needed)."""
        directory.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self._cpu_index, str(directory / INDEX_FILE))
        sidecar = {
            "format": FORMAT_VERSION, "embedder": self.embedder_name, "dim": self.dim, "kind": self.kind,
            "count": len(self),
        }
        tmp = directory / (SIDECAR_FILE + ".tmp")
        tmp.write_text(json.dumps(sidecar, indent=2), encoding="utf-8")
        os.replace(tmp, directory / SIDECAR_FILE)

    @staticmethod
    def read_sidecar(directory: Path) -> dict[str, Any]:
        path = directory / SIDECAR_FILE
        try:
            data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RetrievalError(f"no index at {directory} ({SIDECAR_FILE} missing)") from None
        except (OSError, ValueError) as exc:
            raise RetrievalError(f"index sidecar {path} is unreadable: {exc}") from None
        return data

    @classmethod
    def load(
        cls,
        directory: Path,
        *,
        embedder_name: str | None = None,
        dim: int | None = None,
        config: IndexConfig | None = None,
        doc_id: str | None = None,
    ) -> VectorIndex:
        """Load an index; with ``embedder_name`` / ``dim`` given, a different recorded one raises
        :class:`EmbedderMismatch` before the index file is even read."""
        sidecar = cls.read_sidecar(directory)
        recorded = f"{sidecar.get('embedder')!s} (dim {sidecar.get('dim')})"
        if (embedder_name is not None and sidecar.get("embedder") != embedder_name) or (
            dim is not None and sidecar.get("dim") != dim
        ):
            want_dim = dim if dim is not None else sidecar.get("dim")
            expected = f"{embedder_name or sidecar.get('embedder')} (dim {want_dim})"
            raise EmbedderMismatch(expected=expected, found=recorded, doc_id=doc_id)
        try:
            index = faiss.read_index(str(directory / INDEX_FILE))
        except RuntimeError as exc:
            raise RetrievalError(f"index file in {directory} is unreadable: {exc}") from None
        kind = sidecar.get("kind", "flat")
        if kind not in ("flat", "hnsw", "ivf") or index.d != sidecar.get("dim"):
            raise RetrievalError(f"index in {directory} does not match its sidecar")
        return cls(index, kind=kind, dim=int(index.d), embedder_name=str(sidecar["embedder"]),
                   config=config or IndexConfig())


def _as_matrix(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"expected a [n, d] matrix, got shape {x.shape}")
    return np.ascontiguousarray(x)
