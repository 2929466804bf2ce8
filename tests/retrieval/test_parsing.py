from __future__ import annotations

import random

import pytest

from retrieval.errors import EmptyDocument, RetrievalError, UnreadableDocument, UnsupportedDocumentType
from retrieval.parsing import detect_kind, page_of, parse_document
from tests.conftest import make_pdf


def test_txt_keeps_text_and_normalizes_line_ends() -> None:
    doc = parse_document(b"First line\r\nsecond line\r\n\r\nNew paragraph.\rLast", "notes.txt", "text/plain")
    assert doc.kind == "txt"
    assert doc.text == "First line\nsecond line\n\nNew paragraph.\nLast"
    assert doc.pages is None


def test_markdown_kept_as_text_with_title() -> None:
    data = b"# Release notes\n\nSome *emphasis* and a [link](http://x).\n\n## Details\n- item one\n"
    doc = parse_document(data, "README.md", None)
    assert doc.kind == "md"
    assert doc.title == "Release notes"
    assert "Some *emphasis*" in doc.text


def test_html_visible_text_only_with_block_structure() -> None:
    html = b"""<!DOCTYPE html><html><head><title>The Title</title><style>p {color: red}</style>
    <script>var hidden = "secret script";</script></head>
    <body><h1>Heading</h1><p>First   paragraph
    with <b>bold</b> words.</p><p>Second paragraph.</p><!-- a comment -->
    <ul><li>one</li><li>two</li></ul><div>line a<br>line b</div>
    <noscript>enable js</noscript><pre>  keep   spaces</pre></body></html>"""
    doc = parse_document(html, "page.html", "text/html")
    assert doc.kind == "html"
    assert doc.title == "The Title"
    for hidden in ("secret script", "color: red", "a comment", "enable js", "The Title"):
        assert hidden not in doc.text
    assert doc.text.startswith("Heading\n\nFirst paragraph with bold words.\n\nSecond paragraph.\n\n")
    assert "one\ntwo" in doc.text
    assert "line a\nline b" in doc.text
    assert "  keep   spaces" in doc.text


def test_html_sniffed_without_name_or_type() -> None:
    doc = parse_document(b"<html><body><p>Hello</p></body></html>", None, None)
    assert (doc.kind, doc.text) == ("html", "Hello")


def test_pdf_multi_page_keeps_page_spans() -> None:
    pages = ["Alpha page talks about apples.", "Beta page is about bananas.\nSecond line.", "Gamma cherries."]
    doc = parse_document(make_pdf(pages, title="Fruit"), "fruit.pdf", "application/pdf")
    assert doc.kind == "pdf"
    assert doc.title == "Fruit"
    assert doc.pages is not None and [p[0] for p in doc.pages] == [1, 2, 3]
    for (page_no, start, end), word in zip(doc.pages, ["apples", "bananas", "cherries"], strict=True):
        assert word in doc.text[start:end]
        assert page_of(doc.pages, start) == page_no
    assert doc.pages[0][1] == 0 and doc.pages[-1][2] == len(doc.text)


def test_pdf_is_sniffed_whatever_the_name_says() -> None:
    doc = parse_document(make_pdf(["Sniffed by magic bytes."]), "misnamed.txt", "text/plain")
    assert doc.kind == "pdf" and "magic bytes" in doc.text


def test_utf8_bom_utf16_and_declared_charset() -> None:
    assert parse_document("\ufeffcafé".encode(), "a.txt", None).text == "café"
    assert parse_document("naïve text".encode("utf-16"), "a.txt", None).text == "naïve text"
    doc = parse_document("déjà vu".encode("latin-1"), "a.txt", "text/plain; charset=ISO-8859-1")
    assert doc.text == "déjà vu"


def test_legacy_encoding_fallback_for_mostly_ascii_text() -> None:
    data = ("The caf\xe9 serves cr\xe8me br\xfbl\xe9e every day. " * 5).encode("cp1252")
    assert "crème brûlée" in parse_document(data, "menu.txt", None).text


@pytest.mark.parametrize(
    ("data", "filename", "content_type", "error", "words"),
    [
        (b"", "a.txt", None, EmptyDocument, "empty"),
        (b"  \n\t \n", "a.txt", None, EmptyDocument, "whitespace"),
        (b"<html><head><script>x()</script></head><body> </body></html>", "a.html", None, EmptyDocument,
         "visible"),
        (b"text with a \x00 NUL byte", "a.txt", None, UnreadableDocument, "NUL"),
        (bytes(random.Random(0).randrange(256) for _ in range(4096)), "blob.txt", None, UnreadableDocument,
         ""),
        ("ünïcödé ".encode("utf-16-le") * 20, "a.txt", None, UnreadableDocument, "NUL"),
        (b"abc \xc3\x28\xa0\xa1\xfa\xfb" * 50, "a.txt", None, UnreadableDocument, "UTF-8"),
        (b"ok text \x01\x02\x03\x04\x05\x06\x07\x08 and \x1b\x1c\x1d\x1e\x1f more", "a.md", None,
         UnreadableDocument, "control characters"),
        (b"PK\x03\x04 zip data", "report.docx", None, UnsupportedDocumentType, ".pdf"),
        (b"whatever", None, "application/zip", UnsupportedDocumentType, "application/zip"),
        (b"this is not a pdf", "a.pdf", "application/pdf", UnreadableDocument, "%PDF"),
        (b"%PDF-1.7\n" + b"garbage " * 50, "a.pdf", None, UnreadableDocument, "PDF"),
        (b"hello", "a.txt", "text/plain; charset=no-such-charset", UnreadableDocument, "charset"),
        (b"hello", "a.txt", "text/plain; charset=rot13", UnreadableDocument, "not a text encoding"),
        (b"aGVsbG8=", "a.txt", "text/plain; charset=base64", UnreadableDocument, "not a text encoding"),
        (b"x\x9c", "a.txt", "text/plain; charset=zlib_codec", UnreadableDocument, "not a text encoding"),
        (b"<div>" * 3000 + b"deep" + b"</div>" * 3000, "deep.html", None, UnreadableDocument, "nested"),
    ],
)
def test_bad_input_raises_a_domain_error_saying_why(
    data: bytes, filename: str | None, content_type: str | None, error: type[RetrievalError], words: str
) -> None:
    with pytest.raises(error) as info:
        parse_document(data, filename, content_type)
    assert isinstance(info.value, RetrievalError)
    assert words in str(info.value)


def test_pdf_without_text_is_empty() -> None:
    with pytest.raises(EmptyDocument, match="no extractable text"):
        parse_document(make_pdf(["", ""]), "scan.pdf", None)


def test_kind_detection_order() -> None:
    assert detect_kind(b"plain", "x.TXT", "text/html") == "txt"  # extension beats content type
    assert detect_kind(b"plain", None, "text/markdown; charset=utf-8") == "md"
    assert detect_kind(b"plain", None, "application/octet-stream") == "txt"
    assert detect_kind(b"plain", "noext", None) == "txt"
