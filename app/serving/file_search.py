"""OpenAI's file search objects over ragspec's catalogue: a file is a document, a vector store a collection, a vector
store file a document's membership (its attributes are the document's: shared by every store it is in), a file batch
documents added together. Each function takes the store (and the tenant: another tenant's objects are not found) and
answers OpenAI's object; the routes only convert (``app.api.routes.files``, ``app.api.routes.vector_stores``).

Statuses follow ragspec's indexing: queued / indexing -> ``in_progress``, ready -> ``completed``, failed ->
``failed`` (``last_error`` its message); a file whose batch was cancelled before it was indexed -> ``cancelled``
(it was taken out of the store, and stays a file). A vector store with ``expires_after`` expires that many days
after it was last searched or asked (``last_active_at``): it is then ``expired`` and refuses searches."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import InvalidRequest
from app.openai_schemas import (
    FILE_PURPOSES,
    ChunkingStrategy,
    ExpiresAfter,
    FileBatchObject,
    FileCounts,
    FileObject,
    LastError,
    ListPage,
    SearchResult,
    SearchResultsPage,
    StaticChunking,
    TextContent,
    VectorStoreFileObject,
    VectorStoreObject,
    VectorStoreSearch,
)
from app.serving.catalogue import check_cursor
from retrieval.catalogue import CollectionRecord, DocumentRecord, DocumentStatus, FileBatchRecord
from retrieval.errors import DocumentNotFound
from retrieval.filters import check_attributes, parse_filter
from retrieval.library import CollectionIndexes
from retrieval.retriever import DEFAULT_CANDIDATES, Retriever
from retrieval.store import DocumentStore

Order = Literal["asc", "desc"]
DAY_S = 86_400
IN_PROGRESS: tuple[DocumentStatus, ...] = ("queued", "indexing")
STATUS_FILTERS: dict[str, list[DocumentStatus]] = {"in_progress": list(IN_PROGRESS), "completed": ["ready"],
                                                  "failed": ["failed"]}
# a document that failed because of what it holds, against one that failed on the server's side
INVALID_FILE = ("no text", "no tokens", "unreadable", "empty", "unsupported", "too many pages")


@dataclass(frozen=True)
class FileSearch:
    """What the file search objects read: the store, the retriever and the collections' indexes (a store's
    search), and how every document is chunked (the indexing settings)."""

    store: DocumentStore
    retriever: Retriever
    library: CollectionIndexes
    chunk_tokens: int
    chunk_overlap: int


# ---- files ----------------------------------------------------------------------------------------------------


def file_object(record: DocumentRecord) -> FileObject:
    status: Literal["uploaded", "processed", "error"] = (
        "processed" if record.status == "ready" else "error" if record.status == "failed" else "uploaded")
    return FileObject(id=record.id, bytes=record.size, created_at=int(record.created_at),
                      filename=record.filename or record.title, purpose=record.purpose or "assistants",
                      status=status, status_details=record.message if record.status == "failed" else None)


def check_purpose(purpose: str | None) -> str:
    if purpose not in FILE_PURPOSES:
        raise InvalidRequest(f"purpose: ragspec keeps files for file search: {' or '.join(FILE_PURPOSES)} "
                             f"(got {purpose!r})")
    return purpose


def file_page(store: DocumentStore, tenant: str, limit: int, order: Order, after: str | None,
              purpose: str | None) -> ListPage:
    if after is not None:
        check_cursor(lambda: store.get(after, tenant), after)
    records = store.page(tenant, limit + 1, after, newest_first=order == "desc", purpose=purpose)
    return _list([file_object(r) for r in records[:limit]], len(records) > limit)


# ---- vector stores --------------------------------------------------------------------------------------------


def chunking(fs: FileSearch) -> ChunkingStrategy:
    """How ragspec chunks every document (its settings): what a vector store file reports."""
    return ChunkingStrategy(static=StaticChunking(max_chunk_size_tokens=fs.chunk_tokens,
                                                  chunk_overlap_tokens=fs.chunk_overlap))


def check_chunking(fs: FileSearch, strategy: dict[str, Any] | None) -> None:
    """``auto`` or ragspec's own static chunking; any other is refused by name (documents are chunked once, with the
    service's settings, whatever store they are in)."""
    if strategy is None or strategy == {"type": "auto"}:
        return
    ours = chunking(fs)
    if strategy == ours.model_dump():
        return
    raise InvalidRequest(
        f"chunking_strategy: ragspec chunks every document once, with max_chunk_size_tokens="
        f"{ours.static.max_chunk_size_tokens} and chunk_overlap_tokens={ours.static.chunk_overlap_tokens} "
        "(RAGSPEC_CHUNK_TOKENS, RAGSPEC_CHUNK_OVERLAP); give {\"type\": \"auto\"} or that static strategy")


