"""Document store: files under a root directory, metadata in a catalogue (SQLite in the root, or PostgreSQL).

Layout::

    root/store.sqlite3                 metadata, one row per document (``retrieval.catalogue``; unless a database
                                       URL puts the catalogue elsewhere)
    root/tmp/                          work dirs; whatever is left here after a crash is deleted by recover()
    root/docs/<id>/source/             original file + extracted text (+ pages.json for PDFs)
    root/docs/<id>/derived/            what retrieval reads (``retrieval.doc_files`` writes and reads both)

Every write is built in a fresh dir under ``tmp/`` and moved into place with one ``os.rename``; the
catalogue's row is written after the files. So a crash leaves either nothing, or a complete ``source/`` (a
queued / failed document), or a complete ``derived/`` (a ready document). ``recover()`` at start-up
deletes ``tmp/`` leftovers and document dirs without a row, and marks documents that were queued or
indexing as failed ("interrupted by restart"); a store shared by several processes (``recover(shared=True)``)
leaves that to the ingestion jobs' leases (written by ``create``, taken by ``claim_ingest``), which hand a dead worker's
document to another.

Thread-safe: one lock guards SQLite and the renames; the slow part of ingestion (tokenize, embed,
index) runs outside it, so reads go on while a background thread ingests.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval import doc_files
from retrieval.catalogue import (
    Catalogue,
    Claim,
    CollectionRecord,
    DocumentRecord,
    DocumentStatus,
    FileBatchRecord,
    MemberCounts,
)
from retrieval.chunking import Chunk, Tokenizer, chunk_text, passage_spans, tokenize
from retrieval.doc_files import PASSAGES_FILE, fsync_tree, remove
from retrieval.embedding import DEFAULT_BATCH_SIZE, Embedder
from retrieval.errors import (
    BatchNotFound,
    CollectionNotFound,
    DocumentNotFound,
    DocumentNotReady,
    EmptyDocument,
    IngestAbandoned,
    ResponseNotFound,
    RetrievalError,
)
from retrieval.filters import Attributes, Filter, check_attributes
from retrieval.index import IndexConfig, VectorIndex
from retrieval.lexical import LEXICAL_FILE, LexicalIndex
from retrieval.parsing import parse_document

__all__ = [  # the store's public names, some defined beside it (catalogue, doc_files) and re-exported here
    "DEFAULT_TENANT", "INTERRUPTED", "PASSAGES_FILE", "Claim", "CollectionRecord", "DocumentRecord", "DocumentStatus",
    "DocumentStore", "MemberCounts", "RecoveryReport",
]

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
INTERRUPTED = "interrupted by restart"
SHARED_TEMP_AGE_S = 24 * 3600.0  # a shared store's temp dir this old is a dead worker's leftover
MAX_TITLE_CHARS = 512  # a title longer than this (from a file name or PDF metadata) is cut
# An indexing document's message names its stage: chunking, embedding (per batch, embedding_stage), indexing.
STAGE_CHUNKING = "chunking the text"
STAGE_INDEXING = "building the index"

@dataclass(frozen=True)
class RecoveryReport:
    removed_temp: int
    removed_orphans: int
    failed: list[str]


class DocumentStore:
    """Documents of all tenants under ``root``, their catalogue in ``root``'s SQLite file or in ``database`` (a
    PostgreSQL URL). ``tenant=None`` in a read means "any tenant".
    ``max_pdf_pages``: a PDF upload with more pages is refused (TooManyPages) before its pages are parsed."""

    def __init__(
        self, root: Path, *, index_config: IndexConfig | None = None, max_pdf_pages: int | None = None,
        database: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.index_config = index_config or IndexConfig()
        self.max_pdf_pages = max_pdf_pages
        self._docs = self.root / "docs"
        self._tmp = self.root / "tmp"
        self._docs.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = Catalogue(database or self.root / "store.sqlite3")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- start-up -------------------------------------------------------------------------------

    def recover(self, *, shared: bool = False) -> RecoveryReport:
        """Clean up after a crash: delete temp leftovers and row-less document dirs; documents that
        were queued or indexing become failed with message "interrupted by restart".

        ``shared``: other processes use this store too (replicas on one catalogue and one documents dir): their
        work in progress is left alone (an ingest cut by a crash is taken over by its job's lease, see
        ``claim_ingest``); only temp dirs untouched for ``SHARED_TEMP_AGE_S`` are deleted."""
        if shared:
            return self._recover_shared()
        with self._lock:
            removed_temp = 0
            for entry in self._tmp.iterdir():
                remove(entry)
                removed_temp += 1
            ids = set(self._db.ids())
            removed_orphans = 0
            for entry in self._docs.iterdir():
                if entry.name not in ids:
                    remove(entry)
                    removed_orphans += 1
            failed = self._db.ids(("queued", "indexing"))
            for doc_id in failed:
                self._update(doc_id, status="failed", message=INTERRUPTED, progress=0.0)
            for doc_id in self._db.ids(("ready",)):
                if not (self._derived_dir(doc_id) / "index").is_dir():
                    self._update(doc_id, status="failed", message="index files are missing; re-index it")
                    failed.append(doc_id)
        if removed_temp or removed_orphans or failed:
            logger.warning("recovered store %s: %d temp dirs and %d orphan dirs removed, %d documents failed",
                           self.root, removed_temp, removed_orphans, len(failed))
        return RecoveryReport(removed_temp=removed_temp, removed_orphans=removed_orphans, failed=failed)

    def _recover_shared(self) -> RecoveryReport:
        with self._lock:
            queued = self._db.add_missing_jobs()
        if queued:
            logger.info("ingestion jobs added for %d documents waiting without one", len(queued))
        cutoff = time.time() - SHARED_TEMP_AGE_S
        removed = 0
        for entry in self._tmp.iterdir():
            try:
                if entry.stat().st_mtime < cutoff:
                    remove(entry)
                    removed += 1
            except FileNotFoundError:  # another replica's work, finished meanwhile
                continue
        return RecoveryReport(removed_temp=removed, removed_orphans=0, failed=[])

    # --- ingestion jobs -------------------------------------------------------------------------

    def claim_ingest(self, owner: str, lease_s: float, max_attempts: int, doc_id: str | None = None) -> Claim | None:
        """Claim the oldest ingestion job nobody holds, or whose holder's lease ran out (``doc_id``'s only, when
        given); None when there is none. A document whose job was claimed ``max_attempts`` times already (each
        holder died) becomes failed rather than taking down the next worker too."""
        gave_up = f"ingestion stopped {max_attempts} times without finishing (its workers died)"
        while True:
            with self._lock:
                got = self._db.claim(owner, lease_s, max_attempts, doc_id, gave_up=gave_up)
            if not isinstance(got, str):
                return got
            logger.warning("document %s failed: its ingestion was cut %d times", got, max_attempts)

    def renew_ingest(self, claim: Claim, lease_s: float) -> bool:
        with self._lock:
            return self._db.renew(claim, lease_s)

    def finish_ingest(self, claim: Claim) -> None:
        with self._lock:
            self._db.finish(claim)

    # --- documents ------------------------------------------------------------------------------

    def create(
        self,
        tenant: str | None,
        title: str | None,
        filename: str | None,
        content_type: str | None,
        data: bytes,
        *,
        attributes: Attributes | None = None,
        collection_ids: Sequence[str] = (),
        purpose: str | None = None,
    ) -> DocumentRecord:
        """Parse and store an upload (status ``queued``), with its ``attributes``, in ``collection_ids`` (the
        tenant's); ``purpose``: OpenAI's, for a file uploaded through ``/v1/files``. Bad input raises before
        anything is stored."""
        attributes = check_attributes(attributes or {})
        for cid in collection_ids:
            self.get_collection(cid, tenant or DEFAULT_TENANT)
        parsed = parse_document(data, filename, content_type, max_pages=self.max_pdf_pages)
        doc_id = uuid.uuid4().hex
        work = self._work_dir(doc_id)
        try:
            doc_files.write_source(work / "source", data, parsed)
            fsync_tree(work)
            with self._lock:
                os.rename(work, self._doc_dir(doc_id))
                now = time.time()
                record = DocumentRecord(
                    id=doc_id, tenant=tenant or DEFAULT_TENANT,
                    title=(title or parsed.title or filename or "untitled").strip()[:MAX_TITLE_CHARS] or "untitled",
                    filename=filename, content_type=content_type, kind=parsed.kind, size=len(data),
                    status="queued", progress=0.0, message=None, n_chunks=0, n_tokens=0, embedder=None,
                    created_at=now, updated_at=now, purpose=purpose,
                )
                try:
                    self._db.insert(record, job=True, attributes=attributes, collection_ids=collection_ids)
                except BaseException:
                    remove(self._doc_dir(doc_id))
                    raise
        finally:
            remove(work)
        logger.info("stored document %s (%s, %d bytes)", doc_id, parsed.kind, len(data))
        return record

    def ingest(
        self,
        doc_id: str,
        tokenizer: Tokenizer,
        embedder: Embedder,
        chunk_tokens: int = 512,
        overlap: int = 0,
        progress: Callable[[float], None] | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        holds: Callable[[], bool] | None = None,
    ) -> DocumentRecord:
        """Tokenize (once), chunk, embed and index a stored document; status indexing -> ready.

        On any error the document becomes ``failed`` with the error as message, no partial files stay
        behind, and the error is raised again. Re-ingesting a ready document replaces its index.
        ``progress`` gets the fraction done after the row is written at each stage (0.0 as chunking starts)
        and embedding batch, then 1.0 once ready, so a caller reading the row sees the stage of each call.
        ``holds``: asked before the result is put in place; False (another worker took the job over) drops the
        work and raises ``IngestAbandoned``, leaving the row to that worker.
        """
        (result,) = self.ingest_many([doc_id], tokenizer, embedder, chunk_tokens, overlap, batch_size=batch_size,
                                     holds=None if holds is None else lambda _: holds(), progress={doc_id: progress})
        if isinstance(result, BaseException):
            raise result
        if progress is not None:
            progress(1.0)
        return result

    def ingest_many(
        self,
        doc_ids: Sequence[str],
        tokenizer: Tokenizer,
        embedder: Embedder,
        chunk_tokens: int = 512,
        overlap: int = 0,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        holds: Callable[[str], bool] | None = None,
        progress: Mapping[str, Callable[[float], None] | None] | None = None,
    ) -> list[DocumentRecord | BaseException]:
        """``ingest`` of several documents whose passages are embedded together (full batches when each document
        is small, instead of one short batch per file), each document's outcome in the order of
        ``doc_ids``: its ready record, or the error that made it ``failed`` (or ``IngestAbandoned`` /
        ``DocumentNotFound``, left as they are). One document's bad text fails that document only; an embedder
        error fails every document not yet ready. ``holds(doc_id)`` and ``progress[doc_id]`` as in ``ingest``."""
        results: list[DocumentRecord | BaseException | None] = [None] * len(doc_ids)
        prepared: list[tuple[int, _Prepared]] = []
        try:
            for i, doc_id in enumerate(doc_ids):
                try:
                    callback = None if progress is None else progress.get(doc_id)
                    prepared.append((i, self._prepare(doc_id, tokenizer, chunk_tokens, overlap, callback)))
                except Exception as exc:
                    results[i] = self._failed(doc_id, None, exc)
            texts = [p.text[a:b] for _, p in prepared for _, a, b in p.passages]
            for _, p in prepared:
                p.reporter(0.05, embedding_stage(0, len(texts)))

            def embedded(done: int, total: int) -> None:  # one row update per batch (a group's: at its end)
                if len(prepared) == 1 or done == total:
                    for _, p in prepared:
                        p.reporter(0.05 + 0.9 * done / max(total, 1), embedding_stage(done, total))

            try:
                vectors = embedder.encode(texts, batch_size=batch_size, progress=embedded) if texts else \
                    np.zeros((0, embedder.dim), dtype=np.float32)  # [windows, dim]
            except Exception as exc:
                for i, p in prepared:
                    results[i] = self._failed(p.doc_id, p.work, exc)
                prepared = []
            lo = 0
            for i, p in prepared:
                hi = lo + len(p.passages)
                try:
                    results[i] = self._finish(p, vectors[lo:hi], embedder.name, holds)
                except Exception as exc:
                    results[i] = exc if isinstance(exc, IngestAbandoned | DocumentNotFound) else \
                        self._failed(p.doc_id, p.work, exc)
                lo = hi
        finally:
            for _, p in prepared:
                remove(p.work)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _prepare(self, doc_id: str, tokenizer: Tokenizer, chunk_tokens: int, overlap: int,
                 progress: Callable[[float], None] | None) -> _Prepared:
        """Read, tokenize and chunk a stored document; its lexical index and the passages to embed."""
        self._update(doc_id, status="indexing", progress=0.0, message=STAGE_CHUNKING)
        work = self._work_dir(doc_id)
        try:
            if progress is not None:
                progress(0.0)
            text = self.load_text(doc_id)
            pages = doc_files.read_pages(self._doc_dir(doc_id) / "source")
            tokens = tokenize(text, tokenizer)
            chunks = chunk_text(text, tokenizer, chunk_tokens, overlap, pages, tokens=tokens)
            if not chunks:
                raise EmptyDocument("the document has no tokens to index")
            passages = np.array([(c.id, a, b) for c in chunks for a, b in passage_spans(c)], dtype=np.int64)
            lexical = LexicalIndex.build([c.text for c in chunks])
        except BaseException:
            remove(work)
            raise
        return _Prepared(doc_id, work, text, tokens, chunks, passages, lexical,
                         _ProgressReporter(self, doc_id, progress))

    def _finish(self, p: _Prepared, vectors: np.ndarray, embedder_name: str,
                holds: Callable[[str], bool] | None) -> DocumentRecord:
        """Index the embedded passages and put the document's files in place: ready."""
        p.reporter(0.95, STAGE_INDEXING)
        index = VectorIndex.build(vectors, embedder_name=embedder_name, config=self.index_config)
        doc_files.write_derived(p.work / "derived", p.chunks, p.tokens, p.passages, p.lexical, index)
        fsync_tree(p.work)
        if holds is not None and not holds(p.doc_id):
            raise IngestAbandoned(p.doc_id)
        with self._lock:
            self.get(p.doc_id)  # deleted meanwhile -> DocumentNotFound, work dir is dropped
            self._swap_in(p.work / "derived", self._derived_dir(p.doc_id))
            record = self._update(p.doc_id, status="ready", progress=1.0, message=None, n_chunks=len(p.chunks),
                                  n_tokens=len(p.tokens), embedder=embedder_name)
        logger.info("indexed document %s: %d chunks, %d tokens", p.doc_id, len(p.chunks), len(p.tokens))
        return record

    def _failed(self, doc_id: str, work: Path | None, exc: BaseException) -> BaseException:
        """Mark the document failed with ``exc`` as its message (unless it was deleted meanwhile); ``exc``."""
        if work is not None:
            remove(work)
        if isinstance(exc, DocumentNotFound):
            return exc
        with self._lock:
            if self._row(doc_id) is not None:
                self._update(doc_id, status="failed", progress=0.0, message=_describe(exc))
        logger.warning("ingest of %s failed: %s", doc_id, _describe(exc))
        return exc

    def get(self, doc_id: str, tenant: str | None = None) -> DocumentRecord:
        """The record; unknown id, or another tenant's document, raises DocumentNotFound."""
        record = self._row(doc_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            raise DocumentNotFound(doc_id)
        return record

    def list(self, tenant: str | None = None) -> list[DocumentRecord]:
        """Documents of ``tenant`` (all when None), oldest first."""
        with self._lock:
            return self._db.list(tenant)

    def delete(self, doc_id: str, tenant: str | None = None) -> None:
        """Remove the document's row and files (an ingest running for it then discards its work)."""
        with self._lock:
            self.get(doc_id, tenant)
            self._db.delete(doc_id)
            doc_dir = self._doc_dir(doc_id)
            trash = self._work_dir(doc_id, create=False)
            if doc_dir.exists():
                os.rename(doc_dir, trash)
        remove(trash)
        logger.info("deleted document %s", doc_id)

    # --- attributes and collections -----------------------------------------------------------

    def set_attributes(self, doc_id: str, attributes: Any, tenant: str | None = None) -> Attributes:
        """Replace a document's attributes (validated: ``InvalidAttributes``); the attributes as stored."""
        checked = check_attributes(attributes)
        with self._lock:
            self.get(doc_id, tenant)
            self._db.set_attributes(doc_id, checked)
            return self._db.attributes([doc_id])[doc_id]

    def attributes(self, doc_ids: Iterable[str]) -> dict[str, Attributes]:
        with self._lock:
            return self._db.attributes(doc_ids)

    def collections_of(self, doc_ids: Iterable[str]) -> dict[str, builtins.list[str]]:
        with self._lock:
            return self._db.collections_of(doc_ids)

    def create_collection(self, tenant: str | None, name: str, description: str | None = None,
                          metadata: dict[str, str] | None = None, *,
                          expires_after_days: int | None = None) -> CollectionRecord:
        now = time.time()
        record = CollectionRecord(id="col" + uuid.uuid4().hex, tenant=tenant or DEFAULT_TENANT, name=name,
                                  description=description, metadata=dict(metadata or {}), version=0,
                                  created_at=now, updated_at=now, expires_after_days=expires_after_days,
                                  last_active_at=now if expires_after_days is not None else None)
        with self._lock:
            self._db.insert_collection(record)
        logger.info("created collection %s", record.id)
        return record

    def get_collection(self, collection_id: str, tenant: str | None = None) -> CollectionRecord:
        """The collection; unknown, or another tenant's, raises CollectionNotFound."""
        with self._lock:
            record = self._db.collection(collection_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            raise CollectionNotFound(collection_id)
        return record

    def list_collections(self, tenant: str | None, limit: int | None = None,
                         after: str | None = None, *, newest_first: bool = False) -> builtins.list[CollectionRecord]:
        with self._lock:
            return self._db.collections(tenant, limit, after, newest_first=newest_first)

    def page(self, tenant: str, limit: int, after: str | None = None, *, newest_first: bool = False,
             purpose: str | None = None) -> builtins.list[DocumentRecord]:
        """A page of the tenant's documents (``Catalogue.page``)."""
        with self._lock:
            return self._db.page(tenant, limit, after, newest_first=newest_first, purpose=purpose)

    def touch_collections(self, collection_ids: Iterable[str], at: float | None = None) -> None:
        """Note that the collections were asked or searched now (a vector store's ``last_active_at``)."""
        with self._lock:
            self._db.touch_collections(collection_ids, time.time() if at is None else at)

    def added_at(self, collection_id: str, doc_ids: Iterable[str]) -> dict[str, float]:
        with self._lock:
            return self._db.added_at(collection_id, doc_ids)

    def create_batch(self, collection_id: str, doc_ids: Sequence[str], tenant: str | None = None) -> FileBatchRecord:
        """Add the tenant's documents to the collection as one batch (an unknown one: DocumentNotFound, nothing
        added)."""
        batch_id = "vsfb_" + uuid.uuid4().hex
        with self._lock:
            self.get_collection(collection_id, tenant)
            for doc_id in doc_ids:
                self.get(doc_id, tenant)
            there = self._db.added_at(collection_id, doc_ids)  # in the store before the batch: a cancel keeps them
            self._db.add_members(collection_id, doc_ids)
            self._db.insert_batch(batch_id, collection_id, doc_ids, time.time(),
                                  added={d for d in doc_ids if d not in there})
        return self.get_batch(batch_id, collection_id, tenant)

    def save_response(self, response_id: str, tenant: str, previous_id: str | None, body: str) -> None:
        """Keep a Responses API answer (its object as JSON) for ``GET /v1/responses/{id}`` and follow-ups."""
        with self._lock:
            self._db.insert_response(response_id, tenant, previous_id, time.time(), body)

    def get_response(self, response_id: str, tenant: str) -> tuple[str | None, str]:
        """(the response it follows, its JSON) of the tenant's stored response; else ResponseNotFound."""
        with self._lock:
            found = self._db.response(response_id)
        if found is None or found[0] != tenant:
            raise ResponseNotFound(response_id)
        return found[1], found[2]

    def delete_response(self, response_id: str, tenant: str) -> None:
        with self._lock:
            self.get_response(response_id, tenant)
            self._db.delete_response(response_id)

    def cancelled_documents(self, collection_id: str) -> builtins.list[str]:
        with self._lock:
            return self._db.cancelled(collection_id)

    def get_batch(self, batch_id: str, collection_id: str, tenant: str | None = None) -> FileBatchRecord:
        """The batch of that collection (the tenant's); otherwise BatchNotFound."""
        with self._lock:
            self.get_collection(collection_id, tenant)
            batch = self._db.batch(batch_id)
        if batch is None or batch.collection_id != collection_id:
            raise BatchNotFound(batch_id)
        return batch

    def cancel_batch(self, batch_id: str, collection_id: str, tenant: str | None = None) -> FileBatchRecord:
        """Take the batch's documents that are not indexed yet out of its collection (they stay in the store; those
        that were in it before the batch stay in it too) and mark the batch cancelled; one with nothing left to index is
        left as it is."""
        with self._lock:
            batch = self.get_batch(batch_id, collection_id, tenant)
            if batch.cancelled_at is None:
                members = set(self._db.added_at(collection_id, batch.added_ids))
                rows = [self._db.row(d) for d in batch.added_ids if d in members]
                pending = [r.id for r in rows if r is not None and r.status in ("queued", "indexing")]
                if pending:  # a batch already indexed is left as it is
                    self._db.cancel_batch(batch_id, pending, time.time())
        return self.get_batch(batch_id, collection_id, tenant)

    def update_collection(self, collection_id: str, tenant: str | None = None, **fields: Any) -> CollectionRecord:
        with self._lock:
            self.get_collection(collection_id, tenant)
            if fields:
                self._db.update_collection(collection_id, **fields)
            return self.get_collection(collection_id)

    def delete_collection(self, collection_id: str, tenant: str | None = None, *,
                          delete_documents: bool = False) -> builtins.list[str]:
        """Delete the collection (its documents stay unless ``delete_documents``); the ids of the documents deleted
        with it (those that are also in another collection are deleted too: asked for by the caller)."""
        with self._lock:
            self.get_collection(collection_id, tenant)
            members = self._db.delete_collection(collection_id)
        deleted = []
        if delete_documents:
            for doc_id in members:
                try:
                    self.delete(doc_id, tenant)
                except DocumentNotFound:  # deleted meanwhile
                    continue
                deleted.append(doc_id)
        logger.info("deleted collection %s (%d documents deleted with it)", collection_id, len(deleted))
        return deleted

    def add_to_collection(self, collection_id: str, doc_ids: Sequence[str], tenant: str | None = None) -> int:
        """Add existing documents of the tenant (an unknown one: DocumentNotFound, nothing added); how many were
        not in it yet."""
        with self._lock:
            self.get_collection(collection_id, tenant)
            for doc_id in doc_ids:
                self.get(doc_id, tenant)
            return self._db.add_members(collection_id, doc_ids)

    def remove_from_collection(self, collection_id: str, doc_id: str, tenant: str | None = None) -> None:
        """Take a document out (it stays in the store); one not in the collection: DocumentNotFound."""
        with self._lock:
            self.get_collection(collection_id, tenant)
            if not self._db.remove_member(collection_id, doc_id):
                raise DocumentNotFound(doc_id)

    def members(self, collection_ids: Sequence[str], *, where: Filter | None = None,
                statuses: Iterable[DocumentStatus] | None = None, limit: int | None = None,
                after: str | None = None, newest_first: bool = False) -> builtins.list[DocumentRecord]:
        """Documents of the collections (checked by the caller) matching ``where``, oldest (or newest) first."""
        with self._lock:
            return self._db.members(collection_ids, where=where, statuses=statuses, limit=limit, after=after,
                                    newest_first=newest_first)

    def member_counts(self, collection_ids: Sequence[str], *, where: Filter | None = None) -> MemberCounts:
        with self._lock:
            return self._db.member_counts(collection_ids, where=where)

    def member_stamps(self, collection_ids: Sequence[str], *, where: Filter | None = None) -> dict[str, float]:
        with self._lock:
            return self._db.member_stamps(collection_ids, where=where)

    def collection_versions(self, collection_ids: Iterable[str]) -> dict[str, int]:
        with self._lock:
            return self._db.versions(collection_ids)

    def collection_dir(self, collection_id: str) -> Path:
        """Where a collection's search index lives (``retrieval.collection_index``)."""
        if not collection_id.isalnum():
            raise CollectionNotFound(collection_id)
        return self.root / "collections" / collection_id

    def stale(self, embedder: Embedder) -> builtins.list[DocumentRecord]:
        """Ready documents indexed with another embedder than ``embedder``, or before passages and the
        lexical index existed: they need re-indexing."""
        return [r for r in self.list() if r.status == "ready" and (r.embedder != embedder.name or not all(
            (self._derived_dir(r.id) / name).exists() for name in (PASSAGES_FILE, LEXICAL_FILE)))]

    # --- loading --------------------------------------------------------------------------------

    def load_original(self, doc_id: str) -> bytes:
        """The upload's bytes, as sent."""
        source = self._doc_dir(doc_id) / "source"
        found = sorted(source.glob("original.*"))
        if not found:
            raise DocumentNotFound(doc_id)
        return found[0].read_bytes()

    def load_text(self, doc_id: str) -> str:
        """The extracted text (any status)."""
        self.get(doc_id)
        try:
            return (self._doc_dir(doc_id) / "source" / "text.txt").read_text(encoding="utf-8")
        except FileNotFoundError:  # deleted meanwhile
            raise DocumentNotFound(doc_id) from None

    # Readers of the derived files: an unreadable one raises IndexDamaged (409, names the re-index command).

    def load_chunks(self, doc_id: str) -> builtins.list[Chunk]:
        with self._read_derived(doc_id) as derived:
            return doc_files.read_chunks(derived, doc_id)

    def load_token_ids(self, doc_id: str) -> np.ndarray:
        """The whole text's target token ids [n] int32 (no special tokens)."""
        with self._read_derived(doc_id) as derived:
            return doc_files.read_token_ids(derived, doc_id)

    def load_index(self, doc_id: str, embedder: Embedder) -> VectorIndex:
        """The document's index; built with another embedder -> EmbedderMismatch."""
        with self._read_derived(doc_id) as derived:
            return doc_files.read_index(derived, doc_id, embedder, self.index_config)

    def load_passages(self, doc_id: str) -> np.ndarray | None:
        """The indexed windows [n, 3] (chunk id, start, end), by vector id; None for a document indexed
        before windows (its vectors are its chunks)."""
        with self._read_derived(doc_id) as derived:
            return doc_files.read_passages(derived, doc_id)

    def load_lexical(self, doc_id: str) -> LexicalIndex | None:
        """The document's BM25 postings; None for a document indexed before them."""
        with self._read_derived(doc_id) as derived:
            return doc_files.read_lexical(derived, doc_id)

    @contextmanager
    def _read_derived(self, doc_id: str) -> Iterator[Path]:
        with self._lock:  # no swap or delete while reading
            record = self.get(doc_id)
            derived = self._derived_dir(doc_id)
            if record.status != "ready" or not derived.is_dir():
                raise DocumentNotReady(doc_id, record.status, record.message)
            yield derived

    # --- internals ------------------------------------------------------------------------------

    def _doc_dir(self, doc_id: str) -> Path:
        if not doc_id.isalnum():  # ids are uuid hex; refuse path tricks
            raise DocumentNotFound(doc_id)
        return self._docs / doc_id

    def _derived_dir(self, doc_id: str) -> Path:
        return self._doc_dir(doc_id) / "derived"

    def _work_dir(self, doc_id: str, *, create: bool = True) -> Path:
        path = self._tmp / f"{doc_id}-{uuid.uuid4().hex[:8]}"
        if create:
            path.mkdir()
        return path

    def _swap_in(self, new: Path, target: Path) -> None:
        """Replace ``target`` by ``new`` (two renames; the old one is put back if the second fails)."""
        old = None
        if target.exists():
            old = self._work_dir(target.parent.name, create=False)
            os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            if old is not None:
                os.rename(old, target)
            raise
        if old is not None:
            remove(old)

    def _row(self, doc_id: str) -> DocumentRecord | None:
        with self._lock:
            return self._db.row(doc_id)

    def _update(self, doc_id: str, **fields: Any) -> DocumentRecord:
        with self._lock:
            self._db.update(doc_id, **fields)
            return self.get(doc_id)


def embedding_stage(done: int, total: int) -> str:
    """The message of an indexing document while its passages are embedded."""
    return f"embedding passages: {done} of {total}"


class _ProgressReporter:
    """Writes progress, with the stage as message, to the document's row (one write per call: a call is a stage
    or an embedding batch, and a poller sees each), then tells the caller's callback."""

    def __init__(self, store: DocumentStore, doc_id: str, callback: Callable[[float], None] | None) -> None:
        self.store = store
        self.doc_id = doc_id
        self.callback = callback

    def __call__(self, fraction: float, stage: str) -> None:
        fraction = round(fraction, 4)  # 0.05 + 0.9 * 1.0 is not 0.95 in floats: rounded, the steps never go back
        self.store._update(self.doc_id, progress=fraction, message=stage)
        if self.callback is not None:
            self.callback(fraction)


@dataclass
class _Prepared:
    """A document read and chunked, its passages ([n, 3]: chunk id, start, end) waiting for their vectors."""

    doc_id: str
    work: Path
    text: str
    tokens: Any
    chunks: list[Chunk]
    passages: np.ndarray
    lexical: LexicalIndex
    reporter: _ProgressReporter


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RetrievalError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
