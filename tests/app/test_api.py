"""The service's documents API over real HTTP: health, readiness and metrics, the model list and OpenAPI
schema, uploads (JSON and multipart, every supported kind) through indexing to deletion, and bad uploads
answered with a clear 4xx (over the size limit, unsupported or unreadable files, malformed bodies), unknown
routes as JSON errors and the static page. One uvicorn server for the module (tests/app/conftest.py;
bundled SmolLM2 + MiniLM, no auth, no Redis), with a small upload limit.

Asking and chatting (/v1/ask, /v1/chat/completions) are in tests/app/test_api_ask.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.app.live import ask, metric, upload_text, wait_for, wait_indexed
from tests.conftest import make_pdf

pytestmark = pytest.mark.real_model

UPLOAD_LIMIT_MB = 0.25


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"max_upload_mb": UPLOAD_LIMIT_MB}


# ---- health ---------------------------------------------------------------------------------------


def test_health_readiness_and_metrics(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["status"] == "ready"
    assert body["checks"]["models"] == body["checks"]["store"] == "ok"
    assert "redis" not in body["checks"]  # not configured here
    text = client.get("/metrics").text
    for name in (
        "ragspec_http_requests_total",
        "ragspec_queue_depth",
        "ragspec_kv_cache_bytes",
        "ragspec_kv_disk_bytes",
        "ragspec_indexing_jobs",
        "ragspec_generation_running",
    ):
        assert name in text
    assert metric(client, "ragspec_http_requests_total", route="/healthz", method="GET", status="200") >= 1


def test_models_and_openapi(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"]
    schema = client.get("/openapi.json").json()
    assert {"/v1/ask", "/v1/documents", "/v1/chat/completions", "/healthz"} <= set(schema["paths"])


# ---- documents ------------------------------------------------------------------------------------


def test_upload_json_lifecycle(client: httpx.Client) -> None:
    response = client.post("/v1/documents", json={"text": "Alpha beta gamma.\n\nDelta epsilon.", "title": "greek"})
    assert response.status_code == 202
    accepted = response.json()
    assert set(accepted) == {"id", "title", "status", "progress", "collection_ids", "attributes"}
    assert (accepted["collection_ids"], accepted["attributes"]) == ([], {})
    assert accepted["title"] == "greek" and accepted["status"] in ("queued", "indexing", "ready")
    record = wait_indexed(client, accepted["id"])
    assert record["status"] == "ready" and record["progress"] == 1.0 and record["chunks"] >= 1
    assert accepted["id"] in [d["id"] for d in client.get("/v1/documents").json()["documents"]]


@pytest.mark.parametrize("charset", ["rot13", "base64", "zlib_codec"])
def test_upload_with_a_transform_codec_as_charset_is_refused(client: httpx.Client, charset: str) -> None:
    response = client.post("/v1/documents", files={"file": ("a.txt", b"hello there", f"text/plain; charset={charset}")})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "unreadable_document" and "text encoding" in response.text


@pytest.mark.parametrize(
    ("name", "media", "payload", "needle"),
    [
        ("notes.txt", "text/plain", b"Plain text notes about tea.", "tea"),
        ("notes.md", "text/markdown", b"# Coffee\n\nMarkdown notes about coffee.", "coffee"),
        (
            "page.html",
            "text/html",
            b"<html><body><h1>Cocoa</h1><script>x()</script><p>Notes on cocoa.</p></body></html>",
            "cocoa",
        ),
        ("book.pdf", "application/pdf", None, "second"),
    ],
)
def test_upload_multipart_kinds(
    client: httpx.Client, name: str, media: str, payload: bytes | None, needle: str
) -> None:
    data = payload if payload is not None else make_pdf(["The first page.", "The second page is here."])
    response = client.post("/v1/documents", files={"file": (name, data, media)})
    assert response.status_code == 202, response.text
    doc_id = response.json()["id"]
    assert wait_indexed(client, doc_id)["status"] == "ready"
    answer = ask(client, question=f"What is said about {needle}?", document_ids=[doc_id], max_tokens=4)
    assert answer.status_code == 200, answer.text
    sources = answer.json()["sources"]
    if name.endswith(".pdf"):
        assert sources and all(s["page"] in (1, 2) for s in sources)
    if name.endswith(".html"):
        assert all("x()" not in s["text"] for s in sources)


def test_delete_removes_document_and_cached_kv(client: httpx.Client) -> None:
    doc_id = upload_text(client, "Zebras live in Africa. They have black and white stripes.", title="zebras")
    assert wait_indexed(client, doc_id)["status"] == "ready"
    assert ask(client, question="Where do zebras live?", document_ids=[doc_id], max_tokens=4).status_code == 200
    kv_before = metric(client, "ragspec_kv_cache_bytes")
    assert kv_before > 0
    disk_before = wait_for(lambda: metric(client, "ragspec_kv_disk_bytes"), "the prefix written to disk")
    assert client.delete(f"/v1/documents/{doc_id}").status_code == 204
    assert metric(client, "ragspec_kv_cache_bytes") < kv_before
    assert metric(client, "ragspec_kv_disk_bytes") < disk_before  # its files are gone too
    assert client.get(f"/v1/documents/{doc_id}").status_code == 404
    assert doc_id not in [d["id"] for d in client.get("/v1/documents").json()["documents"]]
    assert client.delete(f"/v1/documents/{doc_id}").status_code == 404
    gone = ask(client, question="Where do zebras live?", document_ids=[doc_id])
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "document_not_found"


# ---- bad input: a clear 4xx, never a 5xx ----------------------------------------------------------


def test_upload_over_the_limit_is_413(client: httpx.Client) -> None:
    big = b"word " * int(UPLOAD_LIMIT_MB * 1024 * 1024 / 4)
    response = client.post("/v1/documents", files={"file": ("big.txt", big, "text/plain")})
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        boundary = b"--xyz\r\n"
        yield boundary + b'Content-Disposition: form-data; name="file"; filename="big.txt"\r\n\r\n'
        for _ in range(64):
            yield b"x" * 16384
        yield b"\r\n--xyz--\r\n"

    response = client.post(
        "/v1/documents", content=chunked(), headers={"Content-Type": "multipart/form-data; boundary=xyz"}
    )
    assert response.status_code == 413
    too_long_text = client.post("/v1/documents", json={"text": "a" * int(UPLOAD_LIMIT_MB * 1024 * 1024 + 10)})
    assert too_long_text.status_code == 413


@pytest.mark.parametrize(
    ("files", "status", "code"),
    [
        (
            {"file": ("report.docx", b"PK\x03\x04 fake", "application/vnd.openxmlformats")},
            415,
            "unsupported_document_type",
        ),
        ({"file": ("image.png", b"\x89PNG\r\n\x1a\n", "image/png")}, 415, "unsupported_document_type"),
        ({"file": ("empty.txt", b"", "text/plain")}, 422, "empty_document"),
        ({"file": ("blank.txt", b"  \n\n  ", "text/plain")}, 422, "empty_document"),
        ({"file": ("noise.txt", bytes(range(256)) * 8, "text/plain")}, 422, "unreadable_document"),
        ({"file": ("fake.pdf", b"this is no pdf", "application/pdf")}, 422, "unreadable_document"),
        ({"other": ("x.txt", b"text", "text/plain")}, 422, "invalid_request"),
    ],
)
def test_bad_uploads(client: httpx.Client, files: dict[str, Any], status: int, code: str) -> None:
    before = len(client.get("/v1/documents").json()["documents"])
    response = client.post("/v1/documents", files=files)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    assert len(client.get("/v1/documents").json()["documents"]) == before  # nothing half-stored


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b'{"text": "unterminated', {"Content-Type": "application/json"}, 422),
        (b'{"title": "no text"}', {"Content-Type": "application/json"}, 422),
        (b'{"text": ""}', {"Content-Type": "application/json"}, 422),
        (b'{"text": 5}', {"Content-Type": "application/json"}, 422),
        (b"plain body", {"Content-Type": "text/csv"}, 415),
        (b"--b\r\nbroken", {"Content-Type": "multipart/form-data; boundary=b"}, 422),
    ],
)
def test_bad_upload_bodies(client: httpx.Client, content: bytes, headers: dict[str, str], status: int) -> None:
    response = client.post("/v1/documents", content=content, headers=headers)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def test_unknown_routes_are_json_errors(client: httpx.Client) -> None:
    response = client.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert client.put("/v1/ask").status_code == 405


def test_static_page(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert client.get("/static/app.js").status_code == 200
