"""bench.retrieval, parts 2-4 over bench/data's QA set: recall@k by scoring method, query latency, and the
similarity threshold's calibration (see bench/retrieval.py's docstring for what each measures)."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.datasets import QADoc, load_qa
from retrieval.chunking import Chunk
from retrieval.embedding import Embedder
from retrieval.lexical import bm25_scores
from retrieval.retriever import DEFAULT_LEXICAL_WEIGHT, Retriever, default_threshold
from retrieval.store import DocumentStore

OFF_TOPIC = [
    "What is the boiling point of water at sea level?",
    "Who won the football world cup in 1998?",
    "How do I bake a chocolate cake without eggs?",
    "What is the capital city of Australia?",
    "How many moons does Jupiter have?",
    "Which vitamins are found in oranges?",
    "How fast can a cheetah run?",
    "What is the best way to train a puppy to sit?",
    "When did the Roman empire fall?",
    "How do airplanes stay in the air?",
    "What causes the northern lights?",
    "How long should I boil an egg for a soft yolk?",
]
SPLITS = ("calibration", "held_out", "all")
SCOPES = ("own_doc", "all_docs")
WEIGHT_GRID = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0)


def gold_chunk_ids(chunks: Sequence[Chunk], start: int, end: int) -> set[int]:
    return {c.id for c in chunks if c.start < end and start < c.end}


@dataclass
class Scored:
    """One question: its gold chunks and every candidate chunk's similarity and BM25 score, by scope."""

    held_out: bool
    paraphrased: bool | None
    gold: set[tuple[str, int]]
    keys: dict[str, list[tuple[str, int]]]  # scope -> chunk keys
    similarity: dict[str, np.ndarray]
    bm25: dict[str, np.ndarray]
    chunk_vector: dict[str, np.ndarray]  # one vector per whole chunk (the dense scoring before windows)


def _components(dense: Retriever, lexical: Retriever, question: str, doc_ids: list[str]) -> tuple[
        list[tuple[str, int]], np.ndarray, np.ndarray]:
    hits = dense.score(question, doc_ids)
    bm25 = {(h.document_id, h.chunk_id): h.score for h in lexical.score(question, doc_ids)}
    keys = [(h.document_id, h.chunk_id) for h in hits]
    return keys, np.array([h.score for h in hits]), np.array([bm25[k] for k in keys])


def first_gold_rank(keys: Sequence[tuple[str, int]], scores: np.ndarray, gold: set[tuple[str, int]]) -> int:
    """0-based rank of the best-ranked gold chunk (ties broken by position, as a stable sort does)."""
    order = np.argsort(-scores, kind="stable")
    return next(r for r, i in enumerate(order) if keys[i] in gold)


def ranking_metrics(ranks: Sequence[int]) -> dict[str, float]:
    n = max(len(ranks), 1)
    return {"recall@1": sum(r < 1 for r in ranks) / n, "recall@3": sum(r < 3 for r in ranks) / n,
            "recall@5": sum(r < 5 for r in ranks) / n, "mrr": sum(1 / (r + 1) for r in ranks) / n,
            "questions": len(ranks)}


def _in_split(q: Scored, split: str) -> bool:
    return split == "all" or (split == "held_out") == q.held_out


def evaluate(scored: Sequence[Scored], weight: float) -> dict[str, Any]:
    """Recall@1/3/5 and MRR of ``(1 - weight) * similarity + weight * bm25`` by split and scope."""
    out: dict[str, Any] = {}
    for split in SPLITS:
        for scope in SCOPES:
            ranks = [first_gold_rank(q.keys[scope], (1 - weight) * q.similarity[scope] + weight * q.bm25[scope],
                                     q.gold) for q in scored if _in_split(q, split)]
            out[f"{split}/{scope}"] = ranking_metrics(ranks)
    return out


def _evaluate_chunk_vectors(scored: Sequence[Scored]) -> dict[str, Any]:
    return {f"{split}/{scope}": ranking_metrics([first_gold_rank(q.keys[scope], q.chunk_vector[scope], q.gold)
                                                 for q in scored if _in_split(q, split)])
            for split in SPLITS for scope in SCOPES}


