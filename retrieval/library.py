"""Every collection's search index (``retrieval.collection_index``), kept in step with the catalogue.

The catalogue is the truth: which documents a collection holds, which are ready, their attributes. A collection's
index follows its ``version`` (bumped by every change of its members): ``synced`` compares the version the index last
saw with the catalogue's and, when they differ, removes the documents that left (or were re-indexed) and adds the
ready ones it lacks, reading their chunks and window vectors from the documents' own files (no embedding). A
question never sees a document the catalogue no longer holds in the collection: the documents it may see are
either the index's, synced to the current version, or the catalogue's answer to its filter.

Each process keeps its own indexes under ``root`` (in cluster mode every replica rebuilds them from the catalogue and
the shared documents, see docs/architecture.md): the files are a cache that a crash can leave at any point; opening
one reconciles it with the catalogue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.collection_index import CollectionIndex, CollectionIndexConfig, DocumentEntry, chunk_vectors
from retrieval.doc_files import remove
from retrieval.embedding import Embedder
from retrieval.errors import CollectionNotFound, DocumentNotFound, DocumentNotReady, RetrievalError
from retrieval.lexical import terms
from retrieval.store import DocumentStore

logger = logging.getLogger(__name__)

EMBEDDER_FILE = "embedder.txt"


@dataclass
class _Open:
    index: CollectionIndex
    lock: threading.RLock
    saved_at: float


class CollectionIndexes:
    """Collection indexes under ``root`` for ``store``'s collections, with ``embedder``'s vectors. ``save_after_s``:
    a changed index writes its vectors' snapshot when it is synced this long after the last one (and at ``close``).
    ``cache_size``: indexes held in memory at once (the least recently asked is saved and closed)."""

    def __init__(self, root: Path, store: DocumentStore, embedder: Embedder,
                 config: CollectionIndexConfig | None = None, *, save_after_s: float = 30.0,
                 cache_size: int = 64) -> None:
        self.root = Path(root)
        self.store = store
        self.embedder = embedder
        self.config = config or CollectionIndexConfig()
        self.save_after_s = save_after_s
        self.cache_size = cache_size
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._lock = threading.Lock()

    @contextmanager
    def synced(self, collection_id: str) -> Iterator[CollectionIndex]:
        """The collection's index, synced with the catalogue, held (its lock) for the ``with`` block."""
        version = self.store.collection_versions([collection_id]).get(collection_id)
        if version is None:
            raise CollectionNotFound(collection_id)
        held = self._get(collection_id)
        with held.lock:
            index = held.index
            if index.synced_version != version:
                self._sync(collection_id, index, version)
            yield index

    def sync(self, collection_id: str) -> None:
        """Bring the index in step now (after an ingest or a change of members: questions then find it ready), and
        do its upkeep, which a question never waits for: compaction once removed documents' vectors pass
        ``compact_share``, and a snapshot of changed vectors at most every ``save_after_s``."""
        try:
            with self.synced(collection_id) as index:
                held = self._get(collection_id)
                if index.needs_compaction():
                    index.compact()
                if index.dirty and time.monotonic() - held.saved_at >= self.save_after_s:
                    index.save()
                    held.saved_at = time.monotonic()
        except CollectionNotFound:
            self.forget(collection_id)

    def forget(self, collection_id: str) -> None:
        """Drop a deleted collection's index, in memory and on disk."""
        with self._lock:
            held = self._open.pop(collection_id, None)
        if held is not None:
            with held.lock:
                held.index.close()
        remove(self._dir(collection_id))

    def close(self) -> None:
        with self._lock:
            held = list(self._open.values())
            self._open.clear()
        for h in held:
            with h.lock:
                h.index.save()
                h.index.close()

    def prune(self, existing: set[str]) -> list[str]:
        """Delete the indexes of collections not in ``existing`` (deleted while this process was down); their ids."""
        gone = [p.name for p in self.root.iterdir() if p.is_dir() and p.name not in existing] \
            if self.root.is_dir() else []
        for collection_id in gone:
            self.forget(collection_id)
        return gone

    # --- internals ------------------------------------------------------------------------------

    def _dir(self, collection_id: str) -> Path:
        if not collection_id.isalnum():
            raise CollectionNotFound(collection_id)
        return self.root / collection_id

    def _get(self, collection_id: str) -> _Open:
        with self._lock:
            held = self._open.get(collection_id)
            if held is not None:
                self._open.move_to_end(collection_id)
                return held
        directory = self._dir(collection_id)
        marker = directory / EMBEDDER_FILE
        if directory.exists() and (not marker.exists() or marker.read_text(encoding="utf-8") != self.embedder.name):
            logger.info("collection index %s: built with another embedder; rebuilt", collection_id)
            remove(directory)
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(self.embedder.name, encoding="utf-8")
        opened = CollectionIndex.open(directory, self.embedder.dim, self.config, reload=self._entry)
        evicted: list[_Open] = []
        with self._lock:
            held = self._open.get(collection_id)
            kept = held is None
            if held is None:
                held = _Open(opened, threading.RLock(), time.monotonic())
                self._open[collection_id] = held
            while len(self._open) > self.cache_size:
                evicted.append(self._open.popitem(last=False)[1])
        if not kept:  # another thread opened it meanwhile
            opened.close()
        for old in evicted:
            with old.lock:
                old.index.save()
                old.index.close()
        return held

    def _sync(self, collection_id: str, index: CollectionIndex, version: int) -> None:
        began = time.perf_counter()
        stamps = self.store.member_stamps([collection_id])
        have = index.documents()
        removed = [d for d, stamp in have.items() if stamps.get(d) != stamp]
        for doc_id in removed:
            index.remove(doc_id)
        complete = True
        added = 0
        for doc_id, stamp in stamps.items():
            if have.get(doc_id) == stamp:
                continue
            entry = self._entry(doc_id, stamp)
            if entry is None:  # changed or deleted while we read it: the next sync sees its new state
                complete = False
                continue
            index.add(doc_id, stamp, entry)
            added += 1
        if complete:
            index.set_synced_version(version)
        if added or removed:
            logger.info("collection %s synced to version %d: %d documents added, %d removed in %.2f s",
                        collection_id, version, added, len(removed), time.perf_counter() - began)

    def _entry(self, doc_id: str, stamp: float) -> DocumentEntry | None:
        """A ready document's chunk vectors and terms, read from its files; None when it is no longer ready with
        this stamp (or its files cannot be read: logged, the document left out of the collection's index)."""
        try:
            record = self.store.get(doc_id)
            if record.status != "ready" or record.updated_at != stamp:
                return None
            chunks = self.store.load_chunks(doc_id)
            passages = self.store.load_passages(doc_id)
            windows = self.store.load_index(doc_id, self.embedder).vectors()
        except (DocumentNotFound, DocumentNotReady):
            return None
        except RetrievalError as exc:
            logger.warning("collection index: document %s left out: %s", doc_id, exc)
            return None
        owners = np.arange(len(chunks)) if passages is None else passages[:, 0].astype(np.int64)
        if len(owners) != len(windows):
            logger.warning("collection index: document %s left out: %d vectors for %d windows", doc_id,
                           len(windows), len(owners))
            return None
        return DocumentEntry(chunk_vectors(windows, owners, len(chunks)), [terms(c.text) for c in chunks])
