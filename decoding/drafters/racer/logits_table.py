"""The logits table ("copy-logit"): for every token id x, the target's top-k next tokens after x.

Row x holds the top-k ids the target predicted the last time it read x: filled from the prefill top-k
at every prompt position and from every verified tree node, rejected nodes included (the target saw
them, so its prediction after them is free information). One table per target model, shared by all
requests of that process, in memory only (vocab x k int32): a table warmed by earlier sessions was
measured to draft no better than one learned from the request's own prompt (docs/benchmarks.md, studies),
so it is not persisted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

EMPTY = -1


class LogitsTable:
    """``table[x]`` = the target's top-k next-token ids after token x (``EMPTY`` where unknown)."""

    def __init__(self, vocab_size: int, k: int = 8, model_id: str = "") -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"need vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.vocab_size = int(vocab_size)
        self.k = int(k)
        self.model_id = model_id
        self.table = np.full((self.vocab_size, self.k), EMPTY, dtype=np.int32)  # [vocab, k]
        self.filled = np.zeros(self.vocab_size, dtype=bool)  # [vocab]
        self._lock = threading.Lock()
        self._rows: dict[int, list[int]] = {}  # Python copies of rows read since their last update

    # ---- learning ----------------------------------------------------------------------------------

    def update(self, tokens: Sequence[int] | np.ndarray | torch.Tensor,
               topk: np.ndarray | torch.Tensor) -> int:
        """Set row ``tokens[j]`` to ``topk[j]`` (``[n, k']`` ids); the last occurrence of a token wins.

        Rows of out-of-vocabulary tokens are ignored; ids beyond k are dropped, missing ones are ``EMPTY``.
        Returns the number of rows written.
        """
        if isinstance(topk, torch.Tensor):
            topk = topk.detach().to("cpu").numpy()
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().to("cpu").numpy()
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        vals = np.asarray(topk)
        if vals.ndim != 2:
            raise ValueError(f"topk must be [n, k], got shape {vals.shape}")
        n = min(ids.size, vals.shape[0])
        if n == 0:
            return 0
        ids, vals = ids[:n], vals[:n]
        # keep the last occurrence of every token id, inside the vocabulary
        if n <= 512:  # a verify step: a dict is cheaper than a sort
            last = {t: j for j, t in enumerate(ids.tolist()) if 0 <= t < self.vocab_size}
            uniq = np.fromiter(last.keys(), dtype=np.int64, count=len(last))
            rows = np.fromiter(last.values(), dtype=np.int64, count=len(last))
        else:
            uniq, first_in_rev = np.unique(ids[::-1], return_index=True)
            rows = n - 1 - first_in_rev
            keep = (uniq >= 0) & (uniq < self.vocab_size)
            uniq, rows = uniq[keep], rows[keep]
        if uniq.size == 0:
            return 0
        kk = min(self.k, vals.shape[1])
        block = np.full((uniq.size, self.k), EMPTY, dtype=np.int32)
        block[:, :kk] = vals[rows, :kk]
        block[(block < 0) | (block >= self.vocab_size)] = EMPTY
        with self._lock:
            self.table[uniq] = block
            self.filled[uniq] = True
            if uniq.size > 4096:
                self._rows.clear()
            else:
                for t in uniq.tolist():
                    self._rows.pop(t, None)
        return int(uniq.size)

    # ---- reading -----------------------------------------------------------------------------------

    def next_tokens(self, token: int, breadth: int) -> list[int]:
        """The first ``breadth`` known next tokens after ``token`` (empty when the row is unknown)."""
        row = self._rows.get(token)
        if row is None:
            if 0 <= token < self.vocab_size and self.filled[token]:
                row = [t for t in self.table[token].tolist() if t != EMPTY]
            else:
                row = []
            self._rows[token] = row
        return row[:breadth]

    def __contains__(self, token: int) -> bool:
        return 0 <= token < self.vocab_size and bool(self.filled[token])

    @property
    def rows_filled(self) -> int:
        return int(self.filled.sum())

    # ---- persistence -------------------------------------------------------------------------------