def expires_at(record: CollectionRecord) -> int | None:
    if record.expires_after_days is None:
        return None
    return int((record.last_active_at or record.created_at) + record.expires_after_days * DAY_S)


def check_active(record: CollectionRecord) -> None:
    at = expires_at(record)
    if at is not None and at <= time.time():
        raise InvalidRequest(f"vector_store_id: vector store {record.id} expired at {at} (it was not used for "
                             f"{record.expires_after_days} days)")


def vector_store_object(store: DocumentStore, record: CollectionRecord) -> VectorStoreObject:
    counts = store.member_counts([record.id])
    by = counts.by_status
    cancelled = len(store.cancelled_documents(record.id))
    file_counts = FileCounts(in_progress=sum(by.get(s, 0) for s in IN_PROGRESS), completed=by.get("ready", 0),
                             failed=by.get("failed", 0), cancelled=cancelled, total=counts.total + cancelled)
    at = expires_at(record)
    status: Literal["expired", "in_progress", "completed"] = (
        "expired" if at is not None and at <= time.time() else "in_progress" if file_counts.in_progress
        else "completed")
    return VectorStoreObject(
        id=record.id, created_at=int(record.created_at), name=record.name, description=record.description,
        usage_bytes=counts.bytes, file_counts=file_counts, status=status,
        expires_after=None if record.expires_after_days is None else ExpiresAfter(
            anchor="last_active_at", days=record.expires_after_days),
        expires_at=at, last_active_at=None if record.last_active_at is None else int(record.last_active_at),
        metadata=dict(record.metadata))


def create_vector_store(fs: FileSearch, tenant: str, name: str | None, description: str | None,
                        file_ids: Sequence[str], metadata: dict[str, str] | None,
                        chunking_strategy: dict[str, Any] | None, expires_after: ExpiresAfter | None
                        ) -> VectorStoreObject:
    """A collection with the tenant's files in it (an unknown file: 404 naming it, nothing created)."""
    check_chunking(fs, chunking_strategy)
    store = fs.store
    ids = list(dict.fromkeys(file_ids))
    for doc_id in ids:
        store.get(doc_id, tenant)
    record = store.create_collection(tenant, name or "", description, metadata,
                                     expires_after_days=None if expires_after is None else expires_after.days)
    if ids:
        store.add_to_collection(record.id, ids, tenant)
    return vector_store_object(store, store.get_collection(record.id, tenant))


def vector_store_page(store: DocumentStore, tenant: str, limit: int, order: Order, after: str | None) -> ListPage:
    if after is not None:
        check_cursor(lambda: store.get_collection(after, tenant), after)
    records = store.list_collections(tenant, limit + 1, after, newest_first=order == "desc")
    return _list([vector_store_object(store, r) for r in records[:limit]], len(records) > limit)


def update_vector_store(store: DocumentStore, tenant: str, collection_id: str, fields: dict[str, Any]
                        ) -> VectorStoreObject:
    """``name``, ``metadata`` (null: none) and ``expires_after`` (null: never expires) as given."""
    changes: dict[str, Any] = {}
    if "name" in fields:
        changes["name"] = fields["name"] or ""
    if "metadata" in fields:
        changes["metadata"] = fields["metadata"] or {}
    if "expires_after" in fields:
        after = fields["expires_after"]
        changes["expires_after_days"] = None if after is None else after["days"]
        changes["last_active_at"] = time.time()  # the clock starts again from the change
    return vector_store_object(store, store.update_collection(collection_id, tenant, **changes))


# ---- vector store files ---------------------------------------------------------------------------------------


def _status(record: DocumentRecord) -> Literal["in_progress", "completed", "cancelled", "failed"]:
    return "completed" if record.status == "ready" else "failed" if record.status == "failed" else "in_progress"


def _last_error(record: DocumentRecord) -> LastError | None:
    if record.status != "failed":
        return None
    message = record.message or "indexing failed"
    invalid = any(word in message.lower() for word in INVALID_FILE)
    return LastError(code="invalid_file" if invalid else "server_error", message=message)


