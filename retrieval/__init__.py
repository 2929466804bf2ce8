"""Retrieval for ragspec: parse, chunk, embed, index, store and retrieve documents (RAPID's RAG side).

Never imports ``app`` or ``decoding``; never reads environment variables or settings.
"""

from retrieval.chunking import Chunk, TokenizedText, chunk_text, tokenize
from retrieval.embedding import (
    BgeM3Embedder,
    Embedder,
    FlagEmbedder,
    bundled_embedder_path,
    load_embedder,
)
from retrieval.errors import (
    DocumentNotFound,
    DocumentNotReady,
    EmbedderMismatch,
    EmbedderUnavailable,
    EmptyDocument,
    RetrievalError,
    UnreadableDocument,
    UnsupportedDocumentType,
)
from retrieval.index import IndexConfig, VectorIndex
from retrieval.parsing import ParsedDocument, parse_document
from retrieval.retriever import (
    Hit,
    RetrievalResult,
    Retriever,
    default_budget,
    default_threshold,
    pack_hits,
)
from retrieval.store import DocumentRecord, DocumentStore, RecoveryReport

__all__ = [
    "BgeM3Embedder",
    "Chunk",
    "DocumentNotFound",
    "DocumentNotReady",
    "DocumentRecord",
    "DocumentStore",
    "Embedder",
    "EmbedderMismatch",
    "EmbedderUnavailable",
    "EmptyDocument",
    "FlagEmbedder",
    "Hit",
    "IndexConfig",
    "ParsedDocument",
    "RecoveryReport",
    "RetrievalError",
    "RetrievalResult",
    "Retriever",
    "TokenizedText",
    "UnreadableDocument",
    "UnsupportedDocumentType",
    "VectorIndex",
    "bundled_embedder_path",
    "chunk_text",
    "default_budget",
    "default_threshold",
    "load_embedder",
    "pack_hits",
    "parse_document",
    "tokenize",
]
