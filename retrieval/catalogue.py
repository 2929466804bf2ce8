"""The document store's catalogue: one SQLite row of metadata per document (``DocumentRecord``).

Only ``DocumentStore`` uses it, under its own lock (the catalogue itself takes none): the store keeps the
rows and the document dirs consistent with each other.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from retrieval.errors import DocumentNotFound
from retrieval.parsing import DocumentKind

DocumentStatus = Literal["queued", "indexing", "ready", "failed"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    title TEXT NOT NULL,
    filename TEXT,
    content_type TEXT,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    status TEXT NOT NULL,
    progress REAL NOT NULL DEFAULT 0,
    message TEXT,
    n_chunks INTEGER NOT NULL DEFAULT 0,
    n_tokens INTEGER NOT NULL DEFAULT 0,
    embedder TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS documents_tenant ON documents (tenant, created_at);
"""
_COLUMNS = ("id", "tenant", "title", "filename", "content_type", "kind", "size", "status", "progress",
            "message", "n_chunks", "n_tokens", "embedder", "created_at", "updated_at")
_SELECT = ", ".join(_COLUMNS)


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


class Catalogue:
    """The ``documents`` table of ``path`` (WAL journal; autocommit: every statement is its own commit)."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def insert(self, record: DocumentRecord) -> None:
        self._db.execute(
            f"INSERT INTO documents ({_SELECT}) VALUES ({', '.join('?' * len(_COLUMNS))})",
            [getattr(record, c) for c in _COLUMNS],
        )

    def row(self, doc_id: str) -> DocumentRecord | None:
        row = self._db.execute(f"SELECT {_SELECT} FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return _record(row) if row else None

    def ids(self, statuses: Iterable[DocumentStatus] | None = None) -> list[str]:
        """Ids (with one of ``statuses``, all when None), oldest first."""
        if statuses is None:
            rows = self._db.execute("SELECT id FROM documents ORDER BY created_at, id")
        else:
            wanted = list(statuses)
            rows = self._db.execute(
                f"SELECT id FROM documents WHERE status IN ({', '.join('?' * len(wanted))}) "
                "ORDER BY created_at, id",
                wanted,
            )
        return [r[0] for r in rows.fetchall()]

    def list(self, tenant: str | None) -> list[DocumentRecord]:
        """Rows of ``tenant`` (all when None), oldest first."""
        if tenant is None:
            rows = self._db.execute(f"SELECT {_SELECT} FROM documents ORDER BY created_at, id")
        else:
            rows = self._db.execute(
                f"SELECT {_SELECT} FROM documents WHERE tenant = ? ORDER BY created_at, id", (tenant,)
            )
        return [_record(r) for r in rows.fetchall()]

    def update(self, doc_id: str, **fields: Any) -> None:
        """Set ``fields`` (and ``updated_at``); DocumentNotFound when there is no such row."""
        fields["updated_at"] = time.time()
        cur = self._db.execute(
            f"UPDATE documents SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
            [*fields.values(), doc_id],
        )
        if cur.rowcount == 0:
            raise DocumentNotFound(doc_id)

    def delete(self, doc_id: str) -> None:
        self._db.execute("DELETE FROM documents WHERE id = ?", (doc_id,))


def _record(row: tuple[Any, ...]) -> DocumentRecord:
    return DocumentRecord(**dict(zip(_COLUMNS, row, strict=True)))