def vector_store_files(fs: FileSearch, collection_id: str, records: Sequence[DocumentRecord],
                       cancelled: Sequence[str] = ()) -> list[VectorStoreFileObject]:
    store = fs.store
    ids = [r.id for r in records]
    added = store.added_at(collection_id, ids)
    attributes = store.attributes(ids)
    strategy = chunking(fs)
    return [VectorStoreFileObject(
        id=r.id, created_at=int(added.get(r.id, r.created_at)), vector_store_id=collection_id, usage_bytes=r.size,
        status="cancelled" if r.id in cancelled else _status(r), last_error=_last_error(r),
        attributes=attributes.get(r.id, {}), chunking_strategy=strategy) for r in records]


def add_file(fs: FileSearch, tenant: str, collection_id: str, file_id: str, attributes: dict[str, Any] | None,
             chunking_strategy: dict[str, Any] | None) -> VectorStoreFileObject:
    """Put the file in the store; ``attributes`` given replace the document's (checked before anything changes)."""
    check_chunking(fs, chunking_strategy)
    store = fs.store
    checked = None if attributes is None else check_attributes(attributes)
    store.get_collection(collection_id, tenant)
    store.get(file_id, tenant)
    if checked is not None:
        store.set_attributes(file_id, checked, tenant)
    store.add_to_collection(collection_id, [file_id], tenant)
    return vector_store_file(fs, tenant, collection_id, file_id)


def vector_store_file(fs: FileSearch, tenant: str, collection_id: str, file_id: str) -> VectorStoreFileObject:
    """The file as a member of the store (one not in it: 404)."""
    store = fs.store
    store.get_collection(collection_id, tenant)
    record = store.get(file_id, tenant)
    cancelled = store.cancelled_documents(collection_id)
    if file_id not in store.added_at(collection_id, [file_id]) and file_id not in cancelled:
        raise DocumentNotFound(file_id)
    return vector_store_files(fs, collection_id, [record], cancelled)[0]


def update_file_attributes(fs: FileSearch, tenant: str, collection_id: str, file_id: str,
                           attributes: dict[str, Any] | None) -> VectorStoreFileObject:
    vector_store_file(fs, tenant, collection_id, file_id)  # a member: else 404
    fs.store.set_attributes(file_id, attributes or {}, tenant)
    return vector_store_file(fs, tenant, collection_id, file_id)


def vector_store_file_page(fs: FileSearch, tenant: str, collection_id: str, limit: int, order: Order,
                           after: str | None, status: str | None, batch: FileBatchRecord | None = None
                           ) -> ListPage:
    """The store's files (or a batch's), with ``status`` when given; ``cancelled`` lists those its batches' cancels
    took out."""
    store = fs.store
    store.get_collection(collection_id, tenant)
    if after is not None:
        check_cursor(lambda: store.get(after, tenant), after)
    cursor = None if after is None else store.get(after, tenant)
    cancelled = store.cancelled_documents(collection_id)
    newest_first = order == "desc"
    if status == "cancelled":
        ids = [d for d in cancelled if batch is None or d in batch.cancelled_ids]
        records = _paged([r for r in _existing(store, ids)], limit + 1, cursor, newest_first)
    else:
        statuses = STATUS_FILTERS.get(status or "")
        if status is not None and statuses is None:
            raise InvalidRequest(f"filter: one of in_progress, completed, failed, cancelled (got {status!r})")
        if batch is None:
            records = store.members([collection_id], statuses=statuses, limit=limit + 1, after=after,
                                    newest_first=newest_first)
        else:
            found = [r for r in _existing(store, batch.doc_ids) if statuses is None or r.status in statuses]
            if status is None:
                found += _existing(store, batch.cancelled_ids)
            records = _paged(found, limit + 1, cursor, newest_first)
    return _list(vector_store_files(fs, collection_id, records[:limit], cancelled), len(records) > limit)


def file_content(fs: FileSearch, tenant: str, collection_id: str, file_id: str) -> list[TextContent]:
    """The file's text as parsed (what its chunks were cut from)."""
    vector_store_file(fs, tenant, collection_id, file_id)
    return [TextContent(text=fs.store.load_text(file_id))]


# ---- file batches ---------------------------------------------------------------------------------------------


def batch_object(store: DocumentStore, batch: FileBatchRecord) -> FileBatchObject:
    records = _existing(store, batch.doc_ids)
    by: dict[str, int] = {}
    for r in records:
        by[_status(r)] = by.get(_status(r), 0) + 1
    counts = FileCounts(in_progress=by.get("in_progress", 0), completed=by.get("completed", 0),
                        failed=by.get("failed", 0), cancelled=len(batch.cancelled_ids),
                        total=len(records) + len(batch.cancelled_ids))
    status: Literal["in_progress", "completed", "cancelled", "failed"] = (
        "cancelled" if batch.cancelled_at is not None else "in_progress" if counts.in_progress
        else "failed" if counts.failed and counts.failed == len(records) else "completed")
    return FileBatchObject(id=batch.id, created_at=int(batch.created_at), vector_store_id=batch.collection_id,
                           status=status, file_counts=counts)