def bench_qa(tokenizer: Any, embedder: Embedder, chunk_tokens: int, latency_rounds: int) -> dict[str, Any]:
    docs = load_qa()
    with tempfile.TemporaryDirectory(prefix="ragspec-qa-") as tmp:
        store = DocumentStore(Path(tmp))
        ids: dict[str, str] = {}
        for doc in docs:
            record = store.create(None, doc.title, doc.filename, "text/plain", doc.text.encode("utf-8"))
            store.ingest(record.id, tokenizer, embedder, chunk_tokens)
            ids[doc.doc_id] = record.id
        all_ids = list(ids.values())
        dense = Retriever(store, embedder, scoring="dense", threshold=-1.0)
        lexical = Retriever(store, embedder, scoring="hybrid", lexical_weight=1.0, threshold=-1.0)
        scored = _score_questions(store, dense, lexical, docs, ids, all_ids)
        grid = {w: evaluate(scored, w) for w in WEIGHT_GRID}
        chosen = max(WEIGHT_GRID, key=lambda w: (grid[w]["calibration/all_docs"]["mrr"], -w))
        methods = {"dense_one_vector_per_chunk": _evaluate_chunk_vectors(scored), "dense": grid[0.0],
                   "lexical": grid[1.0], "hybrid": grid[DEFAULT_LEXICAL_WEIGHT]}
        served = _check_served(store, embedder, scored, docs, ids, all_ids)
        latency = {scoring: _latency(Retriever(store, embedder, scoring=scoring), docs, ids, all_ids,
                                     latency_rounds) for scoring in ("hybrid", "dense")}
        latency["bm25_only_all_documents"] = _bm25_latency(store, docs, all_ids)
        calibration = _calibrate(store, embedder, docs, ids)
        sizes = {doc.doc_id: store.get(ids[doc.doc_id]).n_tokens for doc in docs}
        n_chunks = {doc.doc_id: store.get(ids[doc.doc_id]).n_chunks for doc in docs}
        store.close()
    w = DEFAULT_LEXICAL_WEIGHT
    paraphrased = {flag: ranking_metrics([
        first_gold_rank(q.keys["all_docs"], (1 - w) * q.similarity["all_docs"] + w * q.bm25["all_docs"], q.gold)
        for q in scored if q.held_out and q.paraphrased is flag]) for flag in (True, False)}
    return {"chunk_tokens": chunk_tokens, "documents": len(docs), "questions": len(scored),
            "held_out_questions": sum(q.held_out for q in scored), "document_tokens": sizes,
            "document_chunks": n_chunks, "methods": methods, "lexical_weight_in_code": DEFAULT_LEXICAL_WEIGHT,
            "lexical_weight_calibrated": chosen,
            "weight_grid": {str(w): {k: v["mrr"] for k, v in r.items()} | {
                k + " recall@1": v["recall@1"] for k, v in r.items()} for w, r in grid.items()},
            "held_out_all_docs_by_wording": {"paraphrased" if k else "own_terms": v for k, v in paraphrased.items()},
            "served_path_matches": served, "latency_ms": latency, "threshold_calibration": calibration}


def _score_questions(store: DocumentStore, dense: Retriever, lexical: Retriever, docs: list[QADoc],
                     ids: dict[str, str], all_ids: list[str]) -> list[Scored]:
    chunk_vectors = {(doc_id, c.id): v for doc_id in all_ids for c, v in zip(
        store.load_chunks(doc_id), dense.embedder.encode([c.text for c in store.load_chunks(doc_id)]), strict=True)}
    scored = []
    for doc in docs:
        chunks = store.load_chunks(ids[doc.doc_id])
        for q in doc.questions:
            gold = {(ids[doc.doc_id], c) for c in gold_chunk_ids(chunks, q.answer_start, q.answer_end)}
            item = Scored(q.held_out, q.paraphrased, gold, {}, {}, {}, {})
            query_vec = dense.embedder.encode_query(q.question)
            for scope, scope_ids in (("own_doc", [ids[doc.doc_id]]), ("all_docs", all_ids)):
                item.keys[scope], item.similarity[scope], item.bm25[scope] = _components(
                    dense, lexical, q.question, scope_ids)
                item.chunk_vector[scope] = np.array([float(chunk_vectors[k] @ query_vec) for k in item.keys[scope]])
            scored.append(item)
    return scored


def _check_served(store: DocumentStore, embedder: Embedder, scored: Sequence[Scored], docs: list[QADoc],
                  ids: dict[str, str], all_ids: list[str]) -> bool:
    """The served retriever (default settings, no threshold) ranks first what the offline fusion ranks first."""
    served = Retriever(store, embedder, threshold=-1.0, top_k=1, budget_cap=10**9)
    w = DEFAULT_LEXICAL_WEIGHT
    questions = [q.question for d in docs for q in d.questions]
    for question, q in zip(questions, scored, strict=True):
        [hit] = served.retrieve(question, all_ids, budget_tokens=10**9).hits
        fused = (1 - w) * q.similarity["all_docs"] + w * q.bm25["all_docs"]
        if not np.isclose(hit.score, fused.max(), atol=1e-5):
            return False
    return True


