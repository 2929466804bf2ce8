"""Background indexing: one worker thread ingests stored documents, claiming each through its ingestion job;
documents queued together (many small files uploaded at once) are embedded together, in full batches.

Status and progress live in the document store's rows (queued -> indexing -> ready | failed, with a
message on failure), so they survive restarts. Each queued document also has a job row in the catalogue
(written with the document by ``DocumentStore.create``): the worker claims it with a lease, renews the lease
while it works and deletes the row when done. Several processes sharing one catalogue (cluster replicas) therefore
ingest each document once, and a job whose worker died (its lease ran out) is taken over by the next worker that
polls. In one process the store's ``recover()`` at start-up turns an ingest cut by a crash into ``failed``
instead. ``on_ready`` runs after a successful ingest, with the documents of the group that became ready (the app
warms their KV prefixes and brings their collections' indexes in step).
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
    group_docs: int = 32  # documents queued together are embedded together (full batches from small files) ...
    group_bytes: int = 256 * 1024  # ... while their files add up to this; a larger file is indexed alone


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
        on_ready: Callable[[list[str]], None] | None = None,
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
                first = self._queue.get(timeout=self.config.poll_s)
            except queue.Empty:
                first = _POLL
            if first is None:
                return
            doc_ids, stopping = self._more([first] if first else [])
            try:
                self._run_claimed(doc_ids)
            except Exception:  # the catalogue unreachable for a while: the jobs stay, their leases run out
                logger.warning("ingestion jobs for %s could not be claimed", doc_ids or "any document", exc_info=True)
            finally:
                with self._lock:
                    self._unfinished -= len(doc_ids)
            if stopping:
                return

    def _more(self, doc_ids: list[str]) -> tuple[list[str], bool]:
        """``doc_ids`` and the documents queued behind them, up to ``group_docs``; True when ``stop`` was asked."""
        while doc_ids and len(doc_ids) < self.config.group_docs:
            try:
                doc_id = self._queue.get_nowait()
            except queue.Empty:
                break
            if doc_id is None:
                return doc_ids, True
            doc_ids.append(doc_id)
        return doc_ids, False

    def _run_claimed(self, doc_ids: list[str]) -> None:
        """Claim the jobs of ``doc_ids`` (or, none given, any job up for grabs, one by one) and ingest them, small
        files together; one held elsewhere is left."""
        if not doc_ids:
            while (claim := self._claim(None)) is not None:
                self._ingest_group([claim])
            return
        group: list[Claim] = []
        size = 0
        for doc_id in doc_ids:
            claim = self._claim(doc_id)
            if claim is None:
                continue
            try:
                n = self.store.get(doc_id).size
            except DocumentNotFound:
                n = 0
            if group and size + n > self.config.group_bytes:
                self._ingest_group(group)
                group, size = [], 0
            group.append(claim)
            size += n
        if group:
            self._ingest_group(group)

    def _claim(self, doc_id: str | None) -> Claim | None:
        claim = self.store.claim_ingest(self.name, self.config.lease_s, self.config.max_attempts, doc_id)
        if claim is not None and claim.attempt > 1:
            logger.warning("taking over the ingestion of %s (attempt %d)", claim.doc_id, claim.attempt)
        return claim

    def _ingest_group(self, claims: list[Claim]) -> None:
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(claims, stop), name="ragspec-lease", daemon=True)
        beat.start()
        try:
            self._ingest(claims)
        finally:
            stop.set()
            beat.join()
            for claim in claims:
                self.store.finish_ingest(claim)

    def _heartbeat(self, claims: list[Claim], stop: threading.Event) -> None:
        held = list(claims)
        while held and not stop.wait(self.config.lease_s / 3):
            for claim in list(held):
                try:
                    if not self.store.renew_ingest(claim, self.config.lease_s):
                        logger.warning("lost the lease on %s's ingestion (another worker took it over)", claim.doc_id)
                        held.remove(claim)
                except Exception:
                    logger.warning("could not renew the lease on %s's ingestion", claim.doc_id, exc_info=True)

    def _ingest(self, claims: list[Claim]) -> None:
        by_doc = {c.doc_id: c for c in claims}
        results = self.store.ingest_many(
            list(by_doc), self.tokenizer, self.embedder, self.config.chunk_tokens, self.config.chunk_overlap,
            holds=lambda doc_id: self.store.renew_ingest(by_doc[doc_id], self.config.lease_s),
        )
        ready = []
        for doc_id, result in zip(by_doc, results, strict=True):
            if isinstance(result, IngestAbandoned):
                logger.warning("dropped the ingestion of %s: another worker took it over", doc_id)
            elif isinstance(result, DocumentNotFound):
                logger.info("document %s was deleted before it was indexed", doc_id)
            elif isinstance(result, BaseException):  # the store has marked the document failed with the reason
                logger.warning("indexing %s failed", doc_id, exc_info=result)
            else:
                ready.append(doc_id)
        if ready and self.on_ready is not None:  # once for the group: its collections are changed once
            try:
                self.on_ready(ready)
            except Exception:
                logger.warning("after-indexing hook failed for %s", ", ".join(ready), exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
