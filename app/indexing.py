"""Background indexing: one worker thread takes stored documents from a queue and ingests them.

Status and progress live in the document store's rows (queued -> indexing -> ready | failed, with a
message on failure), so they survive restarts; the store's ``recover()`` turns an ingest cut by a crash
into ``failed``. ``on_ready`` runs after a successful ingest (the app warms the document's KV prefix).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrieval.embedding import Embedder
from retrieval.errors import DocumentNotFound
from retrieval.store import DocumentStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexingConfig:
    chunk_tokens: int
    chunk_overlap: int


class IndexingJobs:
    def __init__(
        self,
        store: DocumentStore,
        tokenizer: Any,
        embedder: Embedder,
        config: IndexingConfig,
        on_ready: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.tokenizer = tokenizer
        self.embedder = embedder
        self.config = config
        self.on_ready = on_ready
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._unfinished = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="ragspec-indexing", daemon=True)
        self._thread.start()

    def submit(self, doc_id: str) -> None:
        with self._lock:
            self._unfinished += 1
        self._queue.put(doc_id)

    @property
    def pending(self) -> int:
        """Documents submitted and not finished (queued or being indexed)."""
        with self._lock:
            return self._unfinished

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        while True:
            doc_id = self._queue.get()
            if doc_id is None:
                return
            try:
                self._ingest(doc_id)
            finally:
                with self._lock:
                    self._unfinished -= 1

    def _ingest(self, doc_id: str) -> None:
        try:
            self.store.ingest(
                doc_id, self.tokenizer, self.embedder, self.config.chunk_tokens, self.config.chunk_overlap
            )
        except DocumentNotFound:
            logger.info("document %s was deleted before it was indexed", doc_id)
            return
        except Exception:  # the store has marked the document failed with the reason
            logger.warning("indexing %s failed", doc_id, exc_info=True)
            return
        if self.on_ready is not None:
            try:
                self.on_ready(doc_id)
            except Exception:
                logger.warning("after-indexing hook failed for %s", doc_id, exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
