"""The document store's catalogue: one row of metadata per document (``DocumentRecord``), in SQLite (the embedded
default, a file in the store's directory) or PostgreSQL (a database URL: a catalogue several replicas share).

One data layer for both (SQLAlchemy Core) and one schema history (Alembic, ``retrieval/migrations``): opening a
catalogue brings its schema to the newest revision. A SQLite store made before the migrations existed (its table
there, no revision recorded) is adopted as it is. Only ``DocumentStore`` uses it, under its own lock (the catalogue
itself takes none): the store keeps the rows and the document dirs consistent with each other.
"""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from retrieval.errors import CatalogueUnavailable, CollectionNotFound, DocumentNotFound
from retrieval.filters import Attributes, Filter, attribute_row, attribute_value, to_sql
from retrieval.parsing import DocumentKind

DocumentStatus = Literal["queued", "indexing", "ready", "failed"]

MIGRATIONS = Path(__file__).parent / "migrations"

metadata = sa.MetaData()
documents = sa.Table(
    "documents",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("filename", sa.Text),
    sa.Column("content_type", sa.Text),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("progress", sa.Double, nullable=False, server_default="0"),
    sa.Column("message", sa.Text),
    sa.Column("n_chunks", sa.Integer, nullable=False, server_default="0"),
    sa.Column("n_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("embedder", sa.Text),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.Column("purpose", sa.Text),  # OpenAI's file purpose, as uploaded through /v1/files (None: ragspec's API)
    sa.Index("documents_tenant", "tenant", "created_at"),
)
# A document waiting for ingestion or being ingested: the worker that claimed it and until when (None: unclaimed)
ingest_jobs = sa.Table(
    "ingest_jobs",
    metadata,
    sa.Column("doc_id", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text),
    sa.Column("lease_until", sa.Double),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Index("ingest_jobs_created", "created_at"),
)
# A tenant's named set of documents; ``version`` is bumped by every change of its members (added, removed, deleted,
# their status or attributes changed): what a collection's search index and cached prompt are keyed by.
collections = sa.Table(
    "collections",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("description", sa.Text),
    sa.Column("metadata", sa.Text),  # JSON object of strings
    sa.Column("version", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.Column("expires_after_days", sa.Integer),  # a vector store's expiry: days after last_active_at (None: never)
    sa.Column("last_active_at", sa.Double),  # last asked or searched (None: never)
    sa.Index("collections_tenant", "tenant", "created_at", "id"),
)
collection_documents = sa.Table(
    "collection_documents",
    metadata,
    sa.Column("collection_id", sa.Text, primary_key=True),
    sa.Column("doc_id", sa.Text, primary_key=True),
    sa.Column("added_at", sa.Double, nullable=False),
    sa.Index("collection_documents_doc", "doc_id"),
)
# One row per attribute; the value in the column of its kind (s: text_value; n, b: num_value), compared by code point
document_attributes = sa.Table(
    "document_attributes",
    metadata,
    sa.Column("doc_id", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("text_value", sa.Text().with_variant(sa.Text(collation="C"), "postgresql")),
    sa.Column("num_value", sa.Double),
    sa.Index("document_attributes_key", "key", "doc_id"),
)
# Documents added to a collection together (OpenAI's vector store file batches); a cancel takes the documents not
# yet indexed out of the collection and marks them
file_batches = sa.Table(
    "file_batches",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("collection_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("cancelled_at", sa.Double),
    sa.Index("file_batches_collection", "collection_id"),
)
file_batch_documents = sa.Table(
    "file_batch_documents",
    metadata,
    sa.Column("batch_id", sa.Text, primary_key=True),
    sa.Column("doc_id", sa.Text, primary_key=True),
    sa.Column("cancelled", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("added", sa.Boolean, nullable=False, server_default=sa.true()),  # the batch put it in the collection
    sa.Index("file_batch_documents_doc", "doc_id"),
)
# The Responses API's stored answers (the response object as JSON), each naming the response it follows
responses = sa.Table(
    "responses",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("previous_id", sa.Text),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
)
_COLUMNS = tuple(c.name for c in documents.columns)
_ORDER = (documents.c.created_at, documents.c.id)
_COLLECTION_ORDER = (collections.c.created_at, collections.c.id)


@dataclass(frozen=True)
class FileBatchRecord:
    """Documents added to a collection together; ``cancelled_ids`` those a cancel took out of it."""

    id: str
    collection_id: str
    created_at: float
    cancelled_at: float | None
    doc_ids: tuple[str, ...]
    cancelled_ids: tuple[str, ...]
    added_ids: tuple[str, ...] = ()  # of doc_ids, those the batch put in the collection (a cancel may take out)


@dataclass(frozen=True)
class Claim:
    """An ingestion job a worker holds until ``lease_until`` (renewed while it works); ``attempt`` counts claims."""

    doc_id: str
    owner: str
    attempt: int


@dataclass(frozen=True)
class DocumentRecord:
    """Metadata row of one document. ``n_tokens`` counts target tokens of the whole text."""

    id: str
    tenant: str
    title: str
    filename: str | None
    content_type: str | None
    kind: DocumentKind
    size: int
    status: DocumentStatus
    progress: float
    message: str | None
    n_chunks: int
    n_tokens: int
    embedder: str | None
    created_at: float
    updated_at: float
    purpose: str | None = None


@dataclass(frozen=True)
class CollectionRecord:
    """Row of one collection; ``metadata`` a JSON object (string values)."""

    id: str
    tenant: str
    name: str
    description: str | None
    metadata: dict[str, str]
    version: int
    created_at: float
    updated_at: float
    expires_after_days: int | None = None
    last_active_at: float | None = None


@dataclass(frozen=True)
class MemberCounts:
    """A collection's (or a filtered set's) documents by status, and the sums over them."""

    by_status: dict[str, int]
    chunks: int
    tokens: int
    bytes: int
    ready_tokens: int

    @property
    def total(self) -> int:
        return sum(self.by_status.values())


def database_url(target: Path | str) -> str:
    """A SQLAlchemy URL: a path is a SQLite file; ``postgresql://`` URLs use psycopg 3."""
    if isinstance(target, Path):
        return f"sqlite:///{target}"
    if target.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + target.split("://", 1)[1]
    return target


def shown(url: str) -> str:
    """A URL fit for logs and errors: its password hidden."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<an unparsable database URL>"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def upgrade(engine: sa.Engine) -> None:
    """Bring the schema to the newest revision (Alembic's ``upgrade head``, on this engine)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


class Catalogue:
    """The ``documents`` table of a SQLite file (``target`` a path) or of a database URL (PostgreSQL). Every call is
    its own transaction. Raises ``CatalogueUnavailable`` when the database cannot be reached or migrated."""

    def __init__(self, target: Path | str) -> None:
        self.url = database_url(target)
        try:
            self._engine = sa.create_engine(self.url, pool_pre_ping=True)
        except (sa.exc.ArgumentError, ModuleNotFoundError) as exc:
            raise CatalogueUnavailable(f"the catalogue database {shown(self.url)} cannot be used: {exc}") from exc
        if self._engine.dialect.name == "sqlite":
            sa.event.listen(self._engine, "connect", _sqlite_pragmas)
        try:
            upgrade(self._engine)
        except sa.exc.OperationalError as exc:
            self._engine.dispose()
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
            raise CatalogueUnavailable(f"the catalogue database {shown(self.url)} is unreachable: {reason}") from exc

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return str(self._engine.dialect.name)

    def close(self) -> None:
        self._engine.dispose()

    def insert(self, record: DocumentRecord, *, job: bool = False, attributes: Attributes | None = None,
               collection_ids: Iterable[str] = ()) -> None:
        """A new row; with ``job``, its ingestion job too, and its attributes and memberships, in the same
        transaction (never a queued document that no worker would ever take, nor one half in its collections)."""
        with self._engine.begin() as conn:
            conn.execute(documents.insert().values({c: getattr(record, c) for c in _COLUMNS}))
            if job:
                conn.execute(ingest_jobs.insert().values(doc_id=record.id, created_at=record.created_at))
            if attributes:
                conn.execute(document_attributes.insert(),
                             [attribute_row(record.id, k, v) for k, v in attributes.items()])
            cids = list(dict.fromkeys(collection_ids))
            if cids:
                conn.execute(collection_documents.insert(), [
                    {"collection_id": c, "doc_id": record.id, "added_at": record.created_at} for c in cids])
                _bump(conn, cids)

    def row(self, doc_id: str) -> DocumentRecord | None:
        with self._engine.connect() as conn:
            row = conn.execute(documents.select().where(documents.c.id == doc_id)).first()
        return _record(row) if row else None

    def ids(self, statuses: Iterable[DocumentStatus] | None = None) -> list[str]:
        """Ids (with one of ``statuses``, all when None), oldest first."""
        query = sa.select(documents.c.id).order_by(*_ORDER)
        if statuses is not None:
            query = query.where(documents.c.status.in_(list(statuses)))
        with self._engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    def list(self, tenant: str | None) -> list[DocumentRecord]:
        """Rows of ``tenant`` (all when None), oldest first."""
        query = documents.select().order_by(*_ORDER)
        if tenant is not None:
            query = query.where(documents.c.tenant == tenant)
        with self._engine.connect() as conn:
            return [_record(r) for r in conn.execute(query)]

    def page(self, tenant: str, limit: int, after: str | None = None, *, newest_first: bool = False,
             purpose: str | None = None) -> builtins.list[DocumentRecord]:
        """Up to ``limit`` rows of ``tenant`` (with ``purpose`` when given), oldest (or newest) first, from the one
        after ``after`` (an id)."""
        query = documents.select().where(documents.c.tenant == tenant).order_by(*_ordered(_ORDER, newest_first))
        if purpose is not None:  # a document uploaded through ragspec's own API is an "assistants" file
            same = documents.c.purpose == purpose
            query = query.where(sa.or_(same, documents.c.purpose.is_(None)) if purpose == "assistants" else same)
        with self._engine.connect() as conn:
            if after is not None:
                query = query.where(_after(conn, documents, after, newest_first))
            return [_record(r) for r in conn.execute(query.limit(limit))]

    def update(self, doc_id: str, **fields: Any) -> None:
        """Set ``fields`` (and ``updated_at``); DocumentNotFound when there is no such row."""
        fields["updated_at"] = time.time()
        with self._engine.begin() as conn:
            result = conn.execute(documents.update().where(documents.c.id == doc_id).values(**fields))
            if result.rowcount and "status" in fields:  # its collections' indexes and prompts follow
                _bump_collections_of(conn, doc_id)
        if result.rowcount == 0:
            raise DocumentNotFound(doc_id)

    def delete(self, doc_id: str) -> None:
        """The row, its job, attributes and memberships (its collections' versions bumped), in one transaction."""
        with self._engine.begin() as conn:
            _bump_collections_of(conn, doc_id)
            conn.execute(documents.delete().where(documents.c.id == doc_id))
            conn.execute(ingest_jobs.delete().where(ingest_jobs.c.doc_id == doc_id))
            conn.execute(document_attributes.delete().where(document_attributes.c.doc_id == doc_id))
            conn.execute(collection_documents.delete().where(collection_documents.c.doc_id == doc_id))
            conn.execute(file_batch_documents.delete().where(file_batch_documents.c.doc_id == doc_id))

    # --- attributes -----------------------------------------------------------------------------

    def set_attributes(self, doc_id: str, attributes: Attributes) -> None:
        """Replace the document's attributes (its collections' versions bumped); DocumentNotFound without a row."""
        with self._engine.begin() as conn:
            if conn.execute(sa.select(documents.c.id).where(documents.c.id == doc_id)).first() is None:
                raise DocumentNotFound(doc_id)
            conn.execute(document_attributes.delete().where(document_attributes.c.doc_id == doc_id))
            if attributes:
                conn.execute(document_attributes.insert(),
                             [attribute_row(doc_id, k, v) for k, v in attributes.items()])
            _bump_collections_of(conn, doc_id)

    def attributes(self, doc_ids: Iterable[str]) -> dict[str, Attributes]:
        """Attributes of each of ``doc_ids`` (every id a key, {} for none), keys sorted."""
        ids = list(dict.fromkeys(doc_ids))
        out: dict[str, Attributes] = {d: {} for d in ids}
        a = document_attributes.c
        with self._engine.connect() as conn:
            for part in _batches(ids):
                rows = conn.execute(sa.select(a.doc_id, a.key, a.kind, a.text_value, a.num_value)
                                    .where(a.doc_id.in_(part)).order_by(a.doc_id, a.key))
                for r in rows:
                    out[r.doc_id][r.key] = attribute_value(r.kind, r.text_value, r.num_value)
        return out

    # --- collections ----------------------------------------------------------------------------

    def insert_collection(self, record: CollectionRecord) -> None:
        with self._engine.begin() as conn:
            conn.execute(collections.insert().values(_collection_row(record)))

    def collection(self, collection_id: str) -> CollectionRecord | None:
        with self._engine.connect() as conn:
            row = conn.execute(collections.select().where(collections.c.id == collection_id)).first()
        return _collection(row) if row else None

    def collections(self, tenant: str | None, limit: int | None = None, after: str | None = None, *,
                    newest_first: bool = False) -> builtins.list[CollectionRecord]:
        """Collections of ``tenant`` (all when None), oldest (or newest) first, from the one after ``after`` (an
        id)."""
        query = collections.select().order_by(*_ordered(_COLLECTION_ORDER, newest_first))
        if tenant is not None:
            query = query.where(collections.c.tenant == tenant)
        with self._engine.connect() as conn:
            if after is not None:
                query = query.where(_after(conn, collections, after, newest_first))
            if limit is not None:
                query = query.limit(limit)
            return [_collection(r) for r in conn.execute(query)]

    def update_collection(self, collection_id: str, **fields: Any) -> None:
        """Set ``fields`` (name, description, metadata) and ``updated_at``; CollectionNotFound without a row."""
        if "metadata" in fields:
            fields["metadata"] = json.dumps(fields["metadata"] or {}, sort_keys=True)
        fields["updated_at"] = time.time()
        with self._engine.begin() as conn:
            result = conn.execute(collections.update().where(collections.c.id == collection_id).values(**fields))
        if result.rowcount == 0:
            raise CollectionNotFound(collection_id)

    def delete_collection(self, collection_id: str) -> builtins.list[str]:
        """The collection and its memberships (not its documents); the ids its members had, oldest first."""
        with self._engine.begin() as conn:
            members = [str(r[0]) for r in conn.execute(
                sa.select(collection_documents.c.doc_id)
                .join(documents, documents.c.id == collection_documents.c.doc_id)
                .where(collection_documents.c.collection_id == collection_id).order_by(*_ORDER))]
            conn.execute(collection_documents.delete().where(collection_documents.c.collection_id == collection_id))
            batches = sa.select(file_batches.c.id).where(file_batches.c.collection_id == collection_id)
            conn.execute(file_batch_documents.delete().where(file_batch_documents.c.batch_id.in_(batches)))
            conn.execute(file_batches.delete().where(file_batches.c.collection_id == collection_id))
            result = conn.execute(collections.delete().where(collections.c.id == collection_id))
        if result.rowcount == 0:
            raise CollectionNotFound(collection_id)
        return members

    def add_members(self, collection_id: str, doc_ids: Iterable[str]) -> int:
        """Put documents in the collection (those already in it are left as they are); how many were added. The
        caller checked that they exist."""
        now = time.time()
        with self._engine.begin() as conn:
            have = {str(r[0]) for r in conn.execute(sa.select(collection_documents.c.doc_id).where(
                collection_documents.c.collection_id == collection_id))}
            new = [d for d in dict.fromkeys(doc_ids) if d not in have]
            if new:
                conn.execute(collection_documents.insert(),
                             [{"collection_id": collection_id, "doc_id": d, "added_at": now} for d in new])
                _bump(conn, [collection_id])
        return len(new)

    def remove_member(self, collection_id: str, doc_id: str) -> bool:
        """Take a document out of the collection; False when it was not in it."""
        with self._engine.begin() as conn:
            result = conn.execute(collection_documents.delete().where(
                collection_documents.c.collection_id == collection_id, collection_documents.c.doc_id == doc_id))
            if result.rowcount:
                _bump(conn, [collection_id])
        return bool(result.rowcount)

    def collections_of(self, doc_ids: Iterable[str]) -> dict[str, builtins.list[str]]:
        """The collections each of ``doc_ids`` belongs to (every id a key), oldest collection first."""
        ids = list(dict.fromkeys(doc_ids))
        out: dict[str, builtins.list[str]] = {d: [] for d in ids}
        m = collection_documents.c
        with self._engine.connect() as conn:
            for part in _batches(ids):
                rows = conn.execute(sa.select(m.doc_id, m.collection_id)
                                    .join(collections, collections.c.id == m.collection_id)
                                    .where(m.doc_id.in_(part)).order_by(*_COLLECTION_ORDER))
                for doc_id, cid in rows:
                    out[doc_id].append(cid)
        return out

    def added_at(self, collection_id: str, doc_ids: Iterable[str]) -> dict[str, float]:
        """When each of ``doc_ids`` that is in the collection was put in it."""
        m = collection_documents.c
        out: dict[str, float] = {}
        with self._engine.connect() as conn:
            for part in _batches(list(dict.fromkeys(doc_ids))):
                rows = conn.execute(sa.select(m.doc_id, m.added_at)
                                    .where(m.collection_id == collection_id, m.doc_id.in_(part)))
                out.update({str(d): float(t) for d, t in rows})
        return out

    def touch_collections(self, collection_ids: Iterable[str], at: float) -> None:
        """Set ``last_active_at`` (not the version: nothing the indexes or prompts read changed)."""
        with self._engine.begin() as conn:
            conn.execute(collections.update().where(collections.c.id.in_(list(collection_ids)))
                         .values(last_active_at=at))

    # --- stored responses -----------------------------------------------------------------------

    def insert_response(self, response_id: str, tenant: str, previous_id: str | None, created_at: float,
                        body: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(responses.insert().values(id=response_id, tenant=tenant, previous_id=previous_id,
                                                   created_at=created_at, body=body))

    def response(self, response_id: str) -> tuple[str, str | None, str] | None:
        """(tenant, previous id, body) of a stored response, or None."""
        r = responses.c
        with self._engine.connect() as conn:
            row = conn.execute(sa.select(r.tenant, r.previous_id, r.body).where(r.id == response_id)).first()
        return None if row is None else (str(row[0]), row[1], str(row[2]))

    def delete_response(self, response_id: str) -> bool:
        with self._engine.begin() as conn:
            return bool(conn.execute(responses.delete().where(responses.c.id == response_id)).rowcount)

    # --- file batches ---------------------------------------------------------------------------

    def insert_batch(self, batch_id: str, collection_id: str, doc_ids: Iterable[str], created_at: float,
                     added: Collection[str] = ()) -> None:
        """A batch of documents in the collection; ``added``: those the batch put in it (a cancel may take only
        those out: one there before stays)."""
        with self._engine.begin() as conn:
            conn.execute(file_batches.insert().values(id=batch_id, collection_id=collection_id,
                                                      created_at=created_at))
            conn.execute(file_batch_documents.insert(), [{"batch_id": batch_id, "doc_id": d, "added": d in added}
                                                         for d in dict.fromkeys(doc_ids)])

    def batch(self, batch_id: str) -> FileBatchRecord | None:
        """The batch and its documents (those a cancel took out apart), or None."""
        b, d = file_batches.c, file_batch_documents.c
        with self._engine.connect() as conn:
            row = conn.execute(file_batches.select().where(b.id == batch_id)).first()
            if row is None:
                return None
            docs = conn.execute(sa.select(d.doc_id, d.cancelled, d.added).where(d.batch_id == batch_id)
                                .order_by(d.doc_id)).all()
        return FileBatchRecord(row.id, row.collection_id, row.created_at, row.cancelled_at,
                               tuple(str(r[0]) for r in docs if not r[1]), tuple(str(r[0]) for r in docs if r[1]),
                               tuple(str(r[0]) for r in docs if r[2] and not r[1]))

    def cancelled(self, collection_id: str) -> builtins.list[str]:
        """Documents a cancel of one of the collection's batches took out of it (and not put back since)."""
        b, d, m = file_batches.c, file_batch_documents.c, collection_documents.c
        member = sa.exists().where(m.collection_id == collection_id, m.doc_id == d.doc_id)
        query = (sa.select(d.doc_id).join(file_batches, b.id == d.batch_id)
                 .where(b.collection_id == collection_id, d.cancelled, ~member).distinct())
        with self._engine.connect() as conn:
            return sorted(str(r[0]) for r in conn.execute(query))

    def cancel_batch(self, batch_id: str, doc_ids: Iterable[str], at: float) -> None:
        """Mark the batch cancelled and ``doc_ids`` (its documents not indexed yet) taken out of its collection,
        in one transaction."""
        ids = list(dict.fromkeys(doc_ids))
        b, d = file_batches.c, file_batch_documents.c
        with self._engine.begin() as conn:
            collection_id = conn.execute(sa.select(b.collection_id).where(b.id == batch_id)).scalar()
            conn.execute(file_batches.update().where(b.id == batch_id).values(cancelled_at=at))
            if ids and collection_id is not None:
                conn.execute(file_batch_documents.update().where(d.batch_id == batch_id, d.doc_id.in_(ids))
                             .values(cancelled=True))
                conn.execute(collection_documents.delete().where(
                    collection_documents.c.collection_id == collection_id, collection_documents.c.doc_id.in_(ids)))
                _bump(conn, [collection_id])

    def versions(self, collection_ids: Iterable[str]) -> dict[str, int]:
        """Each existing collection's version."""
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(collections.c.id, collections.c.version)
                                .where(collections.c.id.in_(list(collection_ids))))
            return {str(r[0]): int(r[1]) for r in rows}

    def members(
        self, collection_ids: Iterable[str], *, where: Filter | None = None,
        statuses: Iterable[DocumentStatus] | None = None, limit: int | None = None, after: str | None = None,
        newest_first: bool = False,
    ) -> builtins.list[DocumentRecord]:
        """Documents in any of ``collection_ids`` matching ``where`` (with one of ``statuses``), once each, oldest
        first (the canonical order of a collection's documents; or newest first), from the one after ``after`` (an
        id)."""
        query = documents.select().where(_membership(collection_ids, where, statuses)) \
            .order_by(*_ordered(_ORDER, newest_first))
        with self._engine.connect() as conn:
            if after is not None:
                query = query.where(_after(conn, documents, after, newest_first))
            if limit is not None:
                query = query.limit(limit)
            return [_record(r) for r in conn.execute(query)]

    def member_stamps(self, collection_ids: Iterable[str], *, where: Filter | None = None) -> dict[str, float]:
        """Ready members matching ``where``: id -> ``updated_at`` (which changes when a document is re-indexed)."""
        query = (sa.select(documents.c.id, documents.c.updated_at)
                 .where(_membership(collection_ids, where, ["ready"])).order_by(*_ORDER))
        with self._engine.connect() as conn:
            return {str(r[0]): float(r[1]) for r in conn.execute(query)}

    def member_counts(self, collection_ids: Iterable[str], *, where: Filter | None = None) -> MemberCounts:
        """Members matching ``where`` by status, with their chunks, tokens and bytes (and the ready ones' tokens)."""
        d = documents.c
        query = (sa.select(d.status, sa.func.count(), sa.func.coalesce(sa.func.sum(d.n_chunks), 0),
                           sa.func.coalesce(sa.func.sum(d.n_tokens), 0), sa.func.coalesce(sa.func.sum(d.size), 0))
                 .where(_membership(collection_ids, where, None)).group_by(d.status))
        by_status: dict[str, int] = {}
        chunks = tokens = size = ready_tokens = 0
        with self._engine.connect() as conn:
            for status, n, c, t, b in conn.execute(query):
                by_status[str(status)] = int(n)
                chunks, tokens, size = chunks + int(c), tokens + int(t), size + int(b)
                if status == "ready":
                    ready_tokens = int(t)
        return MemberCounts(by_status, chunks, tokens, size, ready_tokens)

    # --- ingestion jobs -------------------------------------------------------------------------

    def add_job(self, doc_id: str) -> None:
        """An unclaimed job for the document, unless it has one already (claimed or not)."""
        with self._engine.begin() as conn:
            if conn.execute(sa.select(ingest_jobs.c.doc_id).where(ingest_jobs.c.doc_id == doc_id)).first() is None:
                conn.execute(ingest_jobs.insert().values(doc_id=doc_id, created_at=time.time()))

    def add_missing_jobs(self) -> builtins.list[str]:
        """Jobs for queued / indexing documents that have none (queued before jobs existed); their ids. Another
        process adding the same one at once is no error."""
        waiting = (sa.select(documents.c.id).where(documents.c.status.in_(["queued", "indexing"]))
                   .where(~sa.exists().where(ingest_jobs.c.doc_id == documents.c.id)))
        with self._engine.connect() as conn:
            ids = [str(r[0]) for r in conn.execute(waiting)]
        for doc_id in ids:
            try:
                self.add_job(doc_id)
            except sa.exc.IntegrityError:
                continue
        return ids

    def claim(self, owner: str, lease_s: float, max_attempts: int, doc_id: str | None = None,
              gave_up: str = "") -> Claim | str | None:
        """Take the oldest job (``doc_id``'s only, when given) that nobody holds or whose lease ran out; write
        ``owner`` and a lease of ``lease_s``. Returns the claim; the id of a document whose job has been claimed
        ``max_attempts`` times already (its job deleted and the document failed with ``gave_up``, in one
        transaction); None when there is none. A job whose document is gone or no longer queued / indexing is
        deleted on the way.

        PostgreSQL skips rows other workers are claiming (``FOR UPDATE SKIP LOCKED``); on both backends the update
        only succeeds if the row is still claimable, so two workers never hold one job."""
        while True:
            now = time.time()
            claimable = sa.or_(ingest_jobs.c.owner.is_(None), ingest_jobs.c.lease_until < now)
            query = (sa.select(ingest_jobs.c.doc_id, ingest_jobs.c.attempts, documents.c.status)
                     .join(documents, documents.c.id == ingest_jobs.c.doc_id, isouter=True)
                     .where(claimable).order_by(ingest_jobs.c.created_at, ingest_jobs.c.doc_id).limit(1)
                     .with_for_update(of=ingest_jobs, skip_locked=True))
            if doc_id is not None:
                query = query.where(ingest_jobs.c.doc_id == doc_id)
            with self._engine.begin() as conn:
                row = conn.execute(query).first()
                if row is None:
                    return None
                job = ingest_jobs.c.doc_id == row.doc_id
                if row.status not in ("queued", "indexing"):
                    conn.execute(ingest_jobs.delete().where(job))
                    continue
                if row.attempts >= max_attempts:
                    conn.execute(ingest_jobs.delete().where(job))
                    conn.execute(documents.update().where(documents.c.id == row.doc_id).values(
                        status="failed", progress=0.0, message=gave_up, updated_at=now))
                    return str(row.doc_id)
                taken = conn.execute(ingest_jobs.update().where(job, claimable).values(
                    owner=owner, lease_until=now + lease_s, attempts=row.attempts + 1))
                if taken.rowcount == 1:
                    return Claim(str(row.doc_id), owner, int(row.attempts) + 1)

    def renew(self, claim: Claim, lease_s: float) -> bool:
        """Extend the lease; False when the job is no longer this claim's (taken over after the lease ran out,
        or finished)."""
        with self._engine.begin() as conn:
            result = conn.execute(ingest_jobs.update()
                                  .where(ingest_jobs.c.doc_id == claim.doc_id, ingest_jobs.c.owner == claim.owner)
                                  .values(lease_until=time.time() + lease_s))
        return bool(result.rowcount == 1)

    def finish(self, claim: Claim) -> None:
        """Delete the job (if the claim still holds it)."""
        with self._engine.begin() as conn:
            conn.execute(ingest_jobs.delete()
                         .where(ingest_jobs.c.doc_id == claim.doc_id, ingest_jobs.c.owner == claim.owner))

    def jobs(self) -> builtins.list[tuple[str, str | None, int]]:
        """Every job as (document id, owner, attempts), oldest first."""
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(ingest_jobs.c.doc_id, ingest_jobs.c.owner, ingest_jobs.c.attempts)
                                .order_by(ingest_jobs.c.created_at, ingest_jobs.c.doc_id))
            return [(str(r[0]), r[1], int(r[2])) for r in rows]


def _record(row: sa.Row[Any]) -> DocumentRecord:
    return DocumentRecord(**row._asdict())


def _collection(row: sa.Row[Any]) -> CollectionRecord:
    fields = row._asdict()
    fields["metadata"] = json.loads(fields["metadata"]) if fields["metadata"] else {}
    return CollectionRecord(**fields)


def _collection_row(record: CollectionRecord) -> dict[str, Any]:
    row = {c.name: getattr(record, c.name) for c in collections.columns}
    row["metadata"] = json.dumps(record.metadata or {}, sort_keys=True)
    return row


def _membership(collection_ids: Iterable[str], where: Filter | None,
                statuses: Iterable[DocumentStatus] | None) -> sa.ColumnElement[bool]:
    """A condition on ``documents``: in one of the collections, matching ``where``, with one of ``statuses``."""
    m = collection_documents.c
    member = sa.exists().where(m.doc_id == documents.c.id, m.collection_id.in_(list(collection_ids)))
    parts: builtins.list[sa.ColumnElement[bool]] = [member]
    if where is not None:
        parts.append(to_sql(where, document_attributes, documents.c.id))
    if statuses is not None:
        parts.append(documents.c.status.in_(list(statuses)))
    return sa.and_(*parts)


def _ordered(order: tuple[sa.ColumnElement[Any], ...], newest_first: bool) -> builtins.list[Any]:
    return [c.desc() for c in order] if newest_first else builtins.list(order)


def _after(conn: sa.Connection, table: sa.Table, after: str, newest_first: bool = False) -> sa.ColumnElement[bool]:
    """Rows past ``after`` in (created_at, id) order (or its reverse); an unknown cursor id starts nowhere (no
    rows)."""
    at = conn.execute(sa.select(table.c.created_at).where(table.c.id == after)).scalar()
    if at is None:
        return sa.false()
    if newest_first:
        return sa.or_(table.c.created_at < at, sa.and_(table.c.created_at == at, table.c.id < after))
    return sa.or_(table.c.created_at > at, sa.and_(table.c.created_at == at, table.c.id > after))


def _bump(conn: sa.Connection, collection_ids: builtins.list[str]) -> None:
    conn.execute(collections.update().where(collections.c.id.in_(collection_ids))
                 .values(version=collections.c.version + 1, updated_at=time.time()))


def _bump_collections_of(conn: sa.Connection, doc_id: str) -> None:
    of_doc = sa.select(collection_documents.c.collection_id).where(collection_documents.c.doc_id == doc_id)
    conn.execute(collections.update().where(collections.c.id.in_(of_doc))
                 .values(version=collections.c.version + 1))


def _batches(ids: builtins.list[str], size: int = 500) -> Iterator[builtins.list[str]]:
    for i in range(0, len(ids), size):
        yield ids[i : i + size]
