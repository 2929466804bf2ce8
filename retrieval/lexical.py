"""Lexical (BM25) side of retrieval: one document's term counts, saved beside its FAISS index.

BM25 needs corpus statistics (how many chunks hold a term, the mean chunk length). A question is asked over
a set of documents, so each document stores raw term counts (postings) and :func:`bm25_scores` computes the
statistics over exactly the documents asked, at query time: a per-document index with its own statistics
(as a ready-made BM25 library builds one) scores a term by its rarity within that document only, which
ranks chunks across documents against each other on no common scale (docs/benchmarks.md#retrieval).

Terms: lowercased runs of two or more word characters, English stop words dropped, no stemming (why:
docs/benchmarks.md#retrieval).
"""

from __future__ import annotations

import math
import re
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrieval.errors import RetrievalError

LEXICAL_FILE = "lexical.npz"
K1 = 1.2
B = 0.75
_TERM = re.compile(r"\w\w+")
_STOP_WORDS = """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having
    he her here hers herself him himself his how i if in into is it its itself just me more most my myself no
    nor not now of off on once only or other our ours ourselves out over own same she should so some such than
    that the their theirs them themselves then there these they this those through to too under until up very
    was we were what when where which while who whom why will with would you your yours yourself yourselves"""
STOP_WORDS = frozenset(_STOP_WORDS.split())


def terms(text: str) -> list[str]:
    """The text's index terms, in order (repeats kept)."""
    return [t for t in _TERM.findall(text.lower()) if t not in STOP_WORDS]


@dataclass(frozen=True)
class LexicalIndex:
    """Postings of one document: for term ``vocab[t]``, chunks ``chunk_ids[ptr[t]:ptr[t+1]]`` hold it
    ``counts[...]`` times; ``lengths[c]`` is chunk c's number of terms."""

    vocab: np.ndarray  # [V] str, sorted
    ptr: np.ndarray  # [V + 1] int64
    chunk_ids: np.ndarray  # [nnz] int32
    counts: np.ndarray  # [nnz] int32
    lengths: np.ndarray  # [n_chunks] int32
    _lookup: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", {str(t): i for i, t in enumerate(self.vocab)})

    @classmethod
    def build(cls, texts: Sequence[str]) -> LexicalIndex:
        """Index chunk texts (chunk id = position)."""
        per_chunk = [Counter(terms(text)) for text in texts]
        postings: dict[str, list[tuple[int, int]]] = {}
        for cid, counter in enumerate(per_chunk):
            for term, n in counter.items():
                postings.setdefault(term, []).append((cid, n))
        vocab = sorted(postings)
        sizes = [len(postings[t]) for t in vocab]
        flat = [p for t in vocab for p in postings[t]]
        return cls(
            vocab=np.array(vocab, dtype=str) if vocab else np.zeros(0, dtype="<U1"),
            ptr=np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64),
            chunk_ids=np.array([c for c, _ in flat], dtype=np.int32),
            counts=np.array([n for _, n in flat], dtype=np.int32),
            lengths=np.array([sum(c.values()) for c in per_chunk], dtype=np.int32),
        )

    @property
    def n_chunks(self) -> int:
        return len(self.lengths)

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        """(chunk ids, counts) of ``term``; empty when the document lacks it."""
        t = self._lookup.get(term)
        if t is None:
            return self.chunk_ids[:0], self.counts[:0]
        return self.chunk_ids[self.ptr[t] : self.ptr[t + 1]], self.counts[self.ptr[t] : self.ptr[t + 1]]

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / LEXICAL_FILE).open("wb") as f:
            vocab = np.frombuffer("\n".join(self.vocab.tolist()).encode("utf-8"), dtype=np.uint8)  # compact
            np.savez_compressed(f, vocab=vocab, ptr=self.ptr, chunk_ids=self.chunk_ids, counts=self.counts,
                     lengths=self.lengths)

    @classmethod
    def load(cls, directory: Path) -> LexicalIndex:
        path = directory / LEXICAL_FILE
        try:
            with np.load(path, allow_pickle=False) as data:
                blob = data["vocab"].tobytes().decode("utf-8")
                vocab = np.array(blob.split("\n") if blob else [], dtype=str)
                index = cls(vocab=vocab, ptr=data["ptr"], chunk_ids=data["chunk_ids"],
                            counts=data["counts"], lengths=data["lengths"])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            raise RetrievalError(f"lexical index {path.name} is unreadable: {exc}") from None
        if len(index.ptr) != len(index.vocab) + 1 or index.ptr[-1] != len(index.chunk_ids):
            raise RetrievalError(f"lexical index {path.name} is inconsistent")
        return index


def bm25_scores(query: str, indexes: Sequence[LexicalIndex], k1: float = K1, b: float = B) -> list[np.ndarray]:
    """BM25 of every chunk of every index for ``query``, with term rarity and mean chunk length taken over
    all of ``indexes`` together; each score divided by the most any chunk could score for this query
    (every query term saturated), so scores lie in [0, 1) and mean the same for every question."""
    scores = [np.zeros(ix.n_chunks, dtype=np.float32) for ix in indexes]
    query_terms = terms(query)
    n = sum(ix.n_chunks for ix in indexes)
    if not query_terms or n == 0:
        return scores
    avgdl = max(sum(int(ix.lengths.sum()) for ix in indexes) / n, 1.0)
    norms = [k1 * (1 - b + b * ix.lengths.astype(np.float32) / avgdl) for ix in indexes]
    ceiling = 0.0
    for term in query_terms:
        hits = [ix.postings(term) for ix in indexes]
        df = sum(len(ids) for ids, _ in hits)
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        ceiling += idf * (k1 + 1)
        for score, norm, (ids, counts) in zip(scores, norms, hits, strict=True):
            if len(ids):
                tf = counts.astype(np.float32)
                score[ids] += idf * tf * (k1 + 1) / (tf + norm[ids])
    return [s / ceiling for s in scores]


def bm25_of_chunks(query: str, index: LexicalIndex, chunk_ids: np.ndarray, n: int, avgdl: float,
                   df: dict[str, int], k1: float = K1, b: float = B) -> np.ndarray:
    """BM25 of some chunks of one document (``chunk_ids``) for ``query``, with the corpus statistics given (a
    collection's: ``n`` chunks, mean length ``avgdl``, ``df[term]`` chunks holding each term), divided by the most
    any chunk could score, as ``bm25_scores`` does: a collection's candidates score on the scale of a named
    document's chunks."""
    out = np.zeros(len(chunk_ids), dtype=np.float32)
    query_terms = terms(query)
    if not query_terms or n == 0 or len(chunk_ids) == 0:
        return out
    position = {int(c): i for i, c in enumerate(chunk_ids)}
    norm = k1 * (1 - b + b * index.lengths[chunk_ids].astype(np.float32) / max(avgdl, 1.0))
    ceiling = 0.0
    for term in query_terms:
        d = df.get(term, 0)
        idf = math.log(1 + (n - d + 0.5) / (d + 0.5))
        ceiling += idf * (k1 + 1)
        ids, counts = index.postings(term)
        for cid, count in zip(ids.tolist(), counts.tolist(), strict=True):
            i = position.get(cid)
            if i is not None:
                out[i] += idf * count * (k1 + 1) / (count + norm[i])
    return out / ceiling
