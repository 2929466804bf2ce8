"""Citation attribution on bench/data's QA set: lexical support (app/answering/citations.py) against the embedder.

    python -m bench.citations [--json PATH]

Each question's document is chunked as the service chunks it (512 target tokens); its sources are the five
chunks BM25 ranks best for the question (the chunk holding the answer passage added if BM25 missed it), so
the wrong candidates are the document's most similar chunks. Sentences to attribute:

- ``passage``: the sentences of the answer passage, as an answer that restates its source says them;
- ``question``: the question itself, a restatement with the question's own wording (the paraphrased ones
  share few words with their passage): a hard case for any attribution;
- ``off_topic``: passage sentences of the other family of texts (PEP sentences against licence chunks and
  the reverse), which no candidate supports: every citation of one is wrong.

For each method and threshold: ``cited`` (share of sentences cited), ``precision`` (share of the citations
that name the chunk holding the passage; for off_topic, the share cited is the false-citation rate).
Methods: ``lexical`` (``app.answering.citations.attribute``'s weighted content-word support) and ``embedder``
(cosine similarity between the sentence and the source's best sentence, bundled MiniLM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from app.answering import citations
from bench.common import out
from bench.datasets import load_qa
from bench.retrieval import load_target_tokenizer
from retrieval.chunking import chunk_text
from retrieval.embedding import load_embedder
from retrieval.lexical import LexicalIndex, bm25_scores

LEXICAL_THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
EMBEDDER_THRESHOLDS = (0.4, 0.5, 0.6, 0.7, 0.8)
N_SOURCES = 5
LICENCES = ("gpl-3.0", "apache-2.0", "mpl-2.0", "gfdl-1.3", "lgpl-2.1", "debian-python-policy")


def cases(tokenizer: Any) -> list[dict[str, Any]]:
    """(kind, sentence, candidate texts, index of the right one or -1) over the QA set."""
    docs = load_qa()
    passages = {d.doc_id: [q.answer_passage for q in d.questions] for d in docs}
    out_cases: list[dict[str, Any]] = []
    for d in docs:
        chunks = chunk_text(d.text, tokenizer, max_tokens=512)
        lexical = LexicalIndex.build([c.text for c in chunks])
        others = [p for doc_id, ps in passages.items() if (doc_id in LICENCES) != (d.doc_id in LICENCES) for p in ps]
        for k, q in enumerate(d.questions):
            gold = next(i for i, c in enumerate(chunks) if c.start <= q.answer_start < c.end)
            (scores,) = bm25_scores(q.question, [lexical])
            picked = [int(i) for i in np.argsort(-scores)[:N_SOURCES]]
            if gold not in picked:
                picked[-1] = gold
            texts = [chunks[i].text for i in picked]
            right = picked.index(gold)
            for s in citations.sentences(q.answer_passage):
                out_cases.append({"kind": "passage", "sentence": q.answer_passage[s.start : s.end], "texts": texts,
                                  "right": right})
            out_cases.append({"kind": "question", "sentence": q.question, "texts": texts, "right": right})
            off = others[(7 * k + len(d.doc_id)) % len(others)]
            for s in citations.sentences(off)[:1]:
                out_cases.append({"kind": "off_topic", "sentence": off[s.start : s.end], "texts": texts, "right": -1})
    return out_cases


def lexical_support(case: dict[str, Any]) -> tuple[int, float]:
    """The best source and its support, with the threshold off (``attribute``'s own rule otherwise)."""
    sentence = case["sentence"]
    saved = citations.MIN_SUPPORT
    citations.MIN_SUPPORT = 0.0
    try:
        found = citations.attribute(sentence, case["texts"])
    finally:
        citations.MIN_SUPPORT = saved
    if not found.citations:
        return -1, 0.0
    best = max(found.citations, key=lambda c: c[1] - c[0])  # the case's sentence (one, rarely split further)
    return best[2], best[3]


def embedder_support(case: dict[str, Any], embed: Any) -> tuple[int, float]:
    """The source holding the sentence most similar to the case's sentence, and that cosine similarity."""
    query = embed([case["sentence"]])[0]
    best, best_sim = -1, -1.0
    for j, text in enumerate(case["texts"]):
        spans = citations.sentences(text)
        if not spans:
            continue
        vectors = embed([text[s.start : s.end] for s in spans])
        sim = float((vectors @ query).max())
        if sim > best_sim:
            best, best_sim = j, sim
    return best, best_sim


def summarize(results: list[tuple[str, int, int, float]], thresholds: tuple[float, ...]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for kind in ("passage", "question", "off_topic"):
        rows = [(right, got, score) for k, right, got, score in results if k == kind]
        per: dict[str, Any] = {"n": len(rows)}
        for t in thresholds:
            cited = [(right, got) for right, got, score in rows if got >= 0 and score >= t]
            per[f"{t:.2f}"] = {
                "cited": round(len(cited) / max(len(rows), 1), 3),
                "precision": round(sum(r == g for r, g in cited) / len(cited), 3) if cited else None,
            }
        report[kind] = per
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path("bench/results/citations.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_target_tokenizer()
    embedder = load_embedder("bundled", device="cpu")
    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in cache]
        if missing:
            for t, v in zip(missing, embedder.encode(missing), strict=True):
                cache[t] = v
        return np.stack([cache[t] for t in texts])

    all_cases = cases(tokenizer)
    out(f"{len(all_cases)} sentences to attribute")
    lexical = [(c["kind"], c["right"], *lexical_support(c)) for c in all_cases]
    dense = [(c["kind"], c["right"], *embedder_support(c, embed)) for c in all_cases]
    report = {
        "about": __doc__.split("\n\n")[0],
        "sources_per_question": N_SOURCES,
        "current": {"method": "lexical", "min_support": citations.MIN_SUPPORT, "min_shared": citations.MIN_SHARED},
        "lexical": summarize(lexical, LEXICAL_THRESHOLDS),
        "embedder": summarize(dense, EMBEDDER_THRESHOLDS),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    out(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
