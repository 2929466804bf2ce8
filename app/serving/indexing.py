"""Background indexing: one worker thread ingests stored documents, claiming each through its ingestion job.

Status and progress live in the document store's rows (queued -> indexing -> ready | failed, with a
message on failure), so they survive restarts. Each queued document also has a job row in the catalogue
(written with the document by ``DocumentStore.create``): the worker claims it with a lease, renews the lease
while it works and deletes the row when done. Several processes sharing one catalogue (cluster replicas) therefore
ingest each document once, and a job whose worker died (its lease ran out) is taken over by the next worker that
polls. In one process the store's ``recover()`` at start-up turns an ingest cut by a crash into ``failed``
instead. ``on_ready`` runs after a successful ingest (the app warms the document's KV prefix).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from retrieval.embedding import Embedder
from retrieval.errors import DocumentNotFound, IngestAbandoned
from retrieval.store import Claim, DocumentStore

logger = logging.getLogger(__name__)

_POLL = ""  # queue item: look for a job nobody holds (or whose holder died)


@dataclass(frozen=True)
class IndexingConfig:
    chunk_tokens: int
    chunk_overlap: int
    lease_s: float = 30.0  # a claimed job is another worker's to take once its lease runs out
    poll_s: float = 5.0  # how often an idle worker looks for such jobs
    max_attempts: int = 3  # a document whose ingestion was cut this often fails


def worker_name() -> str:
    """Who holds a job: host, process and a random part (a restarted process is another worker)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


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
        self.name = worker_name()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._unfinished = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="ragspec-indexing", daemon=True)
        self._thread.start()

    def submit(self, doc_id: str) -> None:
        """Queue a stored document's ingestion (``store.create`` wrote its job: another worker may take it if this
        one is busy). No database work here: the caller may be the event loop."""
        with self._lock:
            self._unfinished += 1
        self._queue.put(doc_id)

    @property
    def pending(self) -> int:
        """Documents submitted here and not finished (queued or being indexed)."""
        with self._lock:
            return self._unfinished

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _work(self) -> None:
        while True:
            try:
                doc_id = self._queue.get(timeout=self.config.poll_s)
            except queue.Empty:
                doc_id = _POLL
            if doc_id is None:
                return
            try:
                self._run_claimed(doc_id or None)
            except Exception:  # the catalogue unreachable for a while: the job stays, its lease runs out
                logger.warning("ingestion job for %s could not be claimed", doc_id or "any document", exc_info=True)
            finally:
                if doc_id:
                    with self._lock:
                        self._unfinished -= 1

    def _run_claimed(self, doc_id: str | None) -> None:
        """Claim ``doc_id``'s job (or, None, any job up for grabs) and ingest it; one held elsewhere is left."""
        while True:
            claim = self.store.claim_ingest(self.name, self.config.lease_s, self.config.max_attempts, doc_id)
            if claim is None:
                return
            if claim.attempt > 1:
                logger.warning("taking over the ingestion of %s (attempt %d)", claim.doc_id, claim.attempt)
            stop = threading.Event()
            beat = threading.Thread(target=self._heartbeat, args=(claim, stop), name="ragspec-lease", daemon=True)
            beat.start()
            try:
                self._ingest(claim)
            finally:
                stop.set()
                beat.join()
                self.store.finish_ingest(claim)
            if doc_id is not None:
                return

    def _heartbeat(self, claim: Claim, stop: threading.Event) -> None:
        while not stop.wait(self.config.lease_s / 3):
            try:
                if not self.store.renew_ingest(claim, self.config.lease_s):
                    logger.warning("lost the lease on %s's ingestion (another worker took it over)", claim.doc_id)
                    return
            except Exception:
                logger.warning("could not renew the lease on %s's ingestion", claim.doc_id, exc_info=True)

    def _ingest(self, claim: Claim) -> None:
        doc_id = claim.doc_id
        try:
            self.store.ingest(
                doc_id, self.tokenizer, self.embedder, self.config.chunk_tokens, self.config.chunk_overlap,
                holds=lambda: self.store.renew_ingest(claim, self.config.lease_s),
            )
        except IngestAbandoned:
            logger.warning("dropped the ingestion of %s: another worker took it over", doc_id)
            return
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
