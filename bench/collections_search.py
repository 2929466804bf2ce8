r"""bench.collections' ``search`` section: ``retrieval.collection_index.CollectionIndex`` at 10K, 100K and 1M chunks.

The index holds synthetic chunks that look like a collection's: ``CENTRES`` gaussian topic centres (a few thousand at
1M chunks), documents of ``CHUNKS_PER_DOC`` chunks each near a centre, a document's chunks near the document (unit
vectors of the embedder's dimension, 384 for all-MiniLM-L6-v2): chunks of one document have a cosine of ~0.6, of two
documents on one topic ~0.45, of unrelated ones ~0. Questions embedded by the real model cannot be mapped into that
space, so the queries are held-out vectors, never stored: half a new chunk of a stored document (its 10 nearest are
mostly that document's: ``recall@10_stored_doc``), half a chunk of a new document on a stored topic (its nearest are
spread over the topic's documents at close scores, the harder half: ``recall@10_new_doc``); the real embedder is timed
on its own: ``query_embedding`` is ``encode_query`` over bench/data's questions (p50 / p99 ms).

Each chunk has a term list for FTS5: ``TERMS_MEAN`` terms on average (75-225) from a Zipf vocabulary of ``VOCAB``
words (s = ``ZIPF_S``), 30 % of them from the document's own 200 topic words; lexical queries are 3 terms, either
drawn from the vocabulary's Zipf (``zipf``: a common word now and then, as questions have) or 2 of a document's topic
words and 1 Zipf word (``topical``).

Per size, through the index's own methods (``add`` one document at a time as ingestion does, ``search``, ``lexical``,
``term_stats``, ``remove``, ``compact``):

* build: total time (wall, and CPU time of both cores: a shared box stretches wall time, CPU time much less), vectors
  (``_append``, FAISS) against the rest (SQLite, FTS5), per-document add p50 / p99 and the add that turned the flat
  index into HNSW (at ``exact_max``); then ``INCREMENTAL`` more documents timed one by one at full size; resident
  memory per chunk (RSS delta, freed memory trimmed first) and the SQLite file's bytes per chunk;
* search: p50 / p99 ms (median over ``--rounds`` rounds of ``--queries`` queries, and the rounds' band) and recall
  against numpy brute force over the same allowed chunks, for k = 10 and k = 64 (the candidates a question asks):
  recall@10 (the true 10 best in what came back) and recall@k, with no filter, a filter allowing 10 % and one allowing
  1 % of the documents (``allowed`` = their ids); queries from any document, and (``_in``) from an allowed one;
* lexical: ``lexical`` latency for k = 10 / 64 with each filter, and under a filter how many of the asked candidates
  came back (``fill``) and their recall against FTS5's own ranking restricted to the allowed chunks (ties counted as
  hits); ``term_stats`` latency (BM25's statistics, asked once per question); and a what-if the index does not do
  (``what_if_prune_df>X``): the query without its terms held by more than X of the chunks, latency and recall of the
  best 64 against the whole query's ranking. Above 200K chunks fewer lexical queries (20, one round): each costs ~1 s;
* removal: ``remove`` of 20 % of the documents one by one (p50 / p99 ms), search recall and latency then (dead vectors
  still in the graph), ``compact`` time and recall after it.

``goal``: p99 <= 50 ms and recall@10 >= 0.95 in every search cell. A sweep (``--sweep-sizes``, 100K) builds the
vectors alone at each ``hnsw_m`` x ``hnsw_ef_construction`` and searches each with every ``ef_search`` (no filter),
then measures the filter-share curve on the default build: the graph path (HNSW with the allowed-rows selector) and the
exact path forced at 0.5 % .. 20 % of the documents allowed, which is what ``exact_share`` and ``exact_max`` choose,
and the same vectors rebuilt in one add (as ``compact`` does) searched again: a graph built a document at a time is
worse than one built at once. The sweep at 1M that the defaults' evidence at full size comes from (about 25 minutes):

    python -m bench.collections --sections search --sizes none --sweep-sizes 1000000 --sweep-m 32 --sweep-efc 80 \
        --sweep-ef 64,128,256,512 --rounds 2 --embed-questions 0
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import math
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import out, rss_mb
from retrieval.collection_index import (
    CHUNK_BITS,
    LEXICAL_DB,
    VECTORS_DIR,
    CollectionIndex,
    CollectionIndexConfig,
    DocumentEntry,
)

DIM = 384  # all-MiniLM-L6-v2
CHUNKS_PER_DOC = 50
DOC_SPREAD = 0.6  # a document's distance from its topic centre (noise norm, relative to the unit centre)
CHUNK_SPREAD = 0.8  # a chunk's from its document
VOCAB = 50_000
ZIPF_S = 1.0
TERMS_MEAN = 150
TOPIC_WORDS = 200
TOPIC_SHARE = 0.3
INCREMENTAL = 5
KS = (10, 64)
FILTER_SHARES = {"none": None, "10pct": 0.10, "1pct": 0.01}
GOAL_P99_MS = 50.0
GOAL_RECALL = 0.95
REMOVE_SHARE = 0.20
SWEEP_M = (16, 32, 48)
SWEEP_EFC = (40, 80, 160)
SWEEP_EF = (16, 32, 64, 128, 256)
CURVE_SHARES = (0.005, 0.01, 0.02, 0.05, 0.10, 0.20)

Save = Callable[[dict[str, Any]], None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--sizes", type=_ints, default=None, help="chunks per index (default 10000,100000,1000000; "
                   "--quick: 10000; none: no size, e.g. the sweep alone)")
    g.add_argument("--queries", type=int, default=None, help="search queries per cell (default 200, quick 100)")
    g.add_argument("--lexical-queries", type=int, default=None, help="lexical queries per cell (100, quick 40)")
    g.add_argument("--rounds", type=int, default=None, help="rounds over the queries per cell (default 2)")
    g.add_argument("--embed-questions", type=int, default=None,
                   help="QA questions to embed for query_embedding (default all; 0: skip)")
    g.add_argument("--sweep-sizes", type=_ints, default=None, help="chunks of each knob sweep (default 100000; "
                   "quick: 0 = no sweep)")
    g.add_argument("--sweep-m", type=_ints, default=list(SWEEP_M))
    g.add_argument("--sweep-efc", type=_ints, default=list(SWEEP_EFC))
    g.add_argument("--sweep-ef", type=_ints, default=list(SWEEP_EF))
    g.add_argument("--no-lexical", action="store_true", help="chunks without terms, no lexical measures")
    g.add_argument("--no-removal", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workdir", type=Path, default=None, help="where the indexes are built (a temp dir)")
    for name, kind in (("exact_max", int), ("exact_share", float), ("hnsw_m", int), ("hnsw_ef_construction", int),
                       ("ef_search", int), ("ef_max", int), ("compact_share", float)):
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"CollectionIndexConfig.{name} (default: the class default)")


def _ints(text: str) -> list[int]:
    """``10000,100000``; ``none``: an empty list (``--sizes none --sweep-sizes 100000``: the sweep alone)."""
    return [] if text.strip().lower() == "none" else [int(float(x)) for x in text.split(",") if x.strip()]


def index_config(args: argparse.Namespace) -> CollectionIndexConfig:
    overrides = {f: getattr(args, f) for f in CollectionIndexConfig.__dataclass_fields__
                 if getattr(args, f, None) is not None}
    return replace(CollectionIndexConfig(), **overrides)


# --- the synthetic collection ---------------------------------------------------------------------------------


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _noise(rng: np.random.Generator, shape: tuple[int, ...], norm: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(norm / math.sqrt(DIM))).astype(np.float32)


class Vocabulary:
    """A Zipf vocabulary of ``VOCAB`` words ``t0`` (the most frequent) .. ``t49999``."""

    def __init__(self) -> None:
        p = 1.0 / np.arange(1, VOCAB + 1, dtype=np.float64) ** ZIPF_S
        self.cdf = np.cumsum(p / p.sum())
        self.words = [f"t{i}" for i in range(VOCAB)]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n)), VOCAB - 1)


@dataclass
class Corpus:
    """``n`` chunk vectors [n, DIM] in documents of ``CHUNKS_PER_DOC`` (the last may be shorter)."""

    n: int
    seed: int
    vectors: np.ndarray = field(repr=False)
    doc_vectors: np.ndarray = field(repr=False)
    bounds: np.ndarray = field(repr=False)  # [docs + 1] first row of each document
    centres: np.ndarray = field(repr=False)  # [topics, DIM]
    topic_of: np.ndarray = field(repr=False)  # [docs] each document's centre

    @classmethod
    def make(cls, n: int, seed: int) -> Corpus:
        rng = np.random.default_rng([seed, n])
        n_docs = math.ceil(n / CHUNKS_PER_DOC)
        centres = _unit(rng.standard_normal((min(4000, max(20, n_docs // 5)), DIM), dtype=np.float32))
        topic_of = rng.integers(0, len(centres), n_docs)
        docs = _unit(centres[topic_of] + _noise(rng, (n_docs, DIM), DOC_SPREAD))
        bounds = np.minimum(np.arange(n_docs + 1, dtype=np.int64) * CHUNKS_PER_DOC, n)
        vectors = np.empty((n, DIM), dtype=np.float32)
        step = 4096 * CHUNKS_PER_DOC
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            owner = np.arange(lo, hi) // CHUNKS_PER_DOC
            vectors[lo:hi] = _unit(docs[owner] + _noise(rng, (hi - lo, DIM), CHUNK_SPREAD))
        return cls(n, seed, vectors, docs, bounds, centres, topic_of)

    @property
    def n_docs(self) -> int:
        return len(self.bounds) - 1

    @staticmethod
    def doc_id(i: int) -> str:
        return f"d{i:07d}"

    def rows(self, docs: np.ndarray | list[int]) -> np.ndarray:
        return np.concatenate([np.arange(self.bounds[d], self.bounds[d + 1]) for d in docs]) if len(docs) else \
            np.zeros(0, dtype=np.int64)

    def topic_words(self, doc: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 7, doc]).integers(100, VOCAB, TOPIC_WORDS)

    def entry(self, doc: int, vocab: Vocabulary | None) -> DocumentEntry:
        lo, hi = int(self.bounds[doc]), int(self.bounds[doc + 1])
        if vocab is None:
            return DocumentEntry(self.vectors[lo:hi], [()] * (hi - lo))
        rng = np.random.default_rng([self.seed, 11, doc])
        lengths = rng.integers(TERMS_MEAN // 2, TERMS_MEAN * 3 // 2 + 1, hi - lo)
        ranks = vocab.draw(rng, int(lengths.sum()))
        topical = rng.random(len(ranks)) < TOPIC_SHARE
        ranks[topical] = self.topic_words(doc)[rng.integers(0, TOPIC_WORDS, int(topical.sum()))]
        words = [vocab.words[r] for r in ranks.tolist()]
        cuts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        return DocumentEntry(self.vectors[lo:hi], [words[a:b] for a, b in itertools.pairwise(cuts)])

    def queries(self, rng: np.random.Generator, docs: np.ndarray, n: int) -> np.ndarray:
        """``n`` held-out chunks [n, DIM], never stored, about documents drawn from ``docs``: the first half a new
        chunk of such a document (its 10 nearest are mostly that document's), the second half a chunk of a new
        document on its topic (its nearest are spread over the topic's documents, at close scores: the hard half)."""
        owner = docs[rng.integers(0, len(docs), n)]
        seen = n - n // 2
        new_docs = _unit(self.centres[self.topic_of[owner[seen:]]] + _noise(rng, (n - seen, DIM), DOC_SPREAD))
        near = np.concatenate([self.doc_vectors[owner[:seen]], new_docs])
        return _unit(near + _noise(rng, (n, DIM), CHUNK_SPREAD))


def brute_force(vectors: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int) -> list[np.ndarray]:
    """The exact ``k`` best rows (of ``rows``) per query, best first."""
    found: list[np.ndarray] = []
    if len(rows) == 0:
        return [np.zeros(0, dtype=np.int64) for _ in queries]
    whole = len(rows) == len(vectors)
    sub = vectors if whole else vectors[rows]
    for lo in range(0, len(queries), 32):
        scores = sub @ queries[lo:lo + 32].T  # [rows, batch]
        kk = min(k, len(rows))
        part = np.argpartition(-scores, kk - 1, axis=0)[:kk]
        for j in range(scores.shape[1]):
            best = part[np.argsort(-scores[part[:, j], j], kind="stable"), j]
            found.append(rows[best])
    return found


# --- measuring ------------------------------------------------------------------------------------------------


def _malloc_trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _load() -> list[float] | None:
    """The machine's load averages (1, 5, 15 min): a shared box's noise shows in them."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _ms(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3), "n": len(values)} if len(a) else {}


def _rounds(per_round: list[list[float]]) -> dict[str, Any]:
    """p50 / p99 ms: the median over the rounds, and each round's (the noise band)."""
    p50 = [float(np.percentile(r, 50)) * 1e3 for r in per_round]
    p99 = [float(np.percentile(r, 99)) * 1e3 for r in per_round]
    return {"p50_ms": round(float(np.median(p50)), 3), "p99_ms": round(float(np.median(p99)), 3),
            "p50_ms_rounds": [round(x, 3) for x in p50], "p99_ms_rounds": [round(x, 3) for x in p99]}


def _path(index: CollectionIndex, n_allowed: int, k: int) -> str:
    """Which path ``CollectionIndex.search`` takes for ``n_allowed`` rows (as its code decides), and HNSW's breadth."""
    cfg = index.config
    if index.kind == "flat" or n_allowed <= cfg.exact_max or n_allowed < cfg.exact_share * index.n_vectors:
        return "exact"
    share = n_allowed / index.n_vectors
    ef = max(cfg.ef_search, k)
    if n_allowed < index.n_vectors:
        ef = min(cfg.ef_max, max(ef, math.ceil(ef / share)))
    return f"graph(ef={ef})"


@dataclass
class Searcher:
    """Runs one cell: queries against the index with an allowed set, timed, scored against brute force."""

    index: CollectionIndex
    corpus: Corpus
    live: np.ndarray  # [docs] bool
    rounds: int
    row_of: dict[str, int] = field(default_factory=dict)
    _truth: dict[tuple[Any, ...], list[np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.row_of = {Corpus.doc_id(d): int(self.corpus.bounds[d]) for d in range(self.corpus.n_docs)}

    def cell(self, queries: np.ndarray, k: int, allowed_docs: np.ndarray | None) -> dict[str, Any]:
        allowed = None if allowed_docs is None else frozenset(Corpus.doc_id(int(d)) for d in allowed_docs)
        docs = np.flatnonzero(self.live) if allowed_docs is None else allowed_docs[self.live[allowed_docs]]
        rows = self.corpus.rows(docs)
        key = (hash(queries.tobytes()), k, hash(rows.tobytes()))  # a knob sweep asks the same cell again
        if key not in self._truth:
            if len(self._truth) >= 8:
                self._truth.pop(next(iter(self._truth)))
            self._truth[key] = brute_force(self.corpus.vectors, rows, queries, k)
        truth = self._truth[key]
        per_round: list[list[float]] = []
        got: list[list[int]] = []
        bookkeeping = []  # live_slots alone: the Python side of each search (O(documents))
        for _ in range(min(len(queries), 50)):
            t0 = time.perf_counter()
            self.index.live_slots(allowed)
            bookkeeping.append(time.perf_counter() - t0)
        for r in range(self.rounds):
            times = []
            for q in queries:
                t0 = time.perf_counter()
                hits = self.index.search(q, k, allowed)
                times.append(time.perf_counter() - t0)
                if r == 0:
                    got.append([self.row_of[d] + c for d, c, _ in hits])
            per_round.append(times)
        r10 = [len(set(g) & set(t[:10].tolist())) / max(min(10, len(t)), 1) for g, t in zip(got, truth, strict=True)]
        rk = [len(set(g) & set(t.tolist())) / max(len(t), 1) for g, t in zip(got, truth, strict=True)]
        seen = len(queries) - len(queries) // 2  # Corpus.queries: a stored document's chunks, then new documents'
        return {"k": k, "allowed_chunks": len(rows), "path": _path(self.index, len(rows), k), **_rounds(per_round),
                "recall@10": round(float(np.mean(r10)), 4), f"recall@{k}": round(float(np.mean(rk)), 4),
                "recall@10_stored_doc": round(float(np.mean(r10[:seen])), 4),
                "recall@10_new_doc": round(float(np.mean(r10[seen:])), 4) if len(r10) > seen else None,
                "recall@10_min": round(float(np.min(r10)), 2),
                "live_slots_ms_p50": round(float(np.median(bookkeeping)) * 1e3, 3)}


def search_cells(searcher: Searcher, rng: np.random.Generator, n_queries: int, ks: tuple[int, ...],
                 filters: dict[str, np.ndarray | None], targeted: bool = True) -> dict[str, Any]:
    """Every (k, filter) cell; queries from any document and (``_in``) from the filter's documents."""
    corpus = searcher.corpus
    live_docs = np.flatnonzero(searcher.live)
    anywhere = corpus.queries(rng, live_docs, n_queries)
    cells: dict[str, Any] = {}
    for name, docs in filters.items():
        variants = [(name, anywhere)]
        if docs is not None and targeted:
            variants.append((name + "_in", corpus.queries(rng, docs[searcher.live[docs]], n_queries)))
        for label, queries in variants:
            for k in ks:
                cells[f"k{k}/{label}"] = searcher.cell(queries, k, docs)
    return cells


def goal_check(cells: dict[str, Any]) -> dict[str, Any]:
    failing = [name for name, c in cells.items()
               if c["p99_ms"] > GOAL_P99_MS or c["recall@10"] < GOAL_RECALL]
    return {"p99_ms_max": GOAL_P99_MS, "recall@10_min": GOAL_RECALL, "met": not failing, "failing": failing,
            "worst_p99_ms": max(c["p99_ms"] for c in cells.values()),
            "worst_recall@10": min(c["recall@10"] for c in cells.values())}


def pick_filters(rng: np.random.Generator, n_docs: int) -> dict[str, np.ndarray | None]:
    return {name: None if share is None else np.sort(rng.choice(n_docs, max(1, round(share * n_docs)), replace=False))
            for name, share in FILTER_SHARES.items()}


# --- building -------------------------------------------------------------------------------------------------


def build(corpus: Corpus, directory: Path, config: CollectionIndexConfig, vocab: Vocabulary | None,
          n_docs: int, label: str = "") -> tuple[CollectionIndex, dict[str, Any]]:
    """Add documents 0 .. n_docs - 1 one at a time; the build's timings."""
    index = CollectionIndex.open(directory, DIM, config)
    in_vectors = [0.0]
    append = index._append

    def timed_append(slot: int, vectors: np.ndarray) -> None:
        t0 = time.perf_counter()
        append(slot, vectors)
        in_vectors[0] += time.perf_counter() - t0

    vars(index)["_append"] = timed_append  # the vectors' share of each add (FAISS + owners), the rest is SQLite
    adds: list[float] = []
    rebuild: dict[str, Any] | None = None
    began, cpu0 = time.perf_counter(), time.process_time()
    report = max(1, n_docs // 10)
    for d in range(n_docs):
        entry = corpus.entry(d, vocab)
        kind = index.kind
        t0, c0 = time.perf_counter(), time.process_time()
        index.add(Corpus.doc_id(d), 0.0, entry)
        adds.append(time.perf_counter() - t0)
        if kind != index.kind:
            rebuild = {"s": round(adds[-1], 3), "cpu_s": round(time.process_time() - c0, 3),
                       "at_vectors": index.n_vectors, "doc": d}
        if (d + 1) % report == 0 or d + 1 == n_docs:
            spent = sum(adds)
            out(f"  {label}build {d + 1}/{n_docs} docs, {index.n_vectors} vectors ({index.kind}): "
                f"{spent:.1f} s in add ({in_vectors[0]:.1f} s vectors), {time.perf_counter() - began:.1f} s wall")
    total = sum(adds)
    record = {"documents": n_docs, "chunks": index.n_vectors, "add_total_s": round(total, 2),
              "wall_s": round(time.perf_counter() - began, 2),
              "cpu_s": round(time.process_time() - cpu0, 2),  # both cores' (a shared box stretches wall time)
              "vectors_s": round(in_vectors[0], 2),
              "lexical_and_slots_s": round(total - in_vectors[0], 2),
              "chunks_per_s": round(index.n_vectors / total, 1) if total else None, "add_ms": _ms(adds),
              "rebuild_to_hnsw": rebuild}
    return index, record


def incremental(index: CollectionIndex, corpus: Corpus, vocab: Vocabulary | None, docs: range) -> dict[str, Any]:
    times = []
    for d in docs:
        entry = corpus.entry(d, vocab)
        t0 = time.perf_counter()
        index.add(Corpus.doc_id(d), 0.0, entry)
        times.append(time.perf_counter() - t0)
    return {"documents": len(times), "chunks_each": CHUNKS_PER_DOC, "median_ms": round(float(np.median(times)) * 1e3,
            2) if times else None, "each_ms": [round(t * 1e3, 2) for t in times]}


def snapshot(index: CollectionIndex) -> dict[str, Any]:
    """``save`` (the vectors' snapshot, written whole when dirty: ``CollectionIndexes`` does it every
    ``save_after_s`` while a collection changes) and ``open`` from it (a restart), with the snapshot's size."""
    t0 = time.perf_counter()
    index.save()
    save_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in (index.directory / VECTORS_DIR).glob("*"))
    t0 = time.perf_counter()
    again = CollectionIndex.open(index.directory, DIM, index.config)
    open_s = time.perf_counter() - t0
    same = again.n_vectors == index.n_vectors and again.kind == index.kind
    again.close()
    del again
    _malloc_trim()
    return {"save_s": round(save_s, 3), "open_s": round(open_s, 3), "bytes_per_chunk": round(size / index.n_vectors, 1),
            "reopened_same": same}


# --- lexical --------------------------------------------------------------------------------------------------


def lexical_queries(rng: np.random.Generator, corpus: Corpus, vocab: Vocabulary, kind: str, n: int,
                    docs: np.ndarray) -> list[list[str]]:
    out_: list[list[str]] = []
    for _ in range(n):
        if kind == "zipf":
            ranks = vocab.draw(rng, 3).tolist()
        else:
            topic = corpus.topic_words(int(docs[rng.integers(0, len(docs))]))
            ranks = [*topic[rng.integers(0, TOPIC_WORDS, 2)].tolist(), *vocab.draw(rng, 1).tolist()]
        out_.append([vocab.words[r] for r in ranks])
    return out_


def _match(terms: list[str]) -> str:
    return " OR ".join('"' + t + '"' for t in dict.fromkeys(terms))  # as CollectionIndex.lexical writes it


def _full_ranking(db: sqlite3.Connection, terms: list[str], slots: set[int] | None) -> list[tuple[int, float]]:
    """FTS5's whole ranking of the query over the allowed slots' chunks: (rowid, rank), best first."""
    rows = db.execute("SELECT rowid, rank FROM chunks WHERE chunks MATCH ? ORDER BY rank", (_match(terms),))
    return [(int(r), float(rank)) for r, rank in rows if slots is None or int(r) >> CHUNK_BITS in slots]


def _tie_recall(got: list[int], ranked: list[tuple[int, float]], k: int) -> float | None:
    """The share of the best ``min(k, matching)`` that ``got`` holds, a chunk ranked as the last of them counting."""
    want = min(k, len(ranked))
    if want == 0:
        return None
    rank_of, kth = dict(ranked), ranked[want - 1][1]
    return sum(rank_of.get(r, math.inf) <= kth + 1e-9 for r in got[:want]) / want


def lexical_cells(index: CollectionIndex, corpus: Corpus, vocab: Vocabulary, rng: np.random.Generator, n: int,
                  rounds: int, filters: dict[str, np.ndarray | None], n_truth: int) -> dict[str, Any]:
    db = sqlite3.connect(f"file:{index.directory / LEXICAL_DB}?mode=ro", uri=True)
    result: dict[str, Any] = {}
    try:
        for kind in ("zipf", "topical"):
            for name, docs in filters.items():
                source = docs if docs is not None else np.arange(corpus.n_docs)
                queries = lexical_queries(rng, corpus, vocab, kind, n, source)
                allowed = None if docs is None else frozenset(Corpus.doc_id(int(d)) for d in docs)
                truth: list[list[tuple[int, float]]] = []
                if n_truth:
                    slots = None if allowed is None else set(index.live_slots(allowed))
                    t0 = time.perf_counter()
                    truth = [_full_ranking(db, q, slots) for q in queries[:n_truth]]
                    result[f"{kind}/{name}/fts5_full_ranking_ms_mean"] = round(
                        (time.perf_counter() - t0) / n_truth * 1e3, 2)
                if docs is None and truth:
                    result.update(prune_what_if(db, index, kind, queries[:n_truth], truth))
                for k in KS:
                    per_round: list[list[float]] = []
                    got: list[list[tuple[str, int]]] = []
                    for r in range(rounds):
                        times = []
                        for q in queries:
                            t0 = time.perf_counter()
                            hits = index.lexical(q, k, allowed)
                            times.append(time.perf_counter() - t0)
                            if r == 0:
                                got.append(hits)
                        per_round.append(times)
                    cell: dict[str, Any] = {"k": k, **_rounds(per_round),
                                            "returned_mean": round(float(np.mean([len(g) for g in got])), 2)}
                    if allowed is not None and truth:
                        cell.update(_lexical_truth(index, truth, got[:n_truth], allowed, k))
                    result[f"{kind}/k{k}/{name}"] = cell
            stats_times = []
            for q in lexical_queries(rng, corpus, vocab, kind, n, np.arange(corpus.n_docs)):
                t0 = time.perf_counter()
                index.term_stats(q)
                stats_times.append(time.perf_counter() - t0)
            result[f"{kind}/term_stats"] = _rounds([stats_times])
    finally:
        db.close()
    return result


def _lexical_truth(index: CollectionIndex, truth: list[list[tuple[int, float]]], got: list[list[tuple[str, int]]],
                   allowed: frozenset[str], k: int) -> dict[str, Any]:
    """``lexical``'s candidates against FTS5's ranking over the allowed chunks alone: the share of the asked
    (``min(k, matching)``) that came back (``fill``), and of the best ``k`` among them (``recall_vs_fts5``)."""
    slot_of = {d: s[0] for d in allowed if (s := index.live_slots([d]))}
    fills, recalls = [], []
    for ranked, hits in zip(truth, got, strict=True):
        rowids = [slot_of[d] << CHUNK_BITS | c for d, c in hits]
        recall = _tie_recall(rowids, ranked, k)
        if recall is not None:
            recalls.append(recall)
            fills.append(min(len(hits), k, len(ranked)) / min(k, len(ranked)))
    return {"truth_queries": len(truth), "allowed_matching_mean": round(float(np.mean([len(t) for t in truth])), 1),
            "fill": round(float(np.mean(fills)), 4) if fills else None,
            "recall_vs_fts5": round(float(np.mean(recalls)), 4) if recalls else None}


PRUNE_DF = (0.5, 0.2, 0.1)


def prune_what_if(db: sqlite3.Connection, index: CollectionIndex, kind: str, queries: list[list[str]],
                  truth: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """Not what the index does: the candidates' query without the terms held by more than ``PRUNE_DF`` of the
    chunks (their document frequencies from ``term_stats``, which a question asks anyway): latency (the df look-up
    apart) and recall of the best 64 against the whole query's ranking."""
    n_chunks = index.term_stats([]).n_chunks
    result: dict[str, Any] = {}
    for cap in PRUNE_DF:
        times, recalls, dropped = [], [], []
        for q, ranked in zip(queries, truth, strict=True):
            df = index.term_stats(q).df
            keep = [t for t in dict.fromkeys(q) if df.get(t, 0) <= cap * n_chunks]
            dropped.append(len(dict.fromkeys(q)) - len(keep))
            t0 = time.perf_counter()
            rows = db.execute("SELECT rowid FROM chunks WHERE chunks MATCH ? ORDER BY rank LIMIT ?",
                              (_match(keep), KS[-1])).fetchall() if keep else []
            times.append(time.perf_counter() - t0)
            recall = _tie_recall([int(r) for (r,) in rows], ranked, KS[-1])
            if recall is not None:
                recalls.append(recall)
        result[f"{kind}/k{KS[-1]}/none/what_if_prune_df>{cap}"] = {
            **_rounds([times]), "terms_dropped_mean": round(float(np.mean(dropped)), 2),
            "recall_vs_fts5": round(float(np.mean(recalls)), 4) if recalls else None, "queries": len(queries)}
    return result


# --- removal --------------------------------------------------------------------------------------------------


def removal(index: CollectionIndex, corpus: Corpus, live: np.ndarray, rng: np.random.Generator, n_queries: int,
            rounds: int, filters: dict[str, np.ndarray | None]) -> dict[str, Any]:
    gone = rng.choice(np.flatnonzero(live), round(REMOVE_SHARE * live.sum()), replace=False)
    times, compactions = [], 0
    for d in gone.tolist():
        before = index.n_vectors
        t0 = time.perf_counter()
        index.remove(Corpus.doc_id(d))
        times.append(time.perf_counter() - t0)
        live[d] = False
        compactions += index.n_vectors < before
    result: dict[str, Any] = {"removed_documents": len(gone), "remove_ms": _ms(times),
                              "compactions_during": compactions, "dead_share": round(index.dead_share(), 4),
                              "kind": index.kind}
    searcher = Searcher(index, corpus, live, rounds)
    kept = {"none": filters["none"], "10pct": filters["10pct"]}
    result["search_after"] = search_cells(searcher, rng, n_queries, KS, kept, targeted=False)
    t0, c0 = time.perf_counter(), time.process_time()
    index.compact()
    result["compact_s"] = round(time.perf_counter() - t0, 3)
    result["compact_cpu_s"] = round(time.process_time() - c0, 3)
    result["vectors_after_compact"] = index.n_vectors
    result["search_after_compact"] = search_cells(searcher, rng, n_queries, (10,), {"none": None}, targeted=False)
    return result


# --- query embedding ------------------------------------------------------------------------------------------


def query_embedding(n_questions: int | None, rounds: int) -> dict[str, Any]:
    """``encode_query`` of bench/data's questions with the bundled embedder on the CPU, one at a time."""
    import torch

    from bench.datasets import load_qa
    from retrieval.embedding import load_embedder

    questions = [q.question for d in load_qa() for q in d.questions][:n_questions]
    t0 = time.perf_counter()
    embedder = load_embedder("bundled", device="cpu")
    load_s = time.perf_counter() - t0
    for q in questions[:3]:  # warm-up
        embedder.encode_query(q)
    per_round = []
    for _ in range(rounds):
        times = []
        for q in questions:
            t1 = time.perf_counter()
            embedder.encode_query(q)
            times.append(time.perf_counter() - t1)
        per_round.append(times)
    return {"embedder": embedder.name, "dim": embedder.dim, "questions": len(questions),
            "torch_threads": torch.get_num_threads(), "load_s": round(load_s, 2), **_rounds(per_round)}


# --- the section ----------------------------------------------------------------------------------------------


def one_size(n: int, args: argparse.Namespace, config: CollectionIndexConfig, workdir: Path, n_queries: int,
             n_lex: int, rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng([args.seed, n, 1])
    t0 = time.perf_counter()
    corpus = Corpus.make(n, args.seed)
    vocab = None if args.no_lexical else Vocabulary()
    out(f"{n} chunks: {corpus.n_docs} documents generated in {time.perf_counter() - t0:.1f} s")
    directory = Path(tempfile.mkdtemp(prefix=f"ci-{n}-", dir=workdir))
    n_inc = INCREMENTAL if corpus.n_docs > 4 * INCREMENTAL else 0
    try:
        _malloc_trim()
        rss0 = rss_mb()
        index, built = build(corpus, directory, config, vocab, corpus.n_docs - n_inc)
        _malloc_trim()
        rss1 = rss_mb()
        result: dict[str, Any] = {"chunks": n, "documents": corpus.n_docs, "config": asdict(config),
                                  "load_average_at_start": _load(), "build": built}
        result["incremental_add"] = incremental(index, corpus, vocab, range(corpus.n_docs - n_inc, corpus.n_docs))
        result["kind"] = index.kind
        db_bytes = sum(p.stat().st_size for p in directory.glob(LEXICAL_DB + "*"))
        result["memory"] = {"rss_before_mb": round(rss0, 1), "rss_after_build_mb": round(rss1, 1),
                            "rss_bytes_per_chunk": round((rss1 - rss0) * 2**20 / built["chunks"], 1),
                            "vector_bytes_per_chunk": DIM * 4,
                            "sqlite_bytes_per_chunk": round(db_bytes / n, 1)}
        result["snapshot"] = snapshot(index)
        out(f"  built in {built['add_total_s']:.1f} s ({built['vectors_s']:.1f} s vectors, cpu {built['cpu_s']:.1f} s),"
            f" rebuild to HNSW {built['rebuild_to_hnsw']}, incremental add {result['incremental_add']['median_ms']} ms,"
            f" RSS {result['memory']['rss_bytes_per_chunk']:.0f} B/chunk, snapshot {result['snapshot']}")
        live = np.ones(corpus.n_docs, dtype=bool)
        filters = pick_filters(rng, corpus.n_docs)
        searcher = Searcher(index, corpus, live, rounds)
        result["search"] = search_cells(searcher, rng, n_queries, KS, filters)
        for name, c in result["search"].items():
            out(f"  search {name:14s} {c['path']:15s} p50 {c['p50_ms']:7.2f} p99 {c['p99_ms']:7.2f} ms "
                f"{c['p99_ms_rounds']}  recall@10 {c['recall@10']:.3f} recall@k {c['recall@' + str(c['k'])]:.3f}")
        result["goal"] = goal_check(result["search"])
        out(f"  goal (p99 <= {GOAL_P99_MS} ms, recall@10 >= {GOAL_RECALL}): {result['goal']}")
        if vocab is not None:
            big = n > 200_000  # FTS5 ranks every chunk holding a query term: ~1 s a query at 1M, so fewer of them
            result["lexical"] = lexical_cells(index, corpus, vocab, rng, min(n_lex, 20) if big else n_lex,
                                              1 if big else rounds, filters, n_truth=min(n_lex, 10 if big else 30))
            for name, c in result["lexical"].items():
                if not isinstance(c, dict):
                    out(f"  lexical {name:38s} {c}")
                    continue
                extra = "".join(f" {key} {c[key]}" for key in ("fill", "recall_vs_fts5", "terms_dropped_mean")
                                if key in c)
                out(f"  lexical {name:38s} p50 {c['p50_ms']:8.2f} p99 {c['p99_ms']:8.2f} ms{extra}")
        if not args.no_removal:
            result["removal"] = removal(index, corpus, live, rng, n_queries, rounds, filters)
            rm = result["removal"]
            out(f"  removal of {rm['removed_documents']} docs: remove {rm['remove_ms']}, compact {rm['compact_s']} s")
            for name, c in [*rm["search_after"].items(), *((f"compacted/{k}", v) for k, v in
                                                           rm["search_after_compact"].items())]:
                out(f"  after removal {name:16s} p50 {c['p50_ms']:7.2f} p99 {c['p99_ms']:7.2f} ms "
                    f"recall@10 {c['recall@10']:.3f}")
        index.close()
        result["load_average_at_end"] = _load()
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        _malloc_trim()


def sweep(n: int, args: argparse.Namespace, base: CollectionIndexConfig, workdir: Path, n_queries: int,
          rounds: int) -> dict[str, Any]:
    """Vectors alone at ``n`` chunks: each (hnsw_m, hnsw_ef_construction) built a document at a time and searched at
    every ef_search (no filter); on ``base``'s (m, ef_construction) the filter-share curve (graph against exact), then
    the same vectors rebuilt in one add (``compact``) and searched again (``graph`` "bulk")."""
    corpus = Corpus.make(n, args.seed)
    rng = np.random.default_rng([args.seed, n, 2])
    queries = corpus.queries(rng, np.arange(corpus.n_docs), n_queries)
    live = np.ones(corpus.n_docs, dtype=bool)
    rows: list[dict[str, Any]] = []
    curve: list[dict[str, Any]] = []
    rebuilt: dict[str, Any] = {}
    grid = [(m, efc) for m in args.sweep_m for efc in args.sweep_efc]
    if (base.hnsw_m, base.hnsw_ef_construction) not in grid:
        grid.append((base.hnsw_m, base.hnsw_ef_construction))
    cost = build_cost(corpus, grid, rounds, base=min(10_000, n // 4), timed=min(10_000, n // 4))
    for m, efc in grid:
        config = replace(base, hnsw_m=m, hnsw_ef_construction=efc, exact_max=min(base.exact_max, n // 2))
        directory = Path(tempfile.mkdtemp(prefix=f"sweep-{m}-{efc}-", dir=workdir))
        try:
            _malloc_trim()
            rss0 = rss_mb()
            index, built = build(corpus, directory, config, None, corpus.n_docs, label=f"m={m} efc={efc} ")
            _malloc_trim()
            rss_per_chunk = (rss_mb() - rss0) * 2**20 / n
            searcher = Searcher(index, corpus, live, rounds)

            def ef_rows(graph: str, index: CollectionIndex = index, searcher: Searcher = searcher,
                        config: CollectionIndexConfig = config, built: dict[str, Any] = built, m: int = m,
                        efc: int = efc, rss_per_chunk: float = rss_per_chunk) -> None:
                for ef in args.sweep_ef:
                    index.config = replace(config, ef_search=ef)
                    for k in KS:
                        c = searcher.cell(queries, k, None)
                        rows.append({"hnsw_m": m, "hnsw_ef_construction": efc, "ef_search": ef, "k": k,
                                     "graph": graph, "build_vectors_s": built["vectors_s"],
                                     "build_cpu_s": built["cpu_s"], "rss_bytes_per_chunk": round(rss_per_chunk),
                                     **{key: c[key] for key in ("p50_ms", "p99_ms", "p99_ms_rounds", "recall@10",
                                                                f"recall@{k}", "recall@10_stored_doc",
                                                                "recall@10_new_doc")}})
                        out(f"  sweep m={m:3d} efc={efc:4d} ef={ef:4d} k={k:3d} {graph:11s}: build "
                            f"{built['vectors_s']:6.1f} s (cpu {built['cpu_s']:6.1f} s) p50 {c['p50_ms']:6.2f} p99 "
                            f"{c['p99_ms']:6.2f} ms recall@10 {c['recall@10']:.3f} recall@{k} {c[f'recall@{k}']:.3f}")
                index.config = config

            ef_rows("incremental")  # a document at a time, as ingestion adds them
            if (m, efc) == (base.hnsw_m, base.hnsw_ef_construction):
                curve = share_curve(index, corpus, searcher, rng, n_queries, base, args.sweep_ef)
                t0, c0 = time.perf_counter(), time.process_time()
                index.compact()  # the same vectors in one bulk add, as a compaction (or the flat -> HNSW switch) does
                rebuilt = {"s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2)}
                out(f"  rebuilt in one add: {rebuilt}")
                ef_rows("bulk")
            index.close()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    cpu = {(c["hnsw_m"], c["hnsw_ef_construction"]): c["cpu_ms_per_1000"] for c in cost}
    for r in rows:
        r["insert_cpu_ms_per_1000"] = cpu[(r["hnsw_m"], r["hnsw_ef_construction"])]
    return {"chunks": n, "load_average_at_end": _load(), "build_cost": cost, "grid": rows,
            "filter_share_curve": curve, "bulk_rebuild": rebuilt,
            "best": best_of_sweep([r for r in rows if r["graph"] == "incremental"])}


def build_cost(corpus: Corpus, grid: list[tuple[int, int]], rounds: int, base: int = 10_000,
               timed: int = 10_000) -> list[dict[str, Any]]:
    """What each (hnsw_m, hnsw_ef_construction) costs to insert into, side by side: FAISS alone on one thread (a
    shared box stretches two threads' wall and CPU time alike), ``timed`` vectors added a document at a time to an
    HNSW of ``base``, the configurations interleaved over ``rounds``; CPU ms per 1,000 vectors, median and band."""
    import faiss

    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    times: dict[tuple[int, int], list[float]] = {key: [] for key in grid}
    try:
        for _ in range(rounds):
            for m, efc in grid:
                index = faiss.IndexHNSWFlat(DIM, m, faiss.METRIC_INNER_PRODUCT)
                index.hnsw.efConstruction = efc
                index.add(corpus.vectors[:base])
                c0 = time.process_time()
                for lo in range(base, base + timed, CHUNKS_PER_DOC):
                    index.add(corpus.vectors[lo:lo + CHUNKS_PER_DOC])
                times[(m, efc)].append((time.process_time() - c0) / timed * 1e6)
                del index
    finally:
        faiss.omp_set_num_threads(threads)
    rows = [{"hnsw_m": m, "hnsw_ef_construction": efc, "cpu_ms_per_1000": round(float(np.median(t)), 1),
             "cpu_ms_per_1000_rounds": [round(x, 1) for x in t]} for (m, efc), t in times.items()]
    for r in rows:
        out(f"  build cost m={r['hnsw_m']:3d} efc={r['hnsw_ef_construction']:4d}: {r['cpu_ms_per_1000']:7.1f} CPU ms "
            f"per 1000 vectors {r['cpu_ms_per_1000_rounds']}")
    return rows


def share_curve(index: CollectionIndex, corpus: Corpus, searcher: Searcher, rng: np.random.Generator,
                n_queries: int, base: CollectionIndexConfig, efs: list[int]) -> list[dict[str, Any]]:
    """At each share of the documents allowed: the exact path and the graph path forced (each breadth the code would
    use for ``efs``, once), queries from anywhere and (``in``) from the allowed documents."""
    rows: list[dict[str, Any]] = []
    forced_exact = replace(base, exact_max=10**12)
    for share in CURVE_SHARES:
        docs = np.sort(rng.choice(corpus.n_docs, max(1, round(share * corpus.n_docs)), replace=False))
        n_allowed = int(sum(corpus.bounds[d + 1] - corpus.bounds[d] for d in docs))
        for where, source in (("anywhere", np.arange(corpus.n_docs)), ("in", docs)):
            queries = corpus.queries(rng, source, n_queries)
            for k in KS:
                configs, seen = [forced_exact], set()
                for ef in efs:
                    graph = replace(base, exact_max=0, exact_share=0.0, ef_search=ef)
                    index.config = graph
                    label = _path(index, n_allowed, k)
                    if label not in seen:
                        seen.add(label)
                        configs.append(graph)
                for config in configs:
                    index.config = config
                    c = searcher.cell(queries, k, docs)
                    row = {"share": share, "queries": where, "path": c["path"], "k": k,
                           "ef_search": None if c["path"] == "exact" else config.ef_search,
                           "allowed_chunks": c["allowed_chunks"],
                           **{key: c[key] for key in ("p50_ms", "p99_ms", "p99_ms_rounds", "recall@10",
                                                      f"recall@{k}")}}
                    rows.append(row)
                    out(f"  share {share:5.3f} {where:8s} {row['path']:16s} k={k:3d} p50 {c['p50_ms']:6.2f} p99 "
                        f"{c['p99_ms']:6.2f} ms recall@10 {c['recall@10']:.3f}")
    index.config = base
    return rows


def best_of_sweep(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The cheapest setting (insert cost, then p99 of k=64) whose k=10 and k=64 searches both reach the goal."""
    by: dict[tuple[int, int, int], dict[int, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["hnsw_m"], r["hnsw_ef_construction"], r["ef_search"]), {})[r["k"]] = r
    ok = [(key, v) for key, v in by.items() if len(v) == len(KS)
          and all(c["recall@10"] >= GOAL_RECALL and c["p99_ms"] <= GOAL_P99_MS for c in v.values())]
    if not ok:
        return None
    key, v = min(ok, key=lambda kv: (kv[1][KS[0]]["insert_cpu_ms_per_1000"], kv[1][KS[-1]]["p99_ms"]))
    return {"hnsw_m": key[0], "hnsw_ef_construction": key[1], "ef_search": key[2],
            "insert_cpu_ms_per_1000": v[KS[0]]["insert_cpu_ms_per_1000"], "k10_p99_ms": v[10]["p99_ms"],
            "k64_recall@10": v[64]["recall@10"]} if 10 in v and 64 in v else {"key": list(key)}


def run(args: argparse.Namespace, save: Save) -> dict[str, Any]:
    """The search section; ``save(partial)`` after each size (a long run keeps what it measured)."""
    sizes = args.sizes if args.sizes is not None else ([10_000] if args.quick else [10_000, 100_000, 1_000_000])
    n_queries = args.queries or (100 if args.quick else 200)
    n_lex = args.lexical_queries or (40 if args.quick else 100)
    rounds = args.rounds or (1 if args.quick else 3)
    sweep_sizes = args.sweep_sizes if args.sweep_sizes is not None else ([] if args.quick else [100_000])
    config = index_config(args)
    workdir = args.workdir or Path(tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"config": asdict(config), "dim": DIM, "chunks_per_doc": CHUNKS_PER_DOC,
                              "geometry": {"doc_spread": DOC_SPREAD, "chunk_spread": CHUNK_SPREAD},
                              "terms": {"vocab": VOCAB, "zipf_s": ZIPF_S, "mean_per_chunk": TERMS_MEAN,
                                        "topic_share": TOPIC_SHARE},
                              "queries": n_queries, "lexical_queries": n_lex, "rounds": rounds, "sizes": {}}
    n_embed = args.embed_questions
    if n_embed != 0:
        result["query_embedding"] = query_embedding(n_embed, rounds=2)
        qe = result["query_embedding"]
        out(f"query embedding ({qe['embedder']}, {qe['questions']} questions, {qe['torch_threads']} threads): "
            f"p50 {qe['p50_ms']:.1f} ms p99 {qe['p99_ms']:.1f} ms {qe['p99_ms_rounds']}")
        save(result)
    for n in sizes:
        result["sizes"][str(n)] = one_size(n, args, config, workdir, n_queries, n_lex, rounds)
        save(result)
    result["sweeps"] = {}
    for n in sweep_sizes:
        out(f"sweep at {n} chunks")
        result["sweeps"][str(n)] = sweep(n, args, config, workdir, n_queries, rounds)
        out(f"  best of the sweep: {result['sweeps'][str(n)]['best']}")
        save(result)
    return result