def _latency(retriever: Retriever, docs: list[QADoc], ids: dict[str, str], all_ids: list[str],
             rounds: int) -> dict[str, Any]:
    """Per-query latency of ``retrieve`` with torch's thread count and with one thread, interleaved (a single
    short query gains nothing from threads, and on a busy machine their barriers cost a lot)."""
    import torch

    questions = [(q.question, ids[d.doc_id]) for d in docs for q in d.questions]
    retriever.retrieve(questions[0][0], all_ids)  # warm the caches
    default_threads = torch.get_num_threads()
    ms: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for threads in (default_threads, 1):
                torch.set_num_threads(threads)
                for question, doc_id in questions:
                    t0 = time.perf_counter()
                    retriever.retrieve(question, [doc_id])
                    t1 = time.perf_counter()
                    retriever.retrieve(question, all_ids)
                    t2 = time.perf_counter()
                    ms.setdefault(f"one_document_{threads}_threads", []).append((t1 - t0) * 1e3)
                    ms.setdefault(f"all_documents_{threads}_threads", []).append((t2 - t1) * 1e3)
    finally:
        torch.set_num_threads(default_threads)
    result: dict[str, Any] = {name: _stats(values) for name, values in ms.items()}
    result["one_document"] = result[f"one_document_{default_threads}_threads"]
    result["all_documents"] = result[f"all_documents_{default_threads}_threads"]
    return result


def _bm25_latency(store: DocumentStore, docs: list[QADoc], all_ids: list[str]) -> dict[str, float]:
    """The lexical part alone: BM25 over every document's postings (loaded once), per question."""
    indexes = [ix for ix in (store.load_lexical(d) for d in all_ids) if ix is not None]
    values = []
    for question in (q.question for d in docs for q in d.questions):
        t0 = time.perf_counter()
        bm25_scores(question, indexes)
        values.append((time.perf_counter() - t0) * 1e3)
    return _stats(values)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p95": float(np.percentile(values, 95)), "n": len(values)}


def _calibrate(
    store: DocumentStore, embedder: Embedder, docs: list[QADoc], ids: dict[str, str]
) -> dict[str, Any]:
    """The similarity threshold from the calibration questions only (held-out ones reported apart)."""
    retriever = Retriever(store, embedder, scoring="dense", threshold=-1.0)
    gold_scores: dict[bool, list[float]] = {False: [], True: []}
    best_other: list[float] = []  # best non-gold chunk of the question's own document
    off_topic_best: list[float] = []
    for doc in docs:
        doc_id = ids[doc.doc_id]
        chunks = store.load_chunks(doc_id)
        for q in doc.questions:
            sims = {h.chunk_id: h.score for h in retriever.score(q.question, [doc_id])}
            gold = gold_chunk_ids(chunks, q.answer_start, q.answer_end)
            gold_scores[q.held_out].append(max(sims[c] for c in gold))
            others = [s for c, s in sims.items() if c not in gold]
            if others and not q.held_out:
                best_other.append(max(others))
        off_topic_best.extend(max(h.score for h in retriever.score(query, [doc_id])) for query in OFF_TOPIC)
    calibrated = round((max(off_topic_best) + min(gold_scores[False])) / 2 * 20) / 20

    def share(values: list[float], threshold: float, above: bool) -> float:
        return sum((v >= threshold) == above for v in values) / len(values)

    def quantiles(values: list[float]) -> dict[str, float]:
        q = {f"p{p}": float(np.percentile(values, p)) for p in (5, 25, 50, 75, 95)}
        return {"min": min(values), **q, "max": max(values)}

    current = default_threshold(embedder.name)

    def at(threshold: float) -> dict[str, float]:
        return {"gold_kept": share(gold_scores[False], threshold, True),
                "held_out_gold_kept": share(gold_scores[True], threshold, True),
                "off_topic_dropped": share(off_topic_best, threshold, False)}

    return {
        "method": "midpoint of the highest off-topic best similarity and the lowest gold-chunk similarity of "
                  "the calibration questions, rounded to 0.05 (similarity: a chunk's best window)",
        "embedder": embedder.name, "calibrated_threshold": calibrated, "threshold_in_code": current,
        "gold_scores": quantiles(gold_scores[False]), "held_out_gold_scores": quantiles(gold_scores[True]),
        "best_non_gold_scores": quantiles(best_other), "off_topic_best_scores": quantiles(off_topic_best),
        "at_calibrated": at(calibrated), "at_threshold_in_code": at(current),
        "off_topic_queries": len(OFF_TOPIC), "documents": len(docs),
    }

