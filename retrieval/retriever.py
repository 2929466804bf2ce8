"""Hybrid (dense + lexical) retrieval over indexed documents, RAPID style.

Every chunk gets two scores for a question: its *similarity*, the best cosine similarity between the question
and one of the chunk's overlapping word windows (``passage_spans``), and its BM25 score over the asked
documents as a share of the most a chunk could score (``bm25_scores``). Its *score*, which ranks it, is
``(1 - w) * similarity + w * bm25`` with ``w`` the lexical weight (0 with ``scoring="dense"``). Chunks whose
similarity is below the threshold are dropped (a lexical match alone never makes a chunk relevant); the best
top-k by score are packed into a token budget (default ``max(L/24, 4096)`` capped, L = total document tokens)
and re-ordered by document position (order of ``doc_ids``, then character start).

A question is scored once (``Retriever.rank``): the ``Ranking`` holds every chunk's score for the request's
queries (the question, and for a follow-up the question after the conversation's earlier questions; a chunk
keeps its better score), and everything else is cut from it without asking again: the relevant chunks
(``Ranking.relevant``: the sources, RAPID's context) and, for documents longer than the target's window, the
most relevant chunks that fit it (``Ranking.window``: no threshold, after a fixed lead). ``pack_hits`` is the
packing step both use.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from retrieval.chunking import Chunk
from retrieval.embedding import Embedder
from retrieval.errors import DocumentNotFound, DocumentNotReady, RetrievalError
from retrieval.index import VectorIndex
from retrieval.lexical import LexicalIndex, bm25_of_chunks, bm25_scores, terms
from retrieval.library import CollectionIndexes
from retrieval.store import DocumentStore

logger = logging.getLogger(__name__)

Scoring = Literal["hybrid", "dense"]
SCORINGS: tuple[Scoring, ...] = ("hybrid", "dense")
BGE_M3_THRESHOLD = 0.3  # RAPID's value for BGE-M3
# all-MiniLM-L6-v2 (mean pooling) over 60-word windows, calibrated by `python -m bench.retrieval` on the
# calibration part of bench/data's QA set: the midpoint between the lowest similarity of a chunk holding an
# answer and the highest best similarity of an off-topic question, rounded to 0.05.
# Details: bench/results/retrieval.json "threshold_calibration".
MINILM_THRESHOLD = 0.3
# Weight of the BM25 score in a chunk's score, chosen by `python -m bench.retrieval` (best MRR across the
# documents on the calibration part of the QA set; the held-out part reported apart).
DEFAULT_LEXICAL_WEIGHT = 0.15
BUDGET_FLOOR = 4096
BUDGET_RATIO = 24
DEFAULT_BUDGET_CAP = 8192
DEFAULT_TOP_K = 16
DEFAULT_CANDIDATES = 64  # a collection question's candidate chunks per query and per kind (dense, BM25)
CHUNK_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Hit:
    """One retrieved chunk: its text, score (which ranks it), place in its document, and similarity (its
    best window's cosine similarity to the question, which the threshold gates; = score when dense)."""

    document_id: str
    chunk_id: int
    text: str
    score: float
    start: int
    end: int
    page: int | None
    n_tokens: int
    similarity: float | None = None
    page_end: int | None = None  # PDFs: the page of the chunk's last character


@dataclass(frozen=True)
class RetrievalResult:
    """Kept hits in document order, their joined text, the budget and the tokens the hits use."""

    hits: list[Hit]
    context_text: str
    budget_tokens: int
    used_tokens: int


def default_threshold(embedder_name: str) -> float:
    """Similarity threshold for an embedder: 0.3 for BGE-M3 (RAPID), the calibrated one for MiniLM."""
    name = embedder_name.lower()
    if "bge-m3" in name:
        return BGE_M3_THRESHOLD
    if "minilm" in name:
        return MINILM_THRESHOLD
    return BGE_M3_THRESHOLD


def default_budget(total_tokens: int, cap: int = DEFAULT_BUDGET_CAP) -> int:
    """RAPID's context budget max(L/24, 4096), capped at ``cap`` tokens."""
    return min(max(math.ceil(total_tokens / BUDGET_RATIO), BUDGET_FLOOR), cap)


def pack_hits(
    hits: Iterable[Hit], budget_tokens: int, doc_order: Sequence[str] | None = None, lead_tokens: int = 0
) -> list[Hit]:
    """Best-scoring hits that fit ``budget_tokens`` together (a hit that does not fit is skipped, smaller
    ones after it may still fit), returned in document order: ``doc_order`` then character start.

    ``lead_tokens``: the leading hits in document order that fit that many tokens are kept whatever their
    score (a stable start shared by every question's selection), the rest of the budget goes by score."""
    rank = {doc_id: i for i, doc_id in enumerate(doc_order or [])}
    in_order = sorted(hits, key=lambda h: (rank.get(h.document_id, len(rank)), h.document_id, h.start))
    kept: list[Hit] = []
    used = 0
    for hit in in_order:
        if used + hit.n_tokens > min(lead_tokens, budget_tokens):
            break
        kept.append(hit)
        used += hit.n_tokens
    rest = in_order[len(kept) :]
    by_score = sorted(rest, key=lambda h: (-h.score, rank.get(h.document_id, len(rank)), h.start))
    for hit in by_score:
        if used + hit.n_tokens <= budget_tokens:
            kept.append(hit)
            used += hit.n_tokens
    kept.sort(key=lambda h: (rank.get(h.document_id, len(rank)), h.document_id, h.start))
    return kept


def hit_pieces(hits: Sequence[Hit], titles: Mapping[str, str] | None = None) -> list[str]:
    """One piece of text per hit, in order, that ``join_hits`` concatenates: the hit's text, after a blank line
    unless it is the first or directly follows the previous hit in the same document. With ``titles`` (document id
    -> title), the first hit of each run of a document's hits comes after a ``Document: <title>`` line."""
    pieces: list[str] = []
    prev: Hit | None = None
    for hit in hits:
        gap = prev is not None and not (prev.document_id == hit.document_id and prev.end == hit.start)
        text = hit.text
        if titles is not None and (prev is None or prev.document_id != hit.document_id):
            text = f"Document: {titles.get(hit.document_id, hit.document_id)}\n\n{text}"
        pieces.append(CHUNK_SEPARATOR + text if gap else text)
        prev = hit
    return pieces


def join_hits(hits: Sequence[Hit]) -> str:
    """Hits' texts in order; adjacent chunks of one document are joined seamlessly, others by a blank line."""
    return "".join(hit_pieces(hits))


def _result(hits: list[Hit], budget_tokens: int) -> RetrievalResult:
    return RetrievalResult(hits=hits, context_text=join_hits(hits), budget_tokens=budget_tokens,
                           used_tokens=sum(h.n_tokens for h in hits))


@dataclass(frozen=True)
class Ranking:
    """Every scored chunk of the asked documents for one request (``Retriever.rank``), and the cuts made from it.

    ``hits`` in document order with their scores; ``threshold`` and ``top_k`` are what ``relevant`` applies,
    ``budget_tokens`` its default budget (``default_budget`` of the documents' length).
    """

    doc_ids: tuple[str, ...]
    hits: tuple[Hit, ...]
    threshold: float
    top_k: int
    budget_tokens: int

    def relevant(self, budget_tokens: int | None = None, *, threshold: float | None = None) -> RetrievalResult:
        """The top-k by score of the chunks whose similarity reaches the threshold, packed into the budget, in
        document order: the sources of an answer and RAPID's context."""
        budget = self.budget_tokens if budget_tokens is None else budget_tokens
        floor = self.threshold if threshold is None else threshold
        kept = sorted((h for h in self.hits if h.similarity is not None and h.similarity >= floor),
                      key=lambda h: -h.score)
        return _result(pack_hits(kept[: self.top_k], budget, self.doc_ids), budget)

    def window(self, budget_tokens: int, lead_tokens: int = 0) -> RetrievalResult:
        """The best-scoring chunks (no threshold, no top-k) that fit ``budget_tokens``, in document order, after
        the documents' first ``lead_tokens`` (see ``pack_hits``): what a target reads of documents longer than
        its window."""
        return _result(pack_hits(self.hits, budget_tokens, self.doc_ids, lead_tokens), budget_tokens)


@dataclass(frozen=True)
class _Loaded:
    updated_at: float
    created_at: float
    index: VectorIndex
    chunks: list[Chunk]
    owners: np.ndarray  # [n_vectors] chunk id of each indexed window
    lexical: LexicalIndex | None  # None: indexed before the lexical index existed (`ragspec reindex`)
    n_tokens: int  # target tokens of the document (its record's, as indexed)

    @functools.cached_property
    def nbytes(self) -> int:
        """About what the document holds in memory: its window vectors (plus an HNSW graph's links), chunk texts
        and postings; what the retriever's cache is bounded by."""
        vectors = len(self.index) * (self.index.dim * 4 + (8 * 2 * self.index.config.hnsw_m
                                                            if self.index.kind == "hnsw" else 0))
        texts = sum(len(c.text) for c in self.chunks) + 200 * len(self.chunks)  # + a Chunk object's own bytes
        lexical = 0 if self.lexical is None else sum(
            a.nbytes for a in (self.lexical.vocab, self.lexical.ptr, self.lexical.chunk_ids, self.lexical.counts,
                               self.lexical.lengths))
        return vectors + texts + lexical + self.owners.nbytes


def _dense_scores(doc: _Loaded, query_vec: np.ndarray, top_k: int) -> np.ndarray:
    """Each chunk's best window similarity [n_chunks]; -inf where an approximate search found no window."""
    if doc.index.kind == "flat":
        window_scores = doc.index.scores_all(query_vec)
    else:
        k = min(len(doc.index), max(256, 8 * top_k))
        found, ids = doc.index.search(query_vec, k)
        window_scores = np.full(len(doc.index), -np.inf, dtype=np.float32)
        keep = ids[0] >= 0
        window_scores[ids[0][keep]] = found[0][keep]
    best = np.full(len(doc.chunks), -np.inf, dtype=np.float32)
    np.maximum.at(best, doc.owners, window_scores)
    return best


class Retriever:
    """Retrieval over the store's documents with one embedder; indexes and chunks are cached in memory."""

    def __init__(
        self,
        store: DocumentStore,
        embedder: Embedder,
        *,
        threshold: float | None = None,
        budget_cap: int = DEFAULT_BUDGET_CAP,
        top_k: int = DEFAULT_TOP_K,
        scoring: Scoring = "hybrid",
        lexical_weight: float | None = None,
        cache_bytes: int = 256 << 20,
    ) -> None:
        lexical_weight = DEFAULT_LEXICAL_WEIGHT if lexical_weight is None else lexical_weight
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        if not 0.0 <= lexical_weight <= 1.0:
            raise ValueError(f"lexical_weight must be in [0, 1], got {lexical_weight}")
        self.store = store
        self.embedder = embedder
        self.threshold = default_threshold(embedder.name) if threshold is None else threshold
        self.budget_cap = budget_cap
        self.top_k = top_k
        self.scoring: Scoring = scoring
        self.lexical_weight = lexical_weight if scoring == "hybrid" else 0.0
        self._cache: OrderedDict[str, _Loaded] = OrderedDict()
        self.cache_bytes = cache_bytes  # a collection question loads each candidate's document: tens at once
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def rank(
        self, queries: Sequence[str], doc_ids: Sequence[str], *, top_k: int | None = None, tenant: str | None = None
    ) -> Ranking:
        """Every chunk of ``doc_ids`` scored once for ``queries`` (one embedder call for all of them); a chunk
        keeps its best score over the queries. ``top_k`` only bounds the windows an approximate (HNSW / IVF)
        index is searched for, and is the ranking's top-k for ``Ranking.relevant``."""
        queries = list(dict.fromkeys(queries))
        if not queries:
            raise ValueError("rank needs at least one query")
        top_k = self.top_k if top_k is None else top_k
        loaded = self._load_all(doc_ids, tenant)
        vectors = (self.embedder.encode_query(queries[0])[None] if len(queries) == 1
                   else self.embedder.encode(queries))  # [queries, dim]
        w = self.lexical_weight
        lexical = [self._lexical_scores(q, loaded) for q in queries]  # [queries][docs] -> [chunks]
        hits: list[Hit] = []
        for d, (doc_id, doc) in enumerate(zip(doc_ids, loaded, strict=True)):
            sims = np.stack([_dense_scores(doc, v, top_k) for v in vectors])  # [queries, chunks], -inf: unsearched
            lexs = np.stack([lex[d] for lex in lexical])
            scores = (1 - w) * sims.astype(np.float64) + w * lexs.astype(np.float64)
            scores[np.isneginf(sims)] = -np.inf
            best = scores.argmax(axis=0)  # the first query wins a tie
            for c, chunk in enumerate(doc.chunks):
                q = int(best[c])
                if sims[q, c] > -np.inf:
                    hits.append(_hit(doc_id, chunk, float(scores[q, c]), float(sims[q, c])))
        total = sum(doc.n_tokens for doc in loaded)  # the records _load read: no second store lookup
        return Ranking(tuple(doc_ids), tuple(hits), self.threshold, top_k, default_budget(total, self.budget_cap))

    def rank_library(
        self,
        queries: Sequence[str],
        library: CollectionIndexes,
        collection_ids: Sequence[str],
        *,
        total_tokens: int,
        allowed: Collection[str] | None = None,
        candidates: int = DEFAULT_CANDIDATES,
        top_k: int | None = None,
        tenant: str | None = None,
    ) -> Ranking:
        """A question over collections: candidate chunks from each collection's index (``candidates`` nearest to
        each query's vector and as many best BM25 matches, among the ``allowed`` documents: every ready member
        when None), then scored as ``rank`` scores a named document's chunks (best window, BM25 with the
        collections' statistics, the hybrid score). Only the candidates are in the ranking; ``total_tokens`` (the
        ready members' tokens) sets its default budget."""
        queries = list(dict.fromkeys(queries))
        if not queries:
            raise ValueError("rank_library needs at least one query")
        top_k = self.top_k if top_k is None else top_k
        vectors = (self.embedder.encode_query(queries[0])[None] if len(queries) == 1
                   else self.embedder.encode(queries))  # [queries, dim]
        query_terms = [terms(q) for q in queries]
        found: dict[str, set[int]] = {}
        n_chunks, n_terms, df = 0, 0.0, {t: 0 for ts in query_terms for t in ts}
        for cid in collection_ids:
            with library.synced(cid) as index:
                for v in vectors:
                    for doc_id, chunk_id, _ in index.search(v, candidates, allowed):
                        found.setdefault(doc_id, set()).add(chunk_id)
                if self.lexical_weight > 0:
                    stats = index.term_stats(df)
                    for ts in query_terms:
                        for doc_id, chunk_id in index.lexical(ts, candidates, allowed, stats.df):
                            found.setdefault(doc_id, set()).add(chunk_id)
                    n_chunks, n_terms = n_chunks + stats.n_chunks, n_terms + stats.avgdl * stats.n_chunks
                    for t, d in stats.df.items():
                        df[t] += d
        avgdl = n_terms / max(n_chunks, 1)
        w = self.lexical_weight
        hits: list[Hit] = []
        order: list[tuple[float, str]] = []
        for doc_id, chunk_set in found.items():
            try:
                doc = self._load(doc_id, tenant)
            except (DocumentNotFound, DocumentNotReady):  # deleted or re-indexing since the index was synced
                continue
            ids = np.array(sorted(c for c in chunk_set if c < len(doc.chunks)), dtype=np.int64)
            sims = np.stack([_dense_scores(doc, v, top_k)[ids] for v in vectors])  # [queries, candidates]
            if w > 0 and doc.lexical is not None:
                lexs = np.stack([bm25_of_chunks(q, doc.lexical, ids, n_chunks, avgdl, df) for q in queries])
            else:
                lexs = np.zeros_like(sims)
            scores = (1 - w) * sims.astype(np.float64) + w * lexs.astype(np.float64)
            scores[np.isneginf(sims)] = -np.inf
            best = scores.argmax(axis=0)
            for j, c in enumerate(ids.tolist()):
                q = int(best[j])
                if sims[q, j] > -np.inf:
                    hits.append(_hit(doc_id, doc.chunks[c], float(scores[q, j]), float(sims[q, j])))
            order.append((doc.created_at, doc_id))
        doc_ids = tuple(d for _, d in sorted(order))
        return Ranking(doc_ids, tuple(hits), self.threshold, top_k, default_budget(total_tokens, self.budget_cap))

    def retrieve(
        self,
        query: str,
        doc_ids: Sequence[str],
        *,
        top_k: int | None = None,
        threshold: float | None = None,
        budget_tokens: int | None = None,
        tenant: str | None = None,
    ) -> RetrievalResult:
        """``rank([query], ...).relevant(...)``: the relevant chunks for one query."""
        ranking = self.rank([query], doc_ids, top_k=top_k, tenant=tenant)
        return ranking.relevant(budget_tokens, threshold=threshold)

    def score(self, query: str, doc_ids: Sequence[str], *, tenant: str | None = None) -> list[Hit]:
        """Every chunk of ``doc_ids`` scored for ``query``, unranked."""
        return list(self.rank([query], doc_ids, tenant=tenant).hits)

    def _lexical_scores(self, query: str, loaded: Sequence[_Loaded]) -> list[np.ndarray]:
        scores = [np.zeros(len(doc.chunks), dtype=np.float32) for doc in loaded]
        indexed = [(i, doc.lexical) for i, doc in enumerate(loaded) if doc.lexical is not None]
        if self.lexical_weight > 0 and indexed:
            bm25 = bm25_scores(query, [lexical for _, lexical in indexed])
            for (i, _), s in zip(indexed, bm25, strict=True):
                scores[i] = s
        return scores

    def invalidate(self, doc_id: str | None = None) -> None:
        """Drop cached index/chunks of one document (all when None)."""
        with self._lock:
            if doc_id is None:
                self._cache.clear()
                self._cached_bytes = 0
            else:
                dropped = self._cache.pop(doc_id, None)
                self._cached_bytes -= 0 if dropped is None else dropped.nbytes

    def _load_all(self, doc_ids: Sequence[str], tenant: str | None) -> list[_Loaded]:
        if len(set(doc_ids)) != len(doc_ids):
            raise ValueError("document ids repeat")
        return [self._load(d, tenant) for d in doc_ids]

    def _load(self, doc_id: str, tenant: str | None) -> _Loaded:
        record = self.store.get(doc_id, tenant)
        if record.status != "ready":
            raise DocumentNotReady(doc_id, record.status, record.message)
        with self._lock:
            cached = self._cache.get(doc_id)
            if cached is not None and cached.updated_at == record.updated_at:
                self._cache.move_to_end(doc_id)
                return cached
        chunks = self.store.load_chunks(doc_id)
        passages = self.store.load_passages(doc_id)
        loaded = _Loaded(updated_at=record.updated_at, created_at=record.created_at,
                         index=self.store.load_index(doc_id, self.embedder),
                         chunks=chunks,
                         owners=np.arange(len(chunks)) if passages is None else passages[:, 0].astype(np.int64),
                         lexical=self.store.load_lexical(doc_id), n_tokens=record.n_tokens)
        if len(loaded.owners) != len(loaded.index):
            raise RetrievalError(f"document {doc_id}: {len(loaded.index)} vectors for {len(loaded.owners)} windows")
        with self._lock:
            replaced = self._cache.pop(doc_id, None)
            self._cached_bytes += loaded.nbytes - (0 if replaced is None else replaced.nbytes)
            self._cache[doc_id] = loaded
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                self._cached_bytes -= self._cache.popitem(last=False)[1].nbytes
        return loaded


def _hit(doc_id: str, chunk: Chunk, score: float, similarity: float) -> Hit:
    return Hit(document_id=doc_id, chunk_id=chunk.id, text=chunk.text, score=score, start=chunk.start,
               end=chunk.end, page=chunk.page, n_tokens=chunk.n_tokens, similarity=similarity,
               page_end=chunk.page_end)

