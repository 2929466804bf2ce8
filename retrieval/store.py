"""Document store: files under a root directory, metadata in SQLite.

Layout::

    root/store.sqlite3                 metadata (one row per document)
    root/tmp/                          work dirs; whatever is left here after a crash is deleted by recover()
    root/docs/<id>/source/             original file + extracted text (+ pages.json for PDFs)
    root/docs/<id>/derived/            chunks.jsonl, tokens.npy (target token ids), passages.npy (the
                                       indexed windows: chunk id, start, end), index/ (FAISS over the
                                       windows + sidecar), lexical.npz (BM25 postings of the chunks)

Every write is built in a fresh dir under ``tmp/`` and moved into place with one ``os.rename``; the
SQLite row is written after the files. So a crash leaves either nothing, or a complete ``source/`` (a
queued / failed document), or a complete ``derived/`` (a ready document). ``recover()`` at start-up
deletes ``tmp/`` leftovers and document dirs without a row, and marks documents that were queued or
indexing as failed ("interrupted by restart").

Thread-safe: one lock guards SQLite and the renames; the slow part of ingestion (tokenize, embed,
index) runs outside it, so reads go on while a background thread ingests.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from retrieval.chunking import Chunk, Tokenizer, chunk_text, passage_spans, tokenize
from retrieval.embedding import DEFAULT_BATCH_SIZE, Embedder
from retrieval.errors import DocumentNotFound, DocumentNotReady, EmptyDocument, RetrievalError
from retrieval.index import IndexConfig, VectorIndex
from retrieval.lexical import LEXICAL_FILE, LexicalIndex
from retrieval.parsing import DocumentKind, PageSpan, parse_document

logger = logging.getLogger(__name__)

DocumentStatus = Literal["queued", "indexing", "ready", "failed"]
DEFAULT_TENANT = "default"
INTERRUPTED = "interrupted by restart"
PASSAGES_FILE = "passages.npy"

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
_EXTENSIONS = {"txt": ".txt", "md": ".md", "html": ".html", "pdf": ".pdf"}


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


@dataclass(frozen=True)
class RecoveryReport:
    removed_temp: int
    removed_orphans: int
    failed: list[str]


class DocumentStore:
    """Documents of all tenants under ``root``. ``tenant=None`` in a read means "any tenant"."""

    def __init__(self, root: Path, *, index_config: IndexConfig | None = None) -> None:
        self.root = Path(root)
        self.index_config = index_config or IndexConfig()
        self._docs = self.root / "docs"
        self._tmp = self.root / "tmp"
        self._docs.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.root / "store.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- start-up -------------------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Clean up after a crash: delete temp leftovers and row-less document dirs; documents that
        were queued or indexing become failed with message "interrupted by restart"."""
        with self._lock:
            removed_temp = 0
            for entry in self._tmp.iterdir():
                _remove(entry)
                removed_temp += 1
            ids = {row[0] for row in self._db.execute("SELECT id FROM documents")}
            removed_orphans = 0
            for entry in self._docs.iterdir():
                if entry.name not in ids:
                    _remove(entry)
                    removed_orphans += 1
            failed = [row[0] for row in self._db.execute(
                "SELECT id FROM documents WHERE status IN ('queued', 'indexing') ORDER BY created_at")]
            for doc_id in failed:
                self._update(doc_id, status="failed", message=INTERRUPTED, progress=0.0)
            for (doc_id,) in self._db.execute("SELECT id FROM documents WHERE status = 'ready'").fetchall():
                if not (self._derived_dir(doc_id) / "index").is_dir():
                    self._update(doc_id, status="failed", message="index files are missing; re-index it")
                    failed.append(doc_id)
        if removed_temp or removed_orphans or failed:
            logger.warning("recovered store %s: %d temp dirs and %d orphan dirs removed, %d documents failed",
                           self.root, removed_temp, removed_orphans, len(failed))
        return RecoveryReport(removed_temp=removed_temp, removed_orphans=removed_orphans, failed=failed)

    # --- documents ------------------------------------------------------------------------------

    def create(
        self,
        tenant: str | None,
        title: str | None,
        filename: str | None,
        content_type: str | None,
        data: bytes,
    ) -> DocumentRecord:
        """Parse and store an upload (status ``queued``). Bad input raises before anything is stored."""
        parsed = parse_document(data, filename, content_type)
        doc_id = uuid.uuid4().hex
        work = self._work_dir(doc_id)
        try:
            source = work / "source"
            source.mkdir()
            (source / ("original" + _EXTENSIONS[parsed.kind])).write_bytes(data)
            _write_text(source / "text.txt", parsed.text)
            if parsed.pages is not None:
                _write_text(source / "pages.json", json.dumps(parsed.pages))
            _fsync_tree(work)
            with self._lock:
                os.rename(work, self._doc_dir(doc_id))
                now = time.time()
                record = DocumentRecord(
                    id=doc_id, tenant=tenant or DEFAULT_TENANT,
                    title=(title or parsed.title or filename or "untitled").strip()[:500] or "untitled",
                    filename=filename, content_type=content_type, kind=parsed.kind, size=len(data),
                    status="queued", progress=0.0, message=None, n_chunks=0, n_tokens=0, embedder=None,
                    created_at=now, updated_at=now,
                )
                try:
                    self._db.execute(
                        f"INSERT INTO documents ({_SELECT}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                        [getattr(record, c) for c in _COLUMNS],
                    )
                except BaseException:
                    _remove(self._doc_dir(doc_id))
                    raise
        finally:
            _remove(work)
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
    ) -> DocumentRecord:
        """Tokenize (once), chunk, embed and index a stored document; status indexing -> ready.

        On any error the document becomes ``failed`` with the error as message, no partial files stay
        behind, and the error is raised again. Re-ingesting a ready document replaces its index.
        """
        self._update(doc_id, status="indexing", progress=0.0, message=None)
        reporter = _ProgressReporter(self, doc_id, progress)
        work = self._work_dir(doc_id)
        try:
            text = self.load_text(doc_id)
            pages = self._load_pages(doc_id)
            tokens = tokenize(text, tokenizer)
            chunks = chunk_text(text, tokenizer, chunk_tokens, overlap, pages, tokens=tokens)
            if not chunks:
                raise EmptyDocument("the document has no tokens to index")
            passages = np.array([(c.id, a, b) for c in chunks for a, b in passage_spans(c)], dtype=np.int64)
            lexical = LexicalIndex.build([c.text for c in chunks])
            reporter(0.05)
            vectors = embedder.encode(
                [text[a:b] for _, a, b in passages], batch_size=batch_size,
                progress=lambda done, total: reporter(0.05 + 0.9 * done / max(total, 1)),
            )
            index = VectorIndex.build(vectors, embedder_name=embedder.name, config=self.index_config)
            derived = work / "derived"
            derived.mkdir()
            with (derived / "chunks.jsonl").open("w", encoding="utf-8") as f:
                for c in chunks:
                    f.write(json.dumps({"id": c.id, "start": c.start, "end": c.end, "n_tokens": c.n_tokens,
                                        "page": c.page, "text": c.text}, ensure_ascii=False) + "\n")
            np.save(derived / "tokens.npy", tokens.ids)
            np.save(derived / PASSAGES_FILE, passages)
            lexical.save(derived)
            index.save(derived / "index")
            _fsync_tree(work)
            with self._lock:
                self.get(doc_id)  # deleted meanwhile -> DocumentNotFound, work dir is dropped
                self._swap_in(work / "derived", self._derived_dir(doc_id))
                record = self._update(doc_id, status="ready", progress=1.0, message=None,
                                      n_chunks=len(chunks), n_tokens=len(tokens), embedder=embedder.name)
        except BaseException as exc:
            _remove(work)
            with self._lock:
                if self._row(doc_id) is not None:
                    self._update(doc_id, status="failed", progress=0.0, message=_describe(exc))
            logger.warning("ingest of %s failed: %s", doc_id, _describe(exc))
            raise
        finally:
            _remove(work)
        if progress is not None:
            progress(1.0)
        logger.info("indexed document %s: %d chunks, %d tokens", doc_id, len(chunks), len(tokens))
        return record

    def get(self, doc_id: str, tenant: str | None = None) -> DocumentRecord:
        """The record; unknown id, or another tenant's document, raises DocumentNotFound."""
        record = self._row(doc_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            raise DocumentNotFound(doc_id)
        return record

    def list(self, tenant: str | None = None) -> list[DocumentRecord]:
        """Documents of ``tenant`` (all when None), oldest first."""
        with self._lock:
            if tenant is None:
                rows = self._db.execute(f"SELECT {_SELECT} FROM documents ORDER BY created_at, id")
            else:
                rows = self._db.execute(
                    f"SELECT {_SELECT} FROM documents WHERE tenant = ? ORDER BY created_at, id",
                    (tenant,),
                )
            return [_record(r) for r in rows.fetchall()]

    def delete(self, doc_id: str, tenant: str | None = None) -> None:
        """Remove the document's row and files (an ingest running for it then discards its work)."""
        with self._lock:
            self.get(doc_id, tenant)
            self._db.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
            doc_dir = self._doc_dir(doc_id)
            trash = self._work_dir(doc_id, create=False)
            if doc_dir.exists():
                os.rename(doc_dir, trash)
        _remove(trash)
        logger.info("deleted document %s", doc_id)

    def stale(self, embedder: Embedder) -> builtins.list[DocumentRecord]:
        """Ready documents indexed with another embedder than ``embedder``, or before passages and the
        lexical index existed: they need re-indexing."""
        return [r for r in self.list() if r.status == "ready" and (r.embedder != embedder.name or not all(
            (self._derived_dir(r.id) / name).exists() for name in (PASSAGES_FILE, LEXICAL_FILE)))]

    # --- loading --------------------------------------------------------------------------------

    def load_text(self, doc_id: str) -> str:
        """The extracted text (any status)."""
        self.get(doc_id)
        try:
            return (self._doc_dir(doc_id) / "source" / "text.txt").read_text(encoding="utf-8")
        except FileNotFoundError:  # deleted meanwhile
            raise DocumentNotFound(doc_id) from None

    def load_chunks(self, doc_id: str) -> builtins.list[Chunk]:
        with self._read_derived(doc_id) as derived, (derived / "chunks.jsonl").open(encoding="utf-8") as f:
            return [Chunk(**json.loads(line)) for line in f if line.strip()]

    def load_token_ids(self, doc_id: str) -> np.ndarray:
        """The whole text's target token ids [n] int32 (no special tokens)."""
        with self._read_derived(doc_id) as derived:
            return np.load(derived / "tokens.npy")

    def load_index(self, doc_id: str, embedder: Embedder) -> VectorIndex:
        """The document's index; built with another embedder -> EmbedderMismatch."""
        with self._read_derived(doc_id) as derived:
            return VectorIndex.load(derived / "index", embedder_name=embedder.name, dim=embedder.dim,
                                    config=self.index_config, doc_id=doc_id)

    def load_passages(self, doc_id: str) -> np.ndarray | None:
        """The indexed windows [n, 3] (chunk id, start, end), by vector id; None for a document indexed
        before windows (its vectors are its chunks)."""
        with self._read_derived(doc_id) as derived:
            path = derived / PASSAGES_FILE
            return np.load(path, allow_pickle=False) if path.exists() else None

    def load_lexical(self, doc_id: str) -> LexicalIndex | None:
        """The document's BM25 postings; None for a document indexed before them."""
        with self._read_derived(doc_id) as derived:
            return LexicalIndex.load(derived) if (derived / LEXICAL_FILE).exists() else None

    @contextmanager
    def _read_derived(self, doc_id: str) -> Iterator[Path]:
        with self._lock:  # no swap or delete while reading
            record = self.get(doc_id)
            derived = self._derived_dir(doc_id)
            if record.status != "ready" or not derived.is_dir():
                raise DocumentNotReady(doc_id, record.status, record.message)
            yield derived

    def _load_pages(self, doc_id: str) -> builtins.list[PageSpan] | None:
        path = self._doc_dir(doc_id) / "source" / "pages.json"
        if not path.exists():
            return None
        return [(int(a), int(b), int(c)) for a, b, c in json.loads(path.read_text(encoding="utf-8"))]

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
            _remove(old)

    def _row(self, doc_id: str) -> DocumentRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_SELECT} FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return _record(row) if row else None

    def _update(self, doc_id: str, **fields: Any) -> DocumentRecord:
        fields["updated_at"] = time.time()
        with self._lock:
            cur = self._db.execute(
                f"UPDATE documents SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                [*fields.values(), doc_id],
            )
            if cur.rowcount == 0:
                raise DocumentNotFound(doc_id)
            return self.get(doc_id)


class _ProgressReporter:
    """Forwards progress to the caller and, at most every 2 %, to the SQLite row."""

    def __init__(self, store: DocumentStore, doc_id: str, callback: Callable[[float], None] | None) -> None:
        self.store = store
        self.doc_id = doc_id
        self.callback = callback
        self.last = 0.0

    def __call__(self, fraction: float) -> None:
        if fraction - self.last >= 0.02:
            self.last = fraction
            self.store._update(self.doc_id, progress=round(fraction, 4))
        if self.callback is not None:
            self.callback(fraction)


def _record(row: tuple[Any, ...]) -> DocumentRecord:
    return DocumentRecord(**dict(zip(_COLUMNS, row, strict=True)))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RetrievalError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write(text)


def _fsync_tree(root: Path) -> None:
    """Flush files to disk before the rename that publishes them."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
