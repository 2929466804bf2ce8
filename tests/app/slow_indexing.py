"""Indexing a running server slowly enough to watch: the server's real embedder, pausing after each batch.

The bundled MiniLM embeds a test document's batches faster than a client polls; pausing after each batch
(the embedder still does all the work, and the store still reports each batch) lets a poller see every
step. ``long_text`` is a document of several embedding batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from retrieval.embedding import DEFAULT_BATCH_SIZE, Embedder, Progress
from tests.app.live import ThreadServer


class PausingEmbedder:
    """``inner`` with a pause after each batch of ``encode`` (queries are not slowed)."""

    def __init__(self, inner: Embedder, pause_s: float) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.pause_s = pause_s
        self.batches = 0

    def encode(
        self, texts: Sequence[str], batch_size: int = DEFAULT_BATCH_SIZE, progress: Progress | None = None
    ) -> np.ndarray:
        def paced(done: int, total: int) -> None:
            self.batches += 1
            if progress is not None:
                progress(done, total)
            time.sleep(self.pause_s)

        return self.inner.encode(texts, batch_size, paced)

    def encode_query(self, text: str) -> np.ndarray:
        return self.inner.encode_query(text)


@contextmanager
def slow_indexing(server: ThreadServer, pause_s: float) -> Iterator[PausingEmbedder]:
    """While inside, the server's indexing worker embeds through a :class:`PausingEmbedder`."""
    jobs = server.app.state.services.indexing
    real = jobs.embedder
    jobs.embedder = PausingEmbedder(real, pause_s)
    try:
        yield jobs.embedder
    finally:
        jobs.embedder = real


PLACES = ("harbour", "lighthouse", "granary", "mill", "chapel", "bridge", "market", "quarry", "orchard", "forge")
EVENTS = ("was rebuilt", "flooded", "was sold", "burned down", "was painted", "gained a bell", "was measured")


def long_text(sentences: int = 480) -> str:
    """About 13 words a sentence: 480 sentences are ~200 passages (60-word windows, 30 apart), 7 batches of 32."""
    lines = [
        f"Record {i} says the {PLACES[i % len(PLACES)]} by the {PLACES[(i * 7 + 3) % len(PLACES)]} "
        f"{EVENTS[i % len(EVENTS)]} in the year {1700 + i}."
        for i in range(sentences)
    ]
    return "\n\n".join(" ".join(lines[k : k + 8]) for k in range(0, len(lines), 8))
