"""Turn uploaded bytes into plain text: txt, md, html (visible text only) and pdf (text per page).

``parse_document`` is the one entry point. It picks the parser from the bytes (``%PDF``), the file's
extension and the content type, in that order, and refuses empty, binary or undecodable input with a
domain error that says why. Text comes out with ``\\n`` line ends; PDF pages are joined by a blank line and
their character spans are kept so every chunk can tell its page.
"""

from __future__ import annotations

import bisect
import codecs
import io
import logging
import re
from dataclasses import dataclass
from typing import Literal

from retrieval.errors import EmptyDocument, TooManyPages, UnreadableDocument, UnsupportedDocumentType

logger = logging.getLogger(__name__)

DocumentKind = Literal["txt", "md", "html", "pdf"]

# (page_no starting at 1, char_start, char_end) into ParsedDocument.text
PageSpan = tuple[int, int, int]

_EXTENSIONS: dict[str, DocumentKind] = {
    "txt": "txt", "text": "txt", "md": "md", "markdown": "md", "html": "html", "htm": "html",
    "xhtml": "html", "pdf": "pdf",
}
_CONTENT_TYPES: dict[str, DocumentKind] = {
    "text/plain": "txt", "text/markdown": "md", "text/x-markdown": "md", "text/html": "html",
    "application/xhtml+xml": "html", "application/pdf": "pdf", "application/x-pdf": "pdf",
}
# Content types that say nothing about the format: fall back to sniffing.
_NEUTRAL_CONTENT_TYPES = {"", "application/octet-stream", "binary/octet-stream"}

# Unicode category Cc less the ones ordinary text files contain (\t \n \v \f \r).
_CONTROL_RE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")
MAX_CONTROL_RATIO = 0.01  # more control characters than this: binary data
MAX_LEGACY_HIGH_BYTES = 0.10  # invalid UTF-8 is read as cp1252 only when few bytes are non-ASCII


@dataclass(frozen=True)
class ParsedDocument:
    """Plain text of a document; ``pages`` only for PDFs: (page_no, char_start, char_end) per page."""

    text: str
    pages: list[PageSpan] | None
    kind: DocumentKind
    title: str | None = None


def parse_document(
    data: bytes, filename: str | None = None, content_type: str | None = None, *, max_pages: int | None = None
) -> ParsedDocument:
    """Parse an upload into text. Raises EmptyDocument, UnreadableDocument, UnsupportedDocumentType, or
    TooManyPages for a PDF of more than ``max_pages`` pages (counted before any page's text is read)."""
    if not data:
        raise EmptyDocument("the file is empty (0 bytes)")
    kind = detect_kind(data, filename, content_type)
    if kind == "pdf":
        parsed = _parse_pdf(data, max_pages)
    else:
        text = decode_text(data, _charset(content_type))
        if kind == "html":
            parsed = _parse_html(text)
        else:
            title = _markdown_title(text) if kind == "md" else None
            parsed = ParsedDocument(text=text, pages=None, kind=kind, title=title)
    if not parsed.text.strip():
        raise EmptyDocument(_empty_reason(kind))
    return parsed


def detect_kind(data: bytes, filename: str | None, content_type: str | None) -> DocumentKind:
    """The parser to use: PDF magic bytes win, then a known extension, then a known content type."""
    if data.lstrip(b"\xef\xbb\xbf \t\r\n")[:5] == b"%PDF-":
        return "pdf"
    ext = filename.rsplit(".", 1)[-1].lower() if filename and "." in filename else ""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    kind: DocumentKind | None = _EXTENSIONS.get(ext) or _CONTENT_TYPES.get(mime)
    if kind == "pdf":
        raise UnreadableDocument("not a PDF file (the %PDF header is missing)")
    if kind is not None:
        return kind
    if ext or mime not in _NEUTRAL_CONTENT_TYPES:
        raise UnsupportedDocumentType(filename, content_type)
    head = data[:1024].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "html"
    return "txt"


