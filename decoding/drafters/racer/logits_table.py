"""The logits table ("copy-logit"): for every token id x, the target's top-k next tokens after x.

Row x holds the top-k ids the target predicted the last time it read x: filled from the prefill top-k
at every prompt position and from every verified tree node, rejected nodes included (the target saw
them, so its prediction after them is free information). One table per target model; it is shared by
all requests and tenants of that model and can be persisted (``save`` / ``open``). Memory: vocab × k
int32, about 5 MB for a 150k vocabulary at k = 8.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from decoding.errors import DecodingError

logger = logging.getLogger(__name__)

EMPTY = -1
_FORMAT = 1


class LogitsTableError(DecodingError, ValueError):
    """A persisted logits table is unreadable or belongs to another model / vocabulary / k."""


def table_path(directory: str | Path, model_id: str) -> Path:
    """Where the table of ``model_id`` lives under ``directory``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip("._") or "model"
    return Path(directory) / f"{safe[:120]}.racer-logits.npz"


class LogitsTable:
    """``table[x]`` = the target's top-k next-token ids after token x (``EMPTY`` where unknown)."""

    def __init__(self, vocab_size: int, k: int = 8, model_id: str = "", path: str | Path | None = None,
                 save_interval_s: float = 60.0) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"need vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
        self.vocab_size = int(vocab_size)
        self.k = int(k)
        self.model_id = model_id
        self.path = Path(path) if path is not None else None
        self.save_interval_s = save_interval_s
        self.table = np.full((self.vocab_size, self.k), EMPTY, dtype=np.int32)  # [vocab, k]
        self.filled = np.zeros(self.vocab_size, dtype=bool)  # [vocab]
        self._dirty = False
        self._saved_at = time.monotonic()
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
            self._dirty = True
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

    def save(self, path: str | Path | None = None) -> Path:
        """Write the table atomically (temp file + rename). Returns the path written."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise LogitsTableError("no path to save the logits table to")
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            table, filled = self.table.copy(), self.filled.copy()
            self._dirty = False
            self._saved_at = time.monotonic()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, table=table, filled=filled, model_id=np.array(self.model_id),
                         meta=np.array([_FORMAT, self.vocab_size, self.k], dtype=np.int64))
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    def autosave(self, force: bool = False) -> bool:
        """Save to ``path`` if it is set, the table changed and ``save_interval_s`` passed (or ``force``)."""
        if self.path is None or not self._dirty:
            return False
        if not force and time.monotonic() - self._saved_at < self.save_interval_s:
            return False
        try:
            self.save()
        except OSError as exc:
            logger.warning("could not save the logits table to %s: %s", self.path, exc)
            return False
        return True

    @classmethod
    def load(cls, path: str | Path, model_id: str | None = None, vocab_size: int | None = None,
             k: int | None = None) -> LogitsTable:
        """Read a saved table; raise ``LogitsTableError`` when it is unreadable or does not match."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                fmt, vocab, kk = (int(x) for x in data["meta"])
                saved_model = str(data["model_id"])
                table = np.asarray(data["table"], dtype=np.int32)
                filled = np.asarray(data["filled"], dtype=bool)
        except (OSError, KeyError, ValueError) as exc:
            raise LogitsTableError(f"unreadable logits table {path}: {exc}") from exc
        if fmt != _FORMAT or table.shape != (vocab, kk) or filled.shape != (vocab,):
            raise LogitsTableError(f"logits table {path} is malformed (format {fmt}, shape {table.shape})")
        for name, want, got in (("model", model_id, saved_model), ("vocab_size", vocab_size, vocab),
                                ("k", k, kk)):
            if want is not None and want != got:
                raise LogitsTableError(f"logits table {path} has {name} {got!r}, expected {want!r}")
        out = cls(vocab, kk, saved_model, path)
        out.table, out.filled = table, filled
        out._rows.clear()
        return out

    @classmethod
    def open(cls, directory: str | Path | None, model_id: str, vocab_size: int, k: int = 8,
             save_interval_s: float = 60.0) -> LogitsTable:
        """The table of ``model_id`` under ``directory``: loaded if saved there, else a new empty one.

        A stale or broken file is logged and left in place until the next save replaces it.
        ``directory`` None: an in-memory table that is never saved.
        """
        if directory is None:
            return cls(vocab_size, k, model_id, None, save_interval_s)
        path = table_path(directory, model_id)
        if path.exists():
            try:
                table = cls.load(path, model_id, vocab_size, k)
                table.save_interval_s = save_interval_s
                logger.info("loaded logits table %s (%d rows filled)", path, table.rows_filled)
                return table
            except LogitsTableError as exc:
                logger.warning("%s; starting an empty logits table", exc)
        return cls(vocab_size, k, model_id, path, save_interval_s)