def create_batch(fs: FileSearch, tenant: str, collection_id: str, file_ids: Sequence[str],
                 attributes: dict[str, Any] | None, chunking_strategy: dict[str, Any] | None) -> FileBatchObject:
    """The files added together (an unknown one: 404, none added); ``attributes`` given set on each."""
    check_chunking(fs, chunking_strategy)
    store = fs.store
    checked = None if attributes is None else check_attributes(attributes)
    store.get_collection(collection_id, tenant)
    ids = list(dict.fromkeys(file_ids))
    for doc_id in ids:
        store.get(doc_id, tenant)
    if checked is not None:
        for doc_id in ids:
            store.set_attributes(doc_id, checked, tenant)
    return batch_object(store, store.create_batch(collection_id, ids, tenant))


# ---- search ---------------------------------------------------------------------------------------------------


def search(fs: FileSearch, tenant: str, collection_id: str, body: VectorStoreSearch) -> SearchResultsPage:
    """The store's chunks best matching the query, as ragspec ranks a collection question's candidates (dense and
    BM25 candidates from its index, the filter applied inside the search, the hybrid score); ``score`` is that score
    (cosine similarity and normalised BM25, weighted; below 0 shown as 0)."""
    store = fs.store
    record = store.get_collection(collection_id, tenant)
    check_active(record)
    if body.rewrite_query:
        raise InvalidRequest("rewrite_query: ragspec searches with the query as given (no model rewrites it)")
    queries = [body.query] if isinstance(body.query, str) else list(body.query)
    if not queries or any(not q.strip() for q in queries):
        raise InvalidRequest("query: a non-empty string or list of non-empty strings")
    where = parse_filter(body.filters, "filters") if body.filters is not None else None
    store.touch_collections([collection_id])
    counts = store.member_counts([collection_id], where=where)
    if not counts.by_status.get("ready"):
        return SearchResultsPage(search_query=queries, data=[])
    allowed = set(store.member_stamps([collection_id], where=where)) if where is not None else None
    ranking = fs.retriever.rank_library(
        queries, fs.library, [collection_id], total_tokens=counts.ready_tokens, allowed=allowed,
        candidates=max(DEFAULT_CANDIDATES, 4 * body.max_num_results), top_k=body.max_num_results, tenant=tenant)
    floor = body.ranking_options.score_threshold if body.ranking_options is not None else None
    hits = sorted(ranking.hits, key=lambda h: -h.score)
    hits = [h for h in hits if floor is None or h.score >= floor][: body.max_num_results]
    ids = {h.document_id for h in hits}
    records = {r.id: r for r in _existing(store, ids)}
    attributes = store.attributes(ids)
    data = [SearchResult(file_id=h.document_id, filename=_filename(records.get(h.document_id)),
                         score=max(0.0, round(h.score, 6)), attributes=attributes.get(h.document_id, {}),
                         content=[TextContent(text=h.text)]) for h in hits]
    return SearchResultsPage(search_query=queries, data=data)


# ---- helpers --------------------------------------------------------------------------------------------------


def _filename(record: DocumentRecord | None) -> str:
    return "" if record is None else record.filename or record.title


def _existing(store: DocumentStore, doc_ids: Any) -> list[DocumentRecord]:
    out = []
    for doc_id in doc_ids:
        try:
            out.append(store.get(doc_id))
        except DocumentNotFound:  # deleted since
            continue
    return out


def _paged(records: list[DocumentRecord], limit: int, cursor: DocumentRecord | None,
           newest_first: bool) -> list[DocumentRecord]:
    """A page of ``records`` past ``cursor`` in (created_at, id) order (or its reverse): the cursor found by its
    place, not in the list (it may have left a status-filtered list since its page)."""
    ordered = sorted(records, key=lambda r: (r.created_at, r.id), reverse=newest_first)
    if cursor is not None:
        at = (cursor.created_at, cursor.id)
        ordered = [r for r in ordered if ((r.created_at, r.id) < at if newest_first else (r.created_at, r.id) > at)]
    return ordered[:limit]


def _list(data: Sequence[Any], has_more: bool) -> ListPage:
    return ListPage(data=list(data), first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=has_more)


def check_before(before: str | None) -> None:
    if before is not None:
        raise InvalidRequest("before: ragspec pages forward only: follow the last id of each page with after")