def decode_text(data: bytes, charset: str | None = None) -> str:
    """Bytes to text with ``\\n`` line ends; refuses binary data and undecodable bytes."""
    text: str
    if data.startswith(codecs.BOM_UTF8):
        text = _decode(data[len(codecs.BOM_UTF8):], "utf-8")
    elif data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        text = _decode(data, "utf-16")
    elif b"\x00" in data:
        raise UnreadableDocument("the file contains NUL bytes: binary data, not text")
    elif charset:
        try:
            info = codecs.lookup(charset)
        except LookupError:
            raise UnreadableDocument(f"unknown charset {charset!r}") from None
        if not getattr(info, "_is_text_encoding", True):  # rot13, base64, zlib_codec...: transforms, not charsets
            raise UnreadableDocument(f"charset {charset!r} is not a text encoding")
        text = _decode(data, charset)
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            text = _legacy_fallback(data, exc)
    if "\x00" in text:
        raise UnreadableDocument("the text contains NUL characters: binary data, not text")
    controls = len(_CONTROL_RE.findall(text))
    if controls > MAX_CONTROL_RATIO * len(text):
        raise UnreadableDocument(
            f"{controls} of {len(text)} characters are control characters: binary data, not text"
        )
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if controls:
        text = _CONTROL_RE.sub("", text)
    return text


def _decode(data: bytes, encoding: str) -> str:
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise UnreadableDocument(f"the bytes are not valid {encoding} (at byte {exc.start})") from None


def _legacy_fallback(data: bytes, exc: UnicodeDecodeError) -> str:
    """Read mostly-ASCII text with a few stray high bytes as Windows-1252; refuse anything else."""
    high = sum(1 for b in data if b >= 0x80)
    if high <= MAX_LEGACY_HIGH_BYTES * len(data):
        try:
            text = data.decode("cp1252")
        except UnicodeDecodeError:
            pass
        else:
            logger.info("document is not UTF-8; read as Windows-1252 (%d non-ASCII bytes)", high)
            return text
    raise UnreadableDocument(
        f"the bytes are not valid UTF-8 (at byte {exc.start}) and do not look like text in another encoding"
    )


def _charset(content_type: str | None) -> str | None:
    if not content_type:
        return None
    match = re.search(r"charset\s*=\s*\"?([\w.:-]+)", content_type, flags=re.IGNORECASE)
    return match.group(1) if match else None


def _empty_reason(kind: DocumentKind) -> str:
    if kind == "pdf":
        return "the PDF has no extractable text (a scanned image? text recognition is not supported)"
    if kind == "html":
        return "the HTML page has no visible text"
    return "the document holds only whitespace"


