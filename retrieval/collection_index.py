"""One collection's search index: nearest neighbours over its chunks' vectors (FAISS) and BM25 candidates over their
terms (SQLite's FTS5), documents added and removed without a rebuild, both searched only over the documents a
question may see. It finds candidates; ``Retriever`` scores them as it scores a named document's chunks.

Layout of a collection's directory::

    lexical.sqlite3   the authority on what the index holds: ``slots`` (one row per document added: slot number, doc
                      id, stamp, chunks, terms, live), ``chunks`` (FTS5 over each chunk's terms, rowid = slot << 24 |
                      chunk id) and ``meta`` (the catalogue version last synced), changed in one transaction per
                      document
    vectors/          a snapshot of the vectors (vectors.faiss + owners.npz: slot and chunk of every vector), written
                      whole in a temp dir and renamed in; vectors of live slots it lacks are added again at load

A chunk's vector is the normalized mean of its windows' vectors (the windows ``Retriever`` scores, read from the
document's own index: no second embedding). Removal marks the slot dead: its FTS rows go at once, its vectors stay
until dead vectors pass ``compact_share`` of the index, which is then rebuilt from the live ones.

Search: exact (faiss's flat scan of the stored vectors, the allowed rows as a bitmap selector) while the index is
flat (up to ``exact_max`` vectors) or a filter allows few rows (``exact_max``, or less than ``exact_share`` of the
index: graph search starves when few nodes pass, where the exact scan keeps recall 1.0); otherwise HNSW (inner
product) with the bitmap as selector and a search breadth that grows as the share allowed shrinks. Figures and the
sweep that chose the defaults: bench/results/collections.json, docs/benchmarks.md.

Not thread-safe alone: ``CollectionIndexes`` (``retrieval.library``) holds one lock per index; compaction and
snapshots run off the question path (``CollectionIndexes.sync``).
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from retrieval.doc_files import fsync_tree, remove
from retrieval.errors import RetrievalError

logger = logging.getLogger(__name__)

LEXICAL_DB = "lexical.sqlite3"
VECTORS_DIR = "vectors"
CHUNK_BITS = 24  # a chunk's FTS rowid: slot << 24 | chunk id
MAX_CHUNKS = 1 << CHUNK_BITS
LEXICAL_FETCH = 100_000  # the most ranked rows a filtered BM25 candidate search reads back
FTS_TOKENIZER = "unicode61 remove_diacritics 0 tokenchars '_'"  # the terms of retrieval.lexical, as stored

_HNSW_PARAMS: Any = getattr(faiss, "SearchParametersHNSW")  # noqa: B009 (not in faiss's type stubs)
_FLAT_PARAMS: Any = faiss.SearchParameters
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS slots (slot INTEGER PRIMARY KEY, doc_id TEXT NOT NULL, stamp REAL NOT NULL,
    n_chunks INTEGER NOT NULL, n_terms INTEGER NOT NULL, live INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS slots_doc ON slots (doc_id, live);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks USING fts5(terms, tokenize="{FTS_TOKENIZER}");
CREATE VIRTUAL TABLE IF NOT EXISTS chunk_vocab USING fts5vocab(chunks, row);
"""


@dataclass(frozen=True)
class CollectionIndexConfig:
    """How a collection index searches. ``exact_max``: vectors searched exactly (flat index below it, allowed rows
    below it); ``exact_share``: a filter allowing less than this share of the rows is searched exactly too;
    ``ef_search`` HNSW's breadth with nothing filtered, ``ef_max`` its most under a filter; ``lexical_postings``:
    the most postings a BM25 candidate search reads, ``lexical_ranges``: the most runs of allowed documents a
    filtered one ranks run by run (``CollectionIndex.lexical``)."""

    exact_max: int = 20_000
    exact_share: float = 0.2
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    ef_search: int = 512
    ef_max: int = 1024
    compact_share: float = 0.25
    lexical_postings: int = 200_000
    lexical_ranges: int = 8


@dataclass(frozen=True)
class Slot:
    """A document in the index: its slot number, stamp (its record's ``updated_at`` when added), chunks and terms
    (for BM25's mean length)."""

    slot: int
    doc_id: str
    stamp: float
    n_chunks: int
    n_terms: int


