"""bench.retrieval, part 1: ingest against embedding alone, side by side on the same text.

``embed`` = ``embedder.encode`` over the text's chunk windows alone; ``ingest`` = ``DocumentStore.create`` +
``ingest`` (parse, tokenize once, chunk, embed, index, write atomically). Runs are interleaved (embed, ingest,
ingest, embed, ...) and the medians compared; ingest also reports its own overhead measured inside the same run
(ingest time minus the time its embedder calls took), as a ratio across runs is noisy on a shared machine.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import out
from bench.datasets import load_qa
from retrieval.chunking import chunk_text, passage_spans, tokenize
from retrieval.embedding import Embedder
from retrieval.lexical import LEXICAL_FILE, LexicalIndex
from retrieval.store import DocumentStore


def corpus_text(size_chars: int) -> str:
    """About ``size_chars`` of real text: the QA documents, repeated."""
    docs = "\n\n".join(d.text for d in load_qa())
    return (docs + "\n\n") * (size_chars // (len(docs) + 2)) + docs[: size_chars % (len(docs) + 2)]


class TimedEmbedder:
    """Forwards to an embedder and adds up the time spent in ``encode``."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.seconds = 0.0

    def encode(self, texts: Sequence[str], batch_size: int = 32, progress: Any = None) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self.inner.encode(texts, batch_size=batch_size, progress=progress)
        finally:
            self.seconds += time.perf_counter() - t0

    def encode_query(self, text: str) -> np.ndarray:
        return self.inner.encode_query(text)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result



def bench_ingest(tokenizer: Any, embedder: Embedder, size_chars: int, reps: int, chunk_tokens: int,
                 batch_size: int) -> dict[str, Any]:
    text = corpus_text(size_chars)
    data = text.encode("utf-8")
    t_tok, tokens = timed(lambda: tokenize(text, tokenizer))
    t_chunk, chunks = timed(lambda: chunk_text(text, tokenizer, chunk_tokens, tokens=tokens))
    texts = [text[a:b] for c in chunks for a, b in passage_spans(c)]  # what ingest embeds: the windows
    t_lexical, lexical = timed(lambda: LexicalIndex.build([c.text for c in chunks]))
    t_chunk_vectors, _ = timed(lambda: embedder.encode([c.text for c in chunks], batch_size=batch_size))
    out(f"ingest: {len(data) / 1e6:.2f} MB, {len(tokens)} tokens, {len(chunks)} chunks (<= {chunk_tokens}), "
        f"{len(texts)} windows")
    with tempfile.TemporaryDirectory(prefix="ragspec-lex-") as tmp:
        lexical.save(Path(tmp))
        lexical_bytes = (Path(tmp) / LEXICAL_FILE).stat().st_size
    embed_s: list[float] = []
    ingest_s: list[float] = []
    inside_s: list[float] = []  # embedder time inside each ingest
    with tempfile.TemporaryDirectory(prefix="ragspec-bench-") as tmp:
        store = DocumentStore(Path(tmp))

        def run_embed() -> None:
            seconds, _ = timed(lambda: embedder.encode(texts, batch_size=batch_size))
            embed_s.append(seconds)
            out(f"  embed  {seconds:8.2f} s")

        def run_ingest() -> None:
            probe = TimedEmbedder(embedder)

            def work() -> None:
                record = store.create(None, "bench", "bench.txt", "text/plain", data)
                store.ingest(record.id, tokenizer, probe, chunk_tokens, batch_size=batch_size)
                store.delete(record.id)

            seconds, _ = timed(work)
            ingest_s.append(seconds)
            inside_s.append(probe.seconds)
            out(f"  ingest {seconds:8.2f} s (embedding inside {probe.seconds:.2f} s)")

        for rep in range(reps):  # ABBA: embed, ingest, ingest, embed, ...
            order = [run_embed, run_ingest] if rep % 2 == 0 else [run_ingest, run_embed]
            for step in order:
                step()
        store.close()
    ratio = statistics.median(ingest_s) / statistics.median(embed_s)
    overhead = statistics.median([(a - b) / b for a, b in zip(ingest_s, inside_s, strict=True)])
    return {
        "text_bytes": len(data), "tokens": len(tokens), "chunks": len(chunks), "chunk_tokens": chunk_tokens,
        "batch_size": batch_size, "repetitions": reps, "tokenize_s": t_tok, "chunk_s": t_chunk,
        "embed_s": embed_s, "ingest_s": ingest_s, "embed_median_s": statistics.median(embed_s),
        "ingest_median_s": statistics.median(ingest_s), "ingest_over_embed": ratio,
        "embed_inside_ingest_s": inside_s, "overhead_in_run": overhead,
        "embed_chunks_per_s": len(chunks) / statistics.median(embed_s), "windows": len(texts),
        "embed_one_vector_per_chunk_s": t_chunk_vectors,
        "windows_over_chunk_vectors": statistics.median(embed_s) / t_chunk_vectors,
        "lexical_build_s": t_lexical, "lexical_bytes": lexical_bytes,
        "ingest_mb_per_min": len(data) / 1e6 / statistics.median(ingest_s) * 60,
        "acceptance_ratio_max": 1.10, "accepted_side_by_side": ratio <= 1.10,
        "accepted_in_run": 1 + overhead <= 1.10,
    }