def _markdown_title(text: str) -> str | None:
    match = re.search(r"^#\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE)
    return match.group(1) if match else None


# --- HTML -------------------------------------------------------------------------------------------

_HTML_DROP = {"script", "style", "head", "noscript", "template", "svg", "iframe", "object", "canvas"}
# Elements after which a paragraph break (blank line) follows, and those after which a line break follows.
_HTML_PARAGRAPH = {
    "p", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "table", "ul", "ol", "dl", "section",
    "article", "header", "footer", "nav", "aside", "main", "figure", "hr", "address", "details", "form",
}
_HTML_LINE = {"div", "li", "tr", "br", "dt", "dd", "caption", "figcaption", "summary", "legend", "option"}
_HTML_CELL = {"td", "th"}
_PARA = "\x00P"  # markers while walking; NUL cannot come from decoded text (refused above)
_LINE = "\x00L"
# Spaces and tabs inside <pre> survive the whitespace clean-up as \x01 / \x02 (control characters were
# removed from the decoded text, so these cannot clash).
_PRE_PROTECT = str.maketrans({" ": "\x01", "\t": "\x02"})
_PRE_RESTORE = str.maketrans({"\x01": " ", "\x02": "\t"})


def _parse_html(markup: str) -> ParsedDocument:
    from bs4 import BeautifulSoup
    from bs4.element import NavigableString, Tag

    soup = BeautifulSoup(markup, "html.parser")
    title_tag = soup.find("title")
    title = title_tag.get_text(" ", strip=True) if isinstance(title_tag, Tag) else None
    parts: list[str] = []

    def walk(node: Tag, in_pre: bool) -> None:
        for child in node.children:
            if isinstance(child, NavigableString):
                # Comment, CData, Doctype, ... are NavigableString subclasses: not visible text.
                if type(child) is NavigableString:
                    text = str(child)
                    parts.append(text.translate(_PRE_PROTECT) if in_pre else re.sub(r"\s+", " ", text))
                continue
            if not isinstance(child, Tag):
                continue
            name = child.name.lower()
            if name in _HTML_DROP:
                continue
            if name == "br":
                parts.append(_LINE)
                continue
            before = _PARA if name in _HTML_PARAGRAPH else _LINE if name in _HTML_LINE else ""
            parts.append(before)
            walk(child, in_pre or name == "pre")
            if name in _HTML_CELL:
                parts.append("\t")
            parts.append(before)

    try:
        walk(soup, in_pre=False)
    except RecursionError:
        raise UnreadableDocument("the HTML is nested too deeply to read") from None
    text = _join_html_parts(parts)
    return ParsedDocument(text=text, pages=None, kind="html", title=title or None)


def _join_html_parts(parts: list[str]) -> str:
    raw = "".join(parts)
    # A run of markers becomes one break: a paragraph break if any marker in the run asks for one.
    def breaks(match: re.Match[str]) -> str:
        return "\n\n" if _PARA in match.group(0) else "\n"

    raw = re.sub(r"[ \t]*(?:\x00[PL][ \t]*)+", breaks, raw)
    lines = [line.rstrip(" \t") for line in raw.split("\n")]
    text = "\n".join(line.lstrip(" ") for line in lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n ").translate(_PRE_RESTORE)


# --- PDF --------------------------------------------------------------------------------------------

PAGE_SEPARATOR = "\n\n"


def _parse_pdf(data: bytes, max_pages: int | None = None) -> ParsedDocument:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")
            except Exception as exc:  # pypdf raises several types (missing crypto backend, ...)
                raise UnreadableDocument(f"the PDF is encrypted and cannot be opened ({exc})") from None
            if not opened:
                raise UnreadableDocument("the PDF is password protected")
        n_pages = len(reader.pages)  # walks the page tree only; no page content is parsed
        if max_pages is not None and n_pages > max_pages:
            raise TooManyPages(n_pages, max_pages)
        page_texts = [_clean_pdf_text(page.extract_text() or "") for page in reader.pages]
        title = None
        if reader.metadata is not None and reader.metadata.title:
            title = str(reader.metadata.title).strip() or None
    except (UnreadableDocument, TooManyPages):
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as exc:
        raise UnreadableDocument(f"corrupt or unsupported PDF ({type(exc).__name__}: {exc})") from None
    if not page_texts:
        raise EmptyDocument("the PDF has no pages")
    pieces: list[str] = []
    pages: list[PageSpan] = []
    pos = 0
    for page_no, page_text in enumerate(page_texts, start=1):
        if page_no > 1:
            pieces.append(PAGE_SEPARATOR)
            pos += len(PAGE_SEPARATOR)
        pieces.append(page_text)
        pages.append((page_no, pos, pos + len(page_text)))
        pos += len(page_text)
    return ParsedDocument(text="".join(pieces), pages=pages, kind="pdf", title=title)


def _clean_pdf_text(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL_RE.sub("", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def page_of(pages: list[PageSpan] | None, char_pos: int) -> int | None:
    """The page holding character ``char_pos`` (a page separator belongs to the page before it)."""
    if not pages:
        return None
    i = bisect.bisect_right([start for _no, start, _end in pages], char_pos) - 1
    return pages[max(i, 0)][0]
