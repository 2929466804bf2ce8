"""The document catalogue as the API shows it, shared by the routes and the ``ragspec`` command's in-process path:
documents with their attributes and collections, collections with their counts, cursor pages, and uploads stored
all or nothing.

Every function takes the store and the caller's tenant; another tenant's collection or document is not found
(``CollectionNotFound`` / ``DocumentNotFound``), never shown. The calls are blocking (the catalogue's database):
the routes run them in a thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from app.errors import InvalidRequest
from app.schemas import (
    CollectionDocumentPage,
    CollectionOut,
    CollectionPage,
    DocumentAccepted,
    DocumentCounts,
    DocumentOut,
)
from retrieval.errors import CollectionNotFound, DocumentNotFound, InvalidAttributes
from retrieval.filters import Attributes, check_attributes
from retrieval.store import CollectionRecord, DocumentRecord, DocumentStore

logger = logging.getLogger(__name__)

STATUSES = ("queued", "indexing", "ready", "failed")


# ---- documents ------------------------------------------------------------------------------------


def document_out(record: DocumentRecord, attributes: Attributes | None = None,
                 collection_ids: Sequence[str] = ()) -> DocumentOut:
    return DocumentOut(
        id=record.id,
        title=record.title,
        status=record.status,
        progress=record.progress,
        collection_ids=list(collection_ids),
        attributes=dict(attributes or {}),
        message=record.message,
        media_type=record.content_type,
        size_bytes=record.size,
        chunks=record.n_chunks or None,
        tokens=record.n_tokens or None,
        created_at=record.created_at,
    )


def documents_out(store: DocumentStore, records: Sequence[DocumentRecord]) -> list[DocumentOut]:
    """The records with their attributes and collections (two queries for all of them)."""
    ids = [r.id for r in records]
    attributes, collections = store.attributes(ids), store.collections_of(ids)
    return [document_out(r, attributes.get(r.id), collections.get(r.id, ())) for r in records]


def document(store: DocumentStore, tenant: str, doc_id: str) -> DocumentOut:
    return documents_out(store, [store.get(doc_id, tenant)])[0]


def set_attributes(store: DocumentStore, tenant: str, doc_id: str, attributes: Any) -> DocumentOut:
    """Replace the document's attributes (``InvalidAttributes`` when out of bounds: nothing changed)."""
    store.set_attributes(doc_id, attributes, tenant)
    return document(store, tenant, doc_id)


def per_file_attributes(attributes: list[Any], files: int) -> list[Attributes]:
    """A multipart upload's list of one attributes object per file, each checked (naming its file)."""
    if len(attributes) != files:
        raise InvalidRequest(f"attributes: {len(attributes)} objects for {files} files (give one object for every "
                             "file, or a list of one object per file)")
    checked = []
    for n, each in enumerate(attributes, start=1):
        if not isinstance(each, dict):
            raise InvalidRequest(f"attributes of file {n}: must be a JSON object, got {type(each).__name__}")
        try:
            checked.append(check_attributes(each))
        except InvalidAttributes as exc:
            raise InvalidAttributes(f"attributes of file {n}: {exc}") from None
    return checked


class UploadBatch:
    """Uploads stored one by one (each parsed and written as it comes, so only one file's bytes are held at a
    time) and kept all or none: ``discard`` deletes those stored so far. Nothing is submitted for indexing here:
    the caller submits ``records`` once every file is stored.

    The attributes and the collection are checked when the batch opens, before any file is read. ``add`` runs in a
    worker thread that may still be storing when the request is cancelled and discards the batch: a document stored
    after ``discard`` is deleted at once, so none outlives a refused or abandoned upload."""

    def __init__(self, store: DocumentStore, tenant: str, *, attributes: Any = None,
                 collection_ids: Sequence[str] = (), purpose: str | None = None) -> None:
        self.store = store
        self.tenant = tenant
        self.purpose = purpose  # OpenAI's, for a file uploaded through /v1/files
        self.attributes = check_attributes(attributes if attributes is not None else {})
        self.collection_ids = list(dict.fromkeys(collection_ids))
        for cid in self.collection_ids:
            store.get_collection(cid, tenant)
        self.records: list[DocumentRecord] = []
        self._lock = threading.Lock()
        self._discarded = False

    def add(self, data: bytes, filename: str | None, content_type: str | None, title: str | None,
            attributes: Attributes | None = None) -> DocumentRecord:
        """Store one file, with its own ``attributes`` (checked: ``per_file_attributes``) or the batch's."""
        record = self.store.create(self.tenant, title, filename, content_type, data,
                                   attributes=self.attributes if attributes is None else attributes,
                                   collection_ids=self.collection_ids, purpose=self.purpose)
        with self._lock:
            if not self._discarded:
                self.records.append(record)
                return record
        self._delete([record])
        raise InvalidRequest("the upload was abandoned")

    def discard(self) -> None:
        """Delete every document stored by this batch, and any it stores from now on (bad input stores nothing
        half)."""
        with self._lock:
            self._discarded = True
            records, self.records = self.records, []
        self._delete(records)

    def _delete(self, records: list[DocumentRecord]) -> None:
        for record in records:
            try:
                self.store.delete(record.id, self.tenant)
            except DocumentNotFound:  # deleted meanwhile
                continue
            except Exception:  # the others are still deleted; this one is logged for the operator
                logger.exception("could not delete document %s of a refused upload", record.id)

    def accepted(self) -> list[DocumentAccepted]:
        """Each stored document as accepted, its attributes as stored and read back (integral numbers as
        integers)."""
        stored = self.store.attributes([r.id for r in self.records])
        return [DocumentAccepted(id=r.id, title=r.title, status=r.status, progress=r.progress,
                                 collection_ids=self.collection_ids, attributes=stored.get(r.id, {}))
                for r in self.records]


