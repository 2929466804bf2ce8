"""The files of one document on disk: what ``DocumentStore`` writes under ``docs/<id>/`` and reads back.

Layout of a document dir::

    source/     original.<ext> (the upload as sent), text.txt (the extracted text), pages.json (PDFs:
                [page_no, char_start, char_end] per page)
    derived/    chunks.jsonl, tokens.npy (target token ids), passages.npy (the indexed windows: chunk id,
                start, end), index/ (FAISS over the windows + sidecar), lexical.npz (BM25 postings)

Writers fill a fresh directory that the store then publishes with one rename. Readers of ``derived/``
turn any unreadable file (truncated, edited, corrupt) into :class:`IndexDamaged`, whose message names the
document and ``ragspec reindex <id>`` but no path: it reaches the client. The path and the low-level
reason are logged here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from retrieval.chunking import Chunk, TokenizedText
from retrieval.embedding import Embedder
from retrieval.errors import (
    DocumentNotFound,
    DocumentNotReady,
    EmbedderMismatch,
    IndexDamaged,
    RetrievalError,
)
from retrieval.index import IndexConfig, VectorIndex
from retrieval.lexical import LEXICAL_FILE, LexicalIndex
from retrieval.parsing import PageSpan, ParsedDocument

logger = logging.getLogger(__name__)

CHUNKS_FILE = "chunks.jsonl"
TOKENS_FILE = "tokens.npy"
PASSAGES_FILE = "passages.npy"
INDEX_DIR = "index"
EXTENSIONS = {"txt": ".txt", "md": ".md", "html": ".html", "pdf": ".pdf"}


# --- writing ----------------------------------------------------------------------------------------


def write_source(source: Path, data: bytes, parsed: ParsedDocument) -> None:
    """The upload, its text and (PDFs) its page spans into ``source`` (created)."""
    source.mkdir()
    (source / ("original" + EXTENSIONS[parsed.kind])).write_bytes(data)
    write_text(source / "text.txt", parsed.text)
    if parsed.pages is not None:
        write_text(source / "pages.json", json.dumps(parsed.pages))


def write_derived(
    derived: Path,
    chunks: Sequence[Chunk],
    tokens: TokenizedText,
    passages: np.ndarray,
    lexical: LexicalIndex,
    index: VectorIndex,
) -> None:
    """Everything retrieval reads of an indexed document into ``derived`` (created)."""
    derived.mkdir()
    with (derived / CHUNKS_FILE).open("w", encoding="utf-8") as f:
        for c in chunks:
            f.write(json.dumps({"id": c.id, "start": c.start, "end": c.end, "n_tokens": c.n_tokens,
                                "page": c.page, "page_end": c.page_end, "text": c.text}, ensure_ascii=False) + "\n")
    np.save(derived / TOKENS_FILE, tokens.ids)
    np.save(derived / PASSAGES_FILE, passages)
    lexical.save(derived)
    index.save(derived / INDEX_DIR)


def write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write(text)


def fsync_tree(root: Path) -> None:
    """Flush files to disk before the rename that publishes them."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


# --- reading ----------------------------------------------------------------------------------------


def read_pages(source: Path) -> list[PageSpan] | None:
    path = source / "pages.json"
    if not path.exists():
        return None
    return [(int(a), int(b), int(c)) for a, b, c in json.loads(path.read_text(encoding="utf-8"))]


def read_chunks(derived: Path, doc_id: str) -> list[Chunk]:
    with readable(doc_id, "its chunk list"), (derived / CHUNKS_FILE).open(encoding="utf-8") as f:
        return [Chunk(**json.loads(line)) for line in f if line.strip()]


def read_token_ids(derived: Path, doc_id: str) -> np.ndarray:
    with readable(doc_id, "its token ids"):
        ids = np.load(derived / TOKENS_FILE, allow_pickle=False)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids of shape {ids.shape} and type {ids.dtype}")
        return ids


def read_index(derived: Path, doc_id: str, embedder: Embedder, config: IndexConfig) -> VectorIndex:
    """The FAISS index; built with another embedder -> EmbedderMismatch (not damage: a re-index fixes it
    with the command that error names)."""
    with readable(doc_id, "its vector index"):
        return VectorIndex.load(derived / INDEX_DIR, embedder_name=embedder.name, dim=embedder.dim,
                                config=config, doc_id=doc_id)


def read_passages(derived: Path, doc_id: str) -> np.ndarray | None:
    path = derived / PASSAGES_FILE
    if not path.exists():
        return None
    with readable(doc_id, "its passage table"):
        passages = np.load(path, allow_pickle=False)
        if passages.ndim != 2 or passages.shape[1] != 3:
            raise ValueError(f"passages of shape {passages.shape}")
        return passages


def read_lexical(derived: Path, doc_id: str) -> LexicalIndex | None:
    if not (derived / LEXICAL_FILE).exists():
        return None
    with readable(doc_id, "its BM25 index"):
        return LexicalIndex.load(derived)


@contextmanager
def readable(doc_id: str, what: str) -> Iterator[None]:
    """Any failure to read a derived file becomes :class:`IndexDamaged` (the domain errors a caller acts on
    otherwise pass through). The low-level reason goes along only when it holds no path."""
    try:
        yield
    except (DocumentNotFound, DocumentNotReady, EmbedderMismatch):
        raise
    except (RetrievalError, OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        logger.warning("document %s: cannot read %s: %s: %s", doc_id, what, type(exc).__name__, exc)
        reason = str(exc)
        raise IndexDamaged(doc_id, what, None if "/" in reason or "\\" in reason else reason) from None
