"""Issue 15's hostile-review cases 2 and 7, each reproduced over real HTTP (raw sockets where the case is
about what the server reads, or does not read, of a body).

One server with API keys, a metrics token and small limits serves most tests; the readiness-on-a-full-disk
and damaged-index cases restart a service on a prepared data dir; the forwarded-header case runs the
uvicorn config that ``ragspec serve`` builds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.main import serve_config
from app.serving.auth import tenant_of_key
from app.settings import Settings
from tests.app.live import (
    LANDMARKS,
    ThreadServer,
    metric,
    service_settings,
    thread_server,
    upload_text,
    wait_for,
    wait_indexed,
)
from tests.conftest import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]

KEY_A, KEY_B, SCRAPER = "key-alpha-hard", "key-bravo-hard", "scrape-token-hard"
JSON_LIMIT_MB = 0.05
JSON_LIMIT = int(JSON_LIMIT_MB * 1024 * 1024)
UPLOAD_LIMIT_MB = 0.25
UPLOAD_LIMIT = int(UPLOAD_LIMIT_MB * 1024 * 1024)
HUGE = 150_000_000  # the announced Content-Length of the review's attack: never sent
SOCKET_TIMEOUT_S = 60.0  # a server waiting for the announced body would never answer within this


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    """The module's server (tests/app/conftest.py): API keys, a metrics token and small limits."""
    return {
        "api_keys": f"{KEY_A},{KEY_B}",
        "metrics_token": SCRAPER,
        "max_json_mb": JSON_LIMIT_MB,
        "max_upload_mb": UPLOAD_LIMIT_MB,
        "max_pdf_pages": 3,
    }


# ---- raw HTTP ---------------------------------------------------------------------------------------