# ---- collections ----------------------------------------------------------------------------------


def collection_out(store: DocumentStore, record: CollectionRecord) -> CollectionOut:
    counts = store.member_counts([record.id])
    by_status = {s: counts.by_status.get(s, 0) for s in STATUSES}
    return CollectionOut(
        id=record.id, name=record.name, description=record.description, metadata=dict(record.metadata),
        created_at=record.created_at, document_counts=DocumentCounts(**by_status, total=counts.total),
        chunks=counts.chunks, tokens=counts.tokens, bytes=counts.bytes,
    )


def create_collection(store: DocumentStore, tenant: str, name: str, description: str | None = None,
                      metadata: dict[str, str] | None = None) -> CollectionOut:
    return collection_out(store, store.create_collection(tenant, name, description, metadata))


def collection(store: DocumentStore, tenant: str, collection_id: str) -> CollectionOut:
    return collection_out(store, store.get_collection(collection_id, tenant))


def update_collection(store: DocumentStore, tenant: str, collection_id: str, **fields: Any) -> CollectionOut:
    """Set ``fields`` (name, description, metadata: a None metadata is an empty one)."""
    if "metadata" in fields and fields["metadata"] is None:
        fields["metadata"] = {}
    return collection_out(store, store.update_collection(collection_id, tenant, **fields))


def delete_collection(store: DocumentStore, tenant: str, collection_id: str, *,
                      delete_documents: bool = False) -> list[str]:
    """Delete the collection (its documents too with ``delete_documents``); the ids of the documents deleted."""
    return store.delete_collection(collection_id, tenant, delete_documents=delete_documents)


def add_documents(store: DocumentStore, tenant: str, collection_id: str, doc_ids: Sequence[str]) -> CollectionOut:
    """Add existing documents (an unknown one, or another tenant's: ``DocumentNotFound``, nothing added)."""
    store.add_to_collection(collection_id, list(dict.fromkeys(doc_ids)), tenant)
    return collection(store, tenant, collection_id)


def remove_document(store: DocumentStore, tenant: str, collection_id: str, doc_id: str) -> None:
    store.remove_from_collection(collection_id, doc_id, tenant)


def collection_page(store: DocumentStore, tenant: str, limit: int, after: str | None = None) -> CollectionPage:
    """The tenant's collections after ``after`` (a collection id of the tenant's), oldest first."""
    if after is not None:
        check_cursor(lambda: store.get_collection(after, tenant), after)
    records = store.list_collections(tenant, limit + 1, after)
    data = [collection_out(store, r) for r in records[:limit]]
    return CollectionPage(data=data, has_more=len(records) > limit, last_id=data[-1].id if data else None)


def document_page(store: DocumentStore, tenant: str, collection_id: str, limit: int,
                  after: str | None = None) -> CollectionDocumentPage:
    """The collection's documents after ``after`` (a document id of the tenant's), oldest first."""
    store.get_collection(collection_id, tenant)
    if after is not None:
        check_cursor(lambda: store.get(after, tenant), after)
    records = store.members([collection_id], limit=limit + 1, after=after)
    data = documents_out(store, records[:limit])
    return CollectionDocumentPage(data=data, has_more=len(records) > limit, last_id=data[-1].id if data else None)


def check_cursor(lookup: Any, after: str) -> None:
    """A cursor must name something of the caller's: an unknown one is a 422, never an empty page that would end
    a client's paging early."""
    try:
        lookup()
    except (CollectionNotFound, DocumentNotFound):
        raise InvalidRequest(f"after: {after!r} is not an id of this list (use the last id of a page)") from None
