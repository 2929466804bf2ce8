"""Domain errors of the retrieval package.

Every error a caller can act on derives from :class:`RetrievalError`; the app maps them to HTTP codes.
Messages are written for the person who uploaded or asked, not for a developer.
"""

from __future__ import annotations

REINDEX_COMMAND = "ragspec reindex --all"


class RetrievalError(Exception):
    """Base class of every retrieval domain error."""


class UnsupportedDocumentType(RetrievalError):  # noqa: N818 (domain names)
    """The file's extension / content type is not one we can parse (txt, md, html, pdf)."""

    def __init__(self, filename: str | None, content_type: str | None) -> None:
        self.filename = filename
        self.content_type = content_type
        parts = [f"file {filename!r}" if filename else "", f"type {content_type!r}" if content_type else ""]
        what = ", ".join(p for p in parts if p) or "document without a name or content type"
        super().__init__(f"unsupported document type ({what}): supported are .txt, .md, .html and .pdf")


class EmptyDocument(RetrievalError):  # noqa: N818 (domain names)
    """The upload holds no bytes, or no text could be found in it."""

    def __init__(self, reason: str = "the document is empty") -> None:
        self.reason = reason
        super().__init__(reason)


class UnreadableDocument(RetrievalError):  # noqa: N818 (domain names)
    """The bytes are not what they claim to be: binary data, undecodable text, a corrupt or locked PDF."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cannot read document: {reason}")


class DocumentNotFound(RetrievalError):  # noqa: N818 (domain names)
    """No document with this id (for this tenant)."""

    def __init__(self, doc_id: str) -> None:
        self.doc_id = doc_id
        super().__init__(f"document {doc_id!r} not found")


class DocumentNotReady(RetrievalError):  # noqa: N818 (domain names)
    """The document exists but is not (yet) indexed: queued, indexing or failed."""

    def __init__(self, doc_id: str, status: str, message: str | None = None) -> None:
        self.doc_id = doc_id
        self.status = status
        detail = f": {message}" if message else ""
        super().__init__(f"document {doc_id!r} is not ready (status {status}{detail})")


class EmbedderMismatch(RetrievalError):  # noqa: N818 (domain names)
    """An index was built with another embedder (name or dimension) than the one loaded now."""

    def __init__(self, expected: str, found: str, doc_id: str | None = None) -> None:
        self.expected = expected
        self.found = found
        self.doc_id = doc_id
        where = f"document {doc_id!r} was" if doc_id else "this index was"
        super().__init__(
            f"{where} indexed with embedder {found}, but the loaded embedder is {expected}; "
            f"run `{REINDEX_COMMAND}` to re-index with the current embedder"
        )


class EmbedderUnavailable(RetrievalError):  # noqa: N818 (domain names)
    """The embedding model is not on this machine (we never download at run time)."""

    def __init__(self, name_or_path: str, reason: str) -> None:
        self.name_or_path = name_or_path
        super().__init__(f"embedding model {name_or_path!r} is not available locally: {reason}")


class TooManyPages(RetrievalError):  # noqa: N818 (domain names)
    """A PDF with more pages than the service accepts (counted before any page is parsed)."""

    def __init__(self, pages: int, limit: int) -> None:
        self.pages = pages
        self.limit = limit
        super().__init__(f"the PDF has {pages} pages; at most {limit} are accepted")


class IndexDamaged(RetrievalError):  # noqa: N818 (domain names)
    """A ready document's index files cannot be read (truncated, edited, corrupt): it must be re-indexed.

    The message names the document and the command, never a file path (it goes to the client)."""

    def __init__(self, doc_id: str, what: str, reason: str | None = None) -> None:
        self.doc_id = doc_id
        self.what = what
        detail = f": {reason}" if reason else ""
        super().__init__(
            f"the index of document {doc_id!r} is damaged ({what} cannot be read{detail}); "
            f"run `ragspec reindex {doc_id}` to rebuild it"
        )


class CatalogueUnavailable(RetrievalError):  # noqa: N818 (domain names)
    """The catalogue's database cannot be reached or used (a wrong URL, a server down, no driver): a configuration
    error at start-up, its message naming the database (never its password)."""


class IngestAbandoned(RetrievalError):  # noqa: N818 (domain names)
    """An ingest whose job another worker took over (this one's lease ran out): its work is dropped, the document
    left to the new holder."""


class CollectionNotFound(RetrievalError):  # noqa: N818 (domain names)
    """No collection with this id (for this tenant: another tenant's collection is not found, never shown)."""

    def __init__(self, collection_id: str) -> None:
        self.collection_id = collection_id
        super().__init__(f"collection {collection_id!r} not found")


class ResponseNotFound(RetrievalError):  # noqa: N818 (domain names)
    """No stored response with this id (for this tenant)."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        super().__init__(f"response {response_id!r} not found")


class BatchNotFound(RetrievalError):  # noqa: N818 (domain names)
    """No file batch with this id in this collection."""

    def __init__(self, batch_id: str) -> None:
        self.batch_id = batch_id
        super().__init__(f"file batch {batch_id!r} not found")


class CollectionNotReady(RetrievalError):  # noqa: N818 (domain names)
    """A question over collections none of whose (matching) documents is ready yet."""

    def __init__(self, collection_ids: list[str], pending: int, failed: int, filtered: bool) -> None:
        self.collection_ids = collection_ids
        self.pending = pending
        names = ", ".join(repr(c) for c in collection_ids)
        matching = "matching the filter " if filtered else ""
        why = (f"{pending} still queued or indexing" if pending else
               f"none is queued or indexing{f', {failed} failed' if failed else ''}")
        super().__init__(f"no ready document {matching}in collection {names} ({why})")


class InvalidFilter(RetrievalError):  # noqa: N818 (domain names)
    """An attribute filter with an unknown operator, a malformed compound or a value of the wrong shape; the message
    names the place (``filter.filters[1].value``)."""


class InvalidAttributes(RetrievalError):  # noqa: N818 (domain names)
    """Document attributes out of bounds: too many keys, a key too long, a value that is not a string, a number or
    a boolean."""