def raw_request(
    port: int, method: str, path: str, headers: dict[str, str], body: bytes
) -> tuple[int, dict[str, str], Any]:
    """Send the head and ``body`` (which may be a small part of what the head announces), then read one
    response: (status, headers, JSON body)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head.encode("latin-1") + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed without a response: {data!r}")
            data += chunk
        raw_head, _, rest = data.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        got = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(got.get("content-length", "0"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    return status, got, json.loads(rest[:length]) if length else None


def chunked(payload: bytes, size: int = 8192) -> bytes:
    """``payload`` as HTTP chunks, without the final zero-length chunk (the body is left open)."""
    parts = [payload[i : i + size] for i in range(0, len(payload), size)]
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts)


def json_prefix(n: int) -> bytes:
    """The first ``n`` bytes of a long JSON question body."""
    return (b'{"document_ids": ["x"], "question": "' + b"a" * n)[:n]


# ---- item 2: auth before the body, body limits --------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/ask", "/v1/chat/completions", "/v1/documents"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_no_valid_key_is_refused_before_the_body(server: ThreadServer, path: str, key: str | None) -> None:
    headers = {"Content-Type": "application/json", "Content-Length": str(HUGE)}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    status, got, body = raw_request(server.port, "POST", path, headers, json_prefix(4096))
    assert status == 401, body
    assert body["error"]["code"] == "unauthorized" and got["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/v1/ask", "/v1/chat/completions"])
def test_an_announced_oversized_json_body_is_refused_before_reading(server: ThreadServer, path: str) -> None:
    headers = {"Content-Type": "application/json", "Content-Length": str(HUGE), "Authorization": f"Bearer {KEY_A}"}
    status, _, body = raw_request(server.port, "POST", path, headers, json_prefix(4096))
    assert status == 413, body
    assert body["error"]["code"] == "payload_too_large"
    assert f"the limit is {JSON_LIMIT} bytes" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/ask", "/v1/chat/completions"])
def test_a_chunked_json_body_is_refused_once_over_the_limit(server: ThreadServer, path: str) -> None:
    headers = {"Content-Type": "application/json", "Transfer-Encoding": "chunked", "Authorization": f"Bearer {KEY_A}"}
    status, _, body = raw_request(server.port, "POST", path, headers, chunked(json_prefix(JSON_LIMIT + 16384)))
    assert status == 413, body
    assert body["error"]["message"] == f"the request body exceeds the limit of {JSON_LIMIT} bytes"


def test_json_within_the_limit_still_works(server: ThreadServer) -> None:
    with server.client(KEY_A) as client:
        response = client.post("/v1/ask", json={"question": "x" * 100, "document_ids": ["nope"]})
    assert response.status_code == 404, response.text  # reached the handler: an unknown document


def test_json_uploads_stop_at_the_upload_limit(server: ThreadServer) -> None:
    """The body of a JSON upload is read up to the upload limit (plus room for a title), not 6 times it."""
    auth = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"}
    announced = {**auth, "Content-Length": str(2 * UPLOAD_LIMIT)}
    status, _, body = raw_request(server.port, "POST", "/v1/documents", announced, b'{"text": "' + b"a" * 4096)
    assert status == 413 and body["error"]["code"] == "payload_too_large", body
    streamed = {**auth, "Transfer-Encoding": "chunked"}
    text = b'{"text": "' + b"a" * (UPLOAD_LIMIT + 96 * 1024)
    status, _, body = raw_request(server.port, "POST", "/v1/documents", streamed, chunked(text))
    assert status == 413 and "JSON upload exceeds the limit" in body["error"]["message"], body


def test_multipart_uploads_keep_their_limit(server: ThreadServer) -> None:
    with server.client(KEY_A) as client:
        too_big = client.post("/v1/documents", files={"file": ("big.txt", b"a" * (UPLOAD_LIMIT + 1), "text/plain")})
        fits = client.post("/v1/documents", files={"file": ("fits.txt", b"word " * 1000, "text/plain")})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"
    assert fits.status_code == 202, fits.text


# ---- item 7 ----------------------------------------------------------------------------------------------


def test_readyz_needs_no_key_and_tells_only_check_status(server: ThreadServer) -> None:
    response = httpx.get(server.url + "/readyz")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready" and set(body) == {"status", "checks"}
    assert body["checks"]["store"] == "ok" and all(isinstance(v, str) for v in body["checks"].values())


def test_metrics_show_a_key_only_its_own_tenant(server: ThreadServer) -> None:
    series = {"route": "/v1/documents", "method": "GET", "status": "200"}
    with server.client(KEY_A) as a, server.client(KEY_B) as b, server.client(SCRAPER) as scraper:
        a_before = metric(a, "ragspec_http_requests_total", **series)
        for _ in range(5):
            assert b.get("/v1/documents").status_code == 200
        for _ in range(2):
            assert a.get("/v1/documents").status_code == 200
        assert metric(a, "ragspec_http_requests_total", **series) == a_before + 2  # none of B's five
        a_text, everything = a.get("/metrics"), scraper.get("/metrics")
        assert scraper.get("/v1/documents").status_code == 401  # the scrape token is no API key
    assert a_text.status_code == everything.status_code == 200
    assert 'tenant="' not in a_text.text and tenant_of_key(KEY_B) not in a_text.text
    assert "ragspec_queue_depth" not in a_text.text  # service-wide: the operator's, not a tenant's
    for tenant in (tenant_of_key(KEY_A), tenant_of_key(KEY_B)):
        assert f'tenant="{tenant}"' in everything.text
    assert "ragspec_queue_depth" in everything.text
    assert httpx.get(server.url + "/metrics").status_code == 401


def test_pdf_page_cap(server: ThreadServer) -> None:
    from fpdf import FPDF

    def pdf(pages: int) -> bytes:
        doc = FPDF()
        doc.set_font("helvetica", size=12)
        for i in range(pages):
            doc.add_page()
            doc.multi_cell(0, 8, f"Page {i + 1} of the report.")
        return bytes(doc.output())

    with server.client(KEY_A) as client:
        refused = client.post("/v1/documents", files={"file": ("long.pdf", pdf(5), "application/pdf")})
        accepted = client.post("/v1/documents", files={"file": ("short.pdf", pdf(3), "application/pdf")})
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"] == {
        "code": "too_many_pages", "message": "the PDF has 5 pages; at most 3 are accepted"
    }
    assert accepted.status_code == 202, accepted.text


def test_multipart_and_json_titles_follow_one_rule(server: ThreadServer) -> None:
    long_title = "T" * 513
    with server.client(KEY_A) as client:
        by_json = client.post("/v1/documents", json={"text": "Some text.", "title": long_title})
        by_form = client.post(
            "/v1/documents", files={"file": ("a.txt", b"Some text.", "text/plain")}, data={"title": long_title}
        )
        kept = client.post(
            "/v1/documents", files={"file": ("a.txt", b"Some text.", "text/plain")}, data={"title": long_title[:512]}
        )
    assert by_json.status_code == by_form.status_code == 422, (by_json.text, by_form.text)
    assert by_form.json() == by_json.json()
    assert "title" in by_form.json()["error"]["message"]
    assert kept.status_code == 202 and kept.json()["title"] == long_title[:512]  # whole, never cut


# ---- a restarted service: damaged index files, a full disk -----------------------------------------


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadServer, dict[str, str]]]:
    """Two indexed documents whose chunk list / FAISS file were then damaged on disk, served by a fresh
    service whose minimum free disk space is more than the disk has."""
    data_dir = tmp_path_factory.mktemp("damaged")
    with thread_server(service_settings(data_dir)) as first, first.client() as client:
        ids = {
            "chunks": upload_text(client, LANDMARKS, "one"),
            "faiss": upload_text(client, LANDMARKS + "\n\nTwo.", "two"),
        }
        for doc_id in ids.values():
            assert wait_indexed(client, doc_id)["status"] == "ready"
    derived = data_dir / "documents" / "docs"
    (derived / ids["chunks"] / "derived" / "chunks.jsonl").write_text('{"id": 0, "start": 0, "te', encoding="utf-8")
    (derived / ids["faiss"] / "derived" / "index" / "index.faiss").write_bytes(b"\x00garbage" * 8)
    free_mb = shutil.disk_usage(data_dir).free / (1024 * 1024)
    with thread_server(service_settings(data_dir, min_free_disk_mb=free_mb + 1024)) as second:
        yield second, ids


@pytest.mark.parametrize("part", ["chunks", "faiss"])
def test_a_damaged_index_is_a_clear_409_without_paths(damaged: tuple[ThreadServer, dict[str, str]], part: str) -> None:
    server, ids = damaged
    doc_id = ids[part]
    with server.client() as client:
        response = client.post("/v1/ask", json={"question": "Where is the Colosseum?", "document_ids": [doc_id]})
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "index_damaged" and f"ragspec reindex {doc_id}" in error["message"]
    assert "/" not in error["message"].replace(f"ragspec reindex {doc_id}", "")  # no server path
    assert str(server.settings.data_dir) not in response.text


def test_readyz_is_unavailable_on_a_full_disk(damaged: tuple[ThreadServer, dict[str, str]]) -> None:
    server, _ = damaged
    response = httpx.get(server.url + "/readyz")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] == "unavailable"
    assert "free on the data disk, below the minimum" in body["checks"]["store"]
    assert "RAGSPEC_MIN_FREE_DISK_MB" in body["checks"]["store"]


# ---- forwarded headers ------------------------------------------------------------------------------


def _served(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> tuple[uvicorn.Server, threading.Thread, int]:
    """The service as ``ragspec serve`` runs it: its uvicorn config, given the settings, none of them in the
    environment (the 401 below shows the app was built from these, its API key included)."""
    for name in [n for n in os.environ if n.startswith("RAGSPEC_")]:
        monkeypatch.delenv(name)
    port = free_port()
    server = uvicorn.Server(serve_config(settings, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, name=f"serve-{port}", daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "ragspec serve's server to start")
    assert server.started
    return server, thread, port


@pytest.mark.parametrize("trusted", ["", "127.0.0.1"])
def test_forwarded_for_is_ignored_unless_the_proxy_is_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, trusted: str
) -> None:
    settings = service_settings(tmp_path, api_keys=KEY_A, trusted_proxies=trusted)
    server, thread, port = _served(settings, monkeypatch)
    try:
        with caplog.at_level(logging.INFO, logger="app.api.middleware"):
            response = httpx.get(
                f"http://127.0.0.1:{port}/v1/documents", headers={"X-Forwarded-For": "203.0.113.7"}
            )
    finally:
        server.should_exit = True
        thread.join(60)
    assert response.status_code == 401
    refusals = [r.getMessage() for r in caplog.records if r.name == "app.api.middleware"]
    assert refusals, "the refusal was not logged"
    seen_as = "203.0.113.7" if trusted else "127.0.0.1"  # the control case shows the test can tell them apart
    assert f"from {seen_as}:" in refusals[-1], refusals