@dataclass(frozen=True)
class DocumentEntry:
    """What adding a document needs: a vector per chunk [n_chunks, dim] (normalized) and each chunk's terms."""

    vectors: np.ndarray
    terms: Sequence[Sequence[str]]


@dataclass(frozen=True)
class TermStats:
    """BM25's statistics over the index's live chunks: their number, mean length in terms, each term's chunk count."""

    n_chunks: int
    avgdl: float
    df: dict[str, int]


def chunk_vectors(window_vectors: np.ndarray, owners: np.ndarray, n_chunks: int) -> np.ndarray:
    """One vector per chunk [n_chunks, dim]: the normalized mean of its windows' vectors (``owners[w]``: window w's
    chunk). A chunk without windows gets a zero vector (it scores 0 against every question)."""
    dim = window_vectors.shape[1]
    sums = np.zeros((n_chunks, dim), dtype=np.float64)
    np.add.at(sums, owners, window_vectors.astype(np.float64))
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return np.ascontiguousarray(np.where(norms > 0, sums / np.maximum(norms, 1e-12), 0.0), dtype=np.float32)


class CollectionIndex:
    """See the module docstring. Open with ``CollectionIndex.open``; ``add`` / ``remove`` documents, ``search`` and
    ``lexical`` for candidates, ``save`` a snapshot of the vectors."""

    def __init__(self, directory: Path, dim: int, config: CollectionIndexConfig) -> None:
        self.directory = directory
        self.dim = dim
        self.config = config
        directory.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(directory / LEXICAL_DB, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._index: Any = faiss.IndexFlatIP(dim)
        self._owner_slot = np.zeros(0, dtype=np.int64)  # [ntotal] slot of each vector
        self._owner_chunk = np.zeros(0, dtype=np.int32)  # [ntotal] chunk id of each vector
        self._rows: dict[int, tuple[int, int]] = {}  # live slot -> its vectors' rows [lo, hi)
        self._live: dict[str, Slot] = {}  # doc id -> its live slot
        self._by_slot: dict[int, Slot] = {}
        self._live_selector: Any = None  # every live row's bitmap selector (None: to be built)
        self.dirty = False  # vectors changed since the last snapshot

    # --- opening and saving ---------------------------------------------------------------------

    @classmethod
    def open(cls, directory: Path, dim: int, config: CollectionIndexConfig | None = None,
             reload: Any = None) -> CollectionIndex:
        """The index in ``directory`` (a new one when empty). Live slots whose vectors the snapshot lacks (added
        after it was saved) get them from ``reload(doc_id, stamp) -> DocumentEntry | None``; None (or no
        ``reload``) marks the slot dead."""
        index = cls(directory, dim, config or CollectionIndexConfig())
        index._load(reload)
        return index

    def _load(self, reload: Any) -> None:
        rows = self._db.execute("SELECT slot, doc_id, stamp, n_chunks, n_terms FROM slots WHERE live = 1 "
                                "ORDER BY slot").fetchall()
        slots = [Slot(int(a), str(b), float(c), int(d), int(e)) for a, b, c, d, e in rows]
        snapshot = self._read_snapshot()
        if snapshot is not None:
            self._index, self._owner_slot, self._owner_chunk = snapshot
            bounds = _slot_bounds(self._owner_slot)
        else:
            bounds = {}
        for slot in slots:
            self._live[slot.doc_id] = slot
            self._by_slot[slot.slot] = slot
            if slot.slot in bounds and bounds[slot.slot][1] - bounds[slot.slot][0] == slot.n_chunks:
                self._rows[slot.slot] = bounds[slot.slot]
                continue
            entry = reload(slot.doc_id, slot.stamp) if reload is not None else None
            if entry is None or len(entry.vectors) != slot.n_chunks:
                with self._transaction() as db:
                    db.execute("UPDATE slots SET live = 0 WHERE slot = ?", (slot.slot,))
                    db.execute("DELETE FROM chunks WHERE rowid >= ? AND rowid < ?",
                               (slot.slot << CHUNK_BITS, (slot.slot + 1) << CHUNK_BITS))
                self._kill(slot)
                continue
            self._append(slot.slot, entry.vectors)
        if self.needs_compaction():
            self.compact()

    def _read_snapshot(self) -> tuple[Any, np.ndarray, np.ndarray] | None:
        folder = self.directory / VECTORS_DIR
        if not folder.is_dir():
            return None
        try:
            index = faiss.read_index(str(folder / "vectors.faiss"))
            with np.load(folder / "owners.npz", allow_pickle=False) as owners:
                slot, chunk = owners["slot"].astype(np.int64), owners["chunk"].astype(np.int32)
            if index.d != self.dim or index.ntotal != len(slot) or len(slot) != len(chunk):
                raise ValueError(f"{index.ntotal} vectors of dim {index.d} for {len(slot)} owners")
        except (OSError, RuntimeError, ValueError, KeyError) as exc:  # a cache: rebuilt from the documents
            logger.warning("collection index %s: snapshot unreadable (%s); vectors rebuilt", self.directory.name, exc)
            return None
        if isinstance(index, faiss.IndexHNSWFlat):
            index.hnsw.efSearch = self.config.ef_search
        return index, slot, chunk

    def save(self) -> None:
        """Write the vectors' snapshot (when they changed): a temp dir renamed over the old one."""
        if not self.dirty:
            return
        work = self.directory / f"{VECTORS_DIR}.tmp"
        remove(work)
        work.mkdir()
        faiss.write_index(self._index, str(work / "vectors.faiss"))
        with (work / "owners.npz").open("wb") as f:
            np.savez(f, slot=self._owner_slot, chunk=self._owner_chunk)
        fsync_tree(work)
        old = self.directory / f"{VECTORS_DIR}.old"
        remove(old)
        target = self.directory / VECTORS_DIR
        if target.exists():
            os.rename(target, old)
        os.rename(work, target)
        remove(old)
        self.dirty = False

    def close(self) -> None:
        self._db.close()

    # --- what it holds ----------------------------------------------------------------------------

    def documents(self) -> dict[str, float]:
        """Live documents: id -> stamp."""
        return {doc_id: slot.stamp for doc_id, slot in self._live.items()}

    @property
    def synced_version(self) -> int | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
        return int(row[0]) if row else None

    def set_synced_version(self, version: int) -> None:
        self._db.execute("INSERT INTO meta (key, value) VALUES ('version', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (str(version),))

    @property
    def n_vectors(self) -> int:
        return int(self._index.ntotal)

    @property
    def n_live(self) -> int:
        """Vectors of live documents."""
        return sum(hi - lo for lo, hi in self._rows.values())

    @property
    def kind(self) -> str:
        return "hnsw" if isinstance(self._index, faiss.IndexHNSWFlat) else "flat"

    def dead_share(self) -> float:
        return 1.0 - self.n_live / self.n_vectors if self.n_vectors else 0.0

    # --- changing it --------------------------------------------------------------------------------

    def add(self, doc_id: str, stamp: float, entry: DocumentEntry) -> None:
        """Add (or replace) a document: its slot and FTS rows in one transaction, then its vectors."""
        vectors = np.ascontiguousarray(entry.vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim or len(vectors) != len(entry.terms):
            raise RetrievalError(f"document {doc_id}: {vectors.shape} vectors for {len(entry.terms)} chunks")
        if len(vectors) >= MAX_CHUNKS:
            raise RetrievalError(f"document {doc_id}: {len(vectors)} chunks, at most {MAX_CHUNKS - 1}")
        if doc_id in self._live:
            self.remove(doc_id)
        n_terms = sum(len(t) for t in entry.terms)
        with self._transaction() as db:
            row = db.execute("SELECT coalesce(max(slot), -1) + 1 FROM slots").fetchone()
            number = int(row[0])
            db.execute("INSERT INTO slots VALUES (?, ?, ?, ?, ?, 1)", (number, doc_id, stamp, len(vectors), n_terms))
            db.executemany("INSERT INTO chunks (rowid, terms) VALUES (?, ?)",
                           ((number << CHUNK_BITS | c, " ".join(t)) for c, t in enumerate(entry.terms)))
        slot = Slot(number, doc_id, stamp, len(vectors), n_terms)
        self._live[doc_id] = slot
        self._by_slot[number] = slot
        self._append(number, vectors)

    def remove(self, doc_id: str) -> bool:
        """Mark a document's slot dead (its FTS rows deleted now, its vectors at the next compaction); False when it
        is not in the index."""
        slot = self._live.get(doc_id)
        if slot is None:
            return False
        with self._transaction() as db:
            db.execute("UPDATE slots SET live = 0 WHERE slot = ?", (slot.slot,))
            db.execute("DELETE FROM chunks WHERE rowid >= ? AND rowid < ?",
                       (slot.slot << CHUNK_BITS, (slot.slot + 1) << CHUNK_BITS))
        self._kill(slot)
        return True

    def _kill(self, slot: Slot) -> None:
        self._live_selector = None
        self._live.pop(slot.doc_id, None)
        self._by_slot.pop(slot.slot, None)
        self._rows.pop(slot.slot, None)

    def _append(self, slot: int, vectors: np.ndarray) -> None:
        self._live_selector = None
        lo = self.n_vectors
        if self.kind == "flat" and lo + len(vectors) > self.config.exact_max:
            self._rebuild(extra=(slot, vectors))
            return
        if len(vectors):
            threads = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(1)  # a document's few vectors: one thread beats two (docs/benchmarks.md)
            try:
                self._index.add(vectors)
            finally:
                faiss.omp_set_num_threads(threads)
        self._owner_slot = np.concatenate([self._owner_slot, np.full(len(vectors), slot, dtype=np.int64)])
        self._owner_chunk = np.concatenate([self._owner_chunk, np.arange(len(vectors), dtype=np.int32)])
        self._rows[slot] = (lo, lo + len(vectors))
        self.dirty = True

    def compact(self) -> None:
        """Rebuild the vector index from the live documents' vectors (dead ones dropped): seconds to minutes at a
        million vectors, so the owner runs it off the question path (``CollectionIndexes.sync``)."""
        self._rebuild()

    def needs_compaction(self) -> bool:
        return self.dead_share() > self.config.compact_share

    def _rebuild(self, extra: tuple[int, np.ndarray] | None = None) -> None:
        xb = self._matrix()
        parts, slots, chunks, rows = [], [], [], {}
        at = 0
        for slot_no in sorted(self._rows):
            lo, hi = self._rows[slot_no]
            parts.append(xb[lo:hi])
            slots.append(np.full(hi - lo, slot_no, dtype=np.int64))
            chunks.append(np.arange(hi - lo, dtype=np.int32))
            rows[slot_no] = (at, at + hi - lo)
            at += hi - lo
        if extra is not None:
            slot_no, vectors = extra
            parts.append(vectors)
            slots.append(np.full(len(vectors), slot_no, dtype=np.int64))
            chunks.append(np.arange(len(vectors), dtype=np.int32))
            rows[slot_no] = (at, at + len(vectors))
            at += len(vectors)
        matrix = np.concatenate(parts) if parts else np.zeros((0, self.dim), dtype=np.float32)
        self._index = self._new_index(len(matrix))
        if len(matrix):
            self._index.add(np.ascontiguousarray(matrix))
        self._owner_slot = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
        self._owner_chunk = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        self._rows = rows
        self._live_selector = None
        self.dirty = True
        logger.info("collection index %s: %s index of %d vectors built", self.directory.name, self.kind, at)

    def _new_index(self, n: int) -> Any:
        if n <= self.config.exact_max:
            return faiss.IndexFlatIP(self.dim)
        index = faiss.IndexHNSWFlat(self.dim, self.config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = self.config.hnsw_ef_construction
        index.hnsw.efSearch = self.config.ef_search
        return index

    def _matrix(self) -> np.ndarray:
        """A view [ntotal, dim] of the stored vectors (no copy)."""
        n = self.n_vectors
        if n == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        flat: Any = self._index if self.kind == "flat" else faiss.downcast_index(self._index.storage)
        return faiss.rev_swig_ptr(flat.get_xb(), n * self.dim).reshape(n, self.dim)

    # --- searching ----------------------------------------------------------------------------------

    def live_slots(self, allowed: Collection[str] | None) -> list[int]:
        """The slots a question may see: every live one (``allowed`` None) or those of ``allowed`` documents."""
        if allowed is None:
            return list(self._rows)
        return [self._live[d].slot for d in allowed if d in self._live and self._live[d].slot in self._rows]

    def search(self, query: np.ndarray, k: int, allowed: Collection[str] | None = None) -> list[tuple[str, int, float]]:
        """The ``k`` chunks nearest to ``query`` [dim] among ``allowed`` documents (all live ones when None), best
        first: (doc id, chunk id, inner product)."""
        slots = self.live_slots(allowed)
        ranges = [self._rows[s] for s in slots]
        n_allowed = sum(hi - lo for lo, hi in ranges)
        if n_allowed == 0 or k <= 0:
            return []
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        exact = (self.kind == "flat" or n_allowed <= self.config.exact_max
                 or n_allowed < self.config.exact_share * self.n_vectors)
        if exact:
            scores, rows = self._exact(q, ranges, n_allowed, k)
        else:
            scores, rows = self._graph(q, ranges, n_allowed, k)
        return [(self._by_slot[int(self._owner_slot[r])].doc_id, int(self._owner_chunk[r]), float(s))
                for s, r in zip(scores, rows, strict=True)]

    def _exact(self, q: np.ndarray, ranges: list[tuple[int, int]], n_allowed: int,
               k: int) -> tuple[np.ndarray, np.ndarray]:
        """Every allowed row scored: faiss's flat search over the stored vectors with the rows' bitmap as selector
        (no copy of the rows)."""
        flat: Any = self._index if self.kind == "flat" else faiss.downcast_index(self._index.storage)
        params = None
        if n_allowed < self.n_vectors:
            params = _FLAT_PARAMS(sel=self._selector(ranges))
        scores, rows = flat.search(q, min(k, n_allowed), params=params)
        keep = rows[0] >= 0
        return scores[0][keep], rows[0][keep]

    def _graph(self, q: np.ndarray, ranges: list[tuple[int, int]], n_allowed: int,
               k: int) -> tuple[np.ndarray, np.ndarray]:
        ef = max(self.config.ef_search, k)
        if n_allowed < self.n_vectors:
            ef = min(self.config.ef_max, max(ef, math.ceil(ef * self.n_vectors / n_allowed)))
            params = _HNSW_PARAMS(sel=self._selector(ranges), efSearch=ef)
        else:
            params = _HNSW_PARAMS(efSearch=ef)
        scores, rows = self._index.search(q, k, params=params)
        keep = rows[0] >= 0
        return scores[0][keep], rows[0][keep]

    def _selector(self, ranges: list[tuple[int, int]]) -> Any:
        """A bitmap selector of the rows in ``ranges``; the one of every live row is kept until the index changes
        (a search with nothing filtered but removed documents' rows does not rebuild it)."""
        every = len(ranges) == len(self._rows)
        if every and self._live_selector is not None:
            return self._live_selector
        mask = np.zeros(self.n_vectors, dtype=bool)
        for lo, hi in ranges:
            mask[lo:hi] = True
        bitmap = np.packbits(mask, bitorder="little")
        selector: Any = faiss.IDSelectorBitmap(self.n_vectors, faiss.swig_ptr(bitmap))
        selector.keep_alive = bitmap  # the selector reads the array: it lives as long as the selector
        if every:
            self._live_selector = selector
        return selector

    def lexical(self, query_terms: Iterable[str], k: int, allowed: Collection[str] | None = None,
                df: dict[str, int] | None = None) -> list[tuple[str, int]]:
        """Up to ``k`` chunks of ``allowed`` documents (all live ones when None) holding any of the terms, best
        BM25 first (FTS5's own ranking: these are candidates, scored again by the retriever).

        FTS5 ranks every chunk that holds a term, so its cost follows the postings it reads: the most common terms
        (the least weight in BM25) are left out of this search until those fit ``lexical_postings``; the rarest
        term always stays. The retriever's scoring still counts every term. A filter allowing documents that lie
        in at most ``lexical_ranges`` runs of consecutive slots is searched run by run (FTS5 reads only the
        postings in each run's rowid range, at a fixed cost per run); a wider one reads FTS5's whole ranking far
        enough down to hold about twice the allowed share of ``k`` (up to ``LEXICAL_FETCH`` rows). Either way the
        allowed chunks come in BM25 order, as many as asked while enough match. ``df``: the terms' chunk
        counts when the caller has them (``term_stats``)."""
        unique = list(dict.fromkeys(t for t in query_terms if t))
        if not unique or k <= 0:
            return []
        if df is None or any(t not in df for t in unique):
            df = self.term_stats(unique).df
        slots = set(self.live_slots(allowed))
        if not slots:
            return []
        runs = _runs(sorted(slots)) if allowed is not None else []
        by_runs = allowed is not None and len(runs) <= self.config.lexical_ranges
        share = 1.0  # of the postings read
        if by_runs:
            share = sum(self._rows[s][1] - self._rows[s][0] for s in slots) / max(self.n_live, 1)
        unique = [t for t in unique if df.get(t, 0) > 0]
        unique.sort(key=lambda t: df[t])
        while len(unique) > 1 and share * sum(df[t] for t in unique) > self.config.lexical_postings:
            unique.pop()
        if not unique:
            return []
        match = " OR ".join('"' + t.replace('"', '""') + '"' for t in unique)  # terms are words: quoted, no syntax
        if by_runs:
            found: list[tuple[float, int]] = []
            for lo, hi in runs:
                found += [(float(rank), int(rowid)) for rowid, rank in self._db.execute(
                    "SELECT rowid, rank FROM chunks WHERE chunks MATCH ? AND rowid >= ? AND rowid < ? "
                    "ORDER BY rank LIMIT ?", (match, lo << CHUNK_BITS, (hi + 1) << CHUNK_BITS, k))]
            rows = [(rowid,) for _, rowid in sorted(found)[:k]]  # FTS5's rank: lower is better
        else:
            # FTS5 ranks every match whatever the limit: fetching about twice the share a filter needs costs only
            # the rows read, and the allowed rows keep their global BM25 order (the best of them, as many as asked)
            fetch = k if allowed is None else min(2 * k * max(1, len(self._rows) // max(len(slots), 1)), LEXICAL_FETCH)
            rows = self._db.execute("SELECT rowid FROM chunks WHERE chunks MATCH ? ORDER BY rank LIMIT ?",
                                    (match, fetch)).fetchall()
        out: list[tuple[str, int]] = []
        for (rowid,) in rows:
            slot = int(rowid) >> CHUNK_BITS
            if slot in slots:
                out.append((self._by_slot[slot].doc_id, int(rowid) & (MAX_CHUNKS - 1)))
                if len(out) == k:
                    break
        return out

    def term_stats(self, query_terms: Iterable[str]) -> TermStats:
        """BM25's statistics over every live chunk of the index (the collection's, whatever a filter allows)."""
        n, total = self._db.execute("SELECT coalesce(sum(n_chunks), 0), coalesce(sum(n_terms), 0) FROM slots "
                                    "WHERE live = 1").fetchone()
        unique = list(dict.fromkeys(query_terms))
        df: dict[str, int] = {t: 0 for t in unique}
        if unique:
            marks = ",".join("?" * len(unique))
            for term, count in self._db.execute(f"SELECT term, doc FROM chunk_vocab WHERE term IN ({marks})", unique):
                df[str(term)] = int(count)
        return TermStats(int(n), max(float(total) / max(int(n), 1), 1.0), df)

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type is not None else "COMMIT")


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted slots as runs of consecutive ones: [(first, last), ...]."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and slot == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], slot)
        else:
            runs.append((slot, slot))
    return runs


def _slot_bounds(owner_slot: np.ndarray) -> dict[int, tuple[int, int]]:
    """Each slot's rows [lo, hi) in a vector index whose slots are contiguous runs."""
    if len(owner_slot) == 0:
        return {}
    starts = np.flatnonzero(np.r_[True, owner_slot[1:] != owner_slot[:-1]])
    ends = np.r_[starts[1:], len(owner_slot)]
    return {int(owner_slot[a]): (int(a), int(b)) for a, b in zip(starts, ends, strict=True)}


__all__ = ["CollectionIndex", "CollectionIndexConfig", "DocumentEntry", "Slot", "TermStats", "chunk_vectors"]
