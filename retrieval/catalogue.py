"""The document store's catalogue: one row of metadata per document (``DocumentRecord``), in SQLite (the embedded
default, a file in the store's directory) or PostgreSQL (a database URL: a catalogue several replicas share).

One data layer for both (SQLAlchemy Core) and one schema history (Alembic, ``retrieval/migrations``): opening a
catalogue brings its schema to the newest revision. A SQLite store made before the migrations existed (its table
there, no revision recorded) is adopted as it is. Only ``DocumentStore`` uses it, under its own lock (the catalogue
itself takes none): the store keeps the rows and the document dirs consistent with each other.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from retrieval.errors import CatalogueUnavailable, DocumentNotFound
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
_COLUMNS = tuple(c.name for c in documents.columns)
_ORDER = (documents.c.created_at, documents.c.id)


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

    def insert(self, record: DocumentRecord, *, job: bool = False) -> None:
        """A new row; with ``job``, its ingestion job too, in the same transaction (never a queued document that
        no worker would ever take)."""
        with self._engine.begin() as conn:
            conn.execute(documents.insert().values({c: getattr(record, c) for c in _COLUMNS}))
            if job:
                conn.execute(ingest_jobs.insert().values(doc_id=record.id, created_at=record.created_at))

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

    def update(self, doc_id: str, **fields: Any) -> None:
        """Set ``fields`` (and ``updated_at``); DocumentNotFound when there is no such row."""
        fields["updated_at"] = time.time()
        with self._engine.begin() as conn:
            result = conn.execute(documents.update().where(documents.c.id == doc_id).values(**fields))
        if result.rowcount == 0:
            raise DocumentNotFound(doc_id)

    def delete(self, doc_id: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(documents.delete().where(documents.c.id == doc_id))
            conn.execute(ingest_jobs.delete().where(ingest_jobs.c.doc_id == doc_id))

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
