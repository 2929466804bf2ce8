"""Collections and document attributes over real HTTP: create, list in cursor pages, read with counts, rename and
describe, delete with or without the documents, add and remove documents, list a collection's documents; uploads
into a collection (multipart and JSON, several files in one request) with attributes, attributes set by PATCH; and
bad input answered with a clear 4xx that stores and changes nothing: unknown or another tenant's collections and
documents (404, never their data), attributes and collection fields out of bounds (422), a bad file among several.

One uvicorn server for the module (tests/app/conftest.py) with three API keys (tenants) and a small upload limit.
These are catalogue operations: only the tests that count ready documents wait for indexing.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.errors import InvalidRequest
from app.serving.catalogue import UploadBatch
from retrieval.store import DocumentStore
from tests.app.live import ThreadServer, upload_text, wait_indexed

pytestmark = pytest.mark.real_model

KEY_A, KEY_B, KEY_C = "coll-key-alpha", "coll-key-bravo", "coll-key-charlie"
UPLOAD_LIMIT_MB = 0.25
UPLOAD_LIMIT = int(UPLOAD_LIMIT_MB * 1024 * 1024)
ACCEPTED = {"id", "title", "status", "progress", "collection_ids", "attributes"}


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"api_keys": f"{KEY_A},{KEY_B},{KEY_C}", "max_upload_mb": UPLOAD_LIMIT_MB}


@pytest.fixture(scope="module")
def a(server: ThreadServer) -> Iterator[httpx.Client]:
    with server.client(KEY_A) as c:
        yield c


@pytest.fixture(scope="module")
def b(server: ThreadServer) -> Iterator[httpx.Client]:
    with server.client(KEY_B) as c:
        yield c


def create(client: httpx.Client, name: str, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/collections", json={"name": name, **fields})
    assert response.status_code == 201, response.text
    return dict(response.json())


def doc_ids(client: httpx.Client) -> set[str]:
    return {d["id"] for d in client.get("/v1/documents").json()["documents"]}


def error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()["error"]
    assert body["message"]
    return body


def txt(name: str, text: str) -> tuple[str, tuple[str, bytes, str]]:
    return ("file", (name, text.encode(), "text/plain"))


# ---- collections ----------------------------------------------------------------------------------


def test_create_read_rename_and_describe(a: httpx.Client) -> None:
    created = create(a, "Reports", description="yearly reports", metadata={"team": "search"})
    assert set(created) == {"id", "name", "description", "metadata", "created_at", "document_counts", "chunks",
                            "tokens", "bytes"}
    assert (created["name"], created["description"], created["metadata"]) == ("Reports", "yearly reports",
                                                                              {"team": "search"})
    assert created["document_counts"] == {"queued": 0, "indexing": 0, "ready": 0, "failed": 0, "total": 0}
    assert (created["chunks"], created["tokens"], created["bytes"]) == (0, 0, 0)
    cid = created["id"]
    assert a.get(f"/v1/collections/{cid}").json() == created

    renamed = a.patch(f"/v1/collections/{cid}", json={"name": "Annual reports"})
    assert renamed.status_code == 200, renamed.text
    assert renamed.json() == {**created, "name": "Annual reports"}
    relabelled = a.patch(f"/v1/collections/{cid}", json={"metadata": {"team": "ranking", "year": "2024"}}).json()
    assert relabelled["metadata"] == {"team": "ranking", "year": "2024"}
    assert (relabelled["name"], relabelled["description"]) == ("Annual reports", "yearly reports")  # kept
    cleared = a.patch(f"/v1/collections/{cid}", json={"description": None, "metadata": None}).json()
    assert (cleared["description"], cleared["metadata"]) == (None, {})
    assert a.get(f"/v1/collections/{cid}").json() == cleared

    assert error(a.patch(f"/v1/collections/{cid}", json={"name": None}), 422)["code"] == "invalid_request"
    assert error(a.patch(f"/v1/collections/{cid}", json={"name": "x" * 257}), 422)["code"] == "invalid_request"
    assert a.get(f"/v1/collections/{cid}").json() == cleared  # a refused change changes nothing


def test_list_in_cursor_pages(server: ThreadServer) -> None:
    with server.client(KEY_C) as c:  # a tenant of its own: its list holds only these
        made = [create(c, f"c{i}")["id"] for i in range(5)]
        first = c.get("/v1/collections", params={"limit": 2}).json()
        assert [x["id"] for x in first["data"]] == made[:2]
        assert first["has_more"] is True and first["last_id"] == made[1]
        second = c.get("/v1/collections", params={"limit": 2, "after": first["last_id"]}).json()
        assert [x["id"] for x in second["data"]] == made[2:4] and second["has_more"] is True
        last = c.get("/v1/collections", params={"limit": 2, "after": second["last_id"]}).json()
        assert [x["id"] for x in last["data"]] == made[4:] and last["has_more"] is False
        assert last["last_id"] == made[4]
        whole = c.get("/v1/collections").json()  # default page size 20
        assert [x["id"] for x in whole["data"]] == made and whole["has_more"] is False
        assert whole["data"][0]["document_counts"]["total"] == 0

        for params in ({"limit": 0}, {"limit": 101}, {"after": "col-unknown"}):
            assert error(c.get("/v1/collections", params=params), 422)["code"] == "invalid_request", params
        assert c.get("/v1/collections", params={"limit": 100}).status_code == 200

        for cid in made:
            assert c.delete(f"/v1/collections/{cid}").status_code == 204
        assert c.get("/v1/collections").json() == {"data": [], "has_more": False, "last_id": None}


def test_bad_collection_bodies_are_422_and_store_nothing(a: httpx.Client) -> None:
    before = a.get("/v1/collections", params={"limit": 100}).json()["data"]
    bad = [
        {"name": "x" * 257},
        {"name": ""},
        {"name": "   "},
        {"description": "no name"},
        {"name": "ok", "description": "d" * 2049},
        {"name": "ok", "metadata": {f"k{i}": "v" for i in range(17)}},
        {"name": "ok", "metadata": {"k" * 65: "v"}},
        {"name": "ok", "metadata": {"k": "v" * 513}},
        {"name": "ok", "metadata": {"k": 5}},
        {"name": "ok", "metadata": ["k"]},
    ]
    for body in bad:
        assert error(a.post("/v1/collections", json=body), 422)["code"] == "invalid_request", body
    assert error(a.post("/v1/collections", json={"name": "ok", "colour": "red"}), 400)["code"] == \
        "unsupported_parameter"
    create(a, "y" * 256, description="d" * 2048, metadata={f"{i:064d}": "v" * 512 for i in range(16)})  # the limits
    after = a.get("/v1/collections", params={"limit": 100}).json()["data"]
    assert len(after) == len(before) + 1


# ---- uploads into a collection, attributes -------------------------------------------------------


def test_upload_into_a_collection_multipart_and_json(a: httpx.Client) -> None:
    cid = create(a, "Upload target")["id"]
    attributes = {"year": 2024, "team": "search", "draft": False, "score": 0.5}
    form = a.post("/v1/documents", files=[txt("tea.txt", "Notes about green tea and its harvest.")],
                  data={"collection_id": cid, "attributes": json.dumps(attributes)})
    assert form.status_code == 202, form.text
    one = form.json()
    assert set(one) == ACCEPTED  # one file: one document, as before, with its collections and attributes
    assert (one["collection_ids"], one["attributes"], one["title"]) == ([cid], attributes, "tea.txt")
    by_json = a.post("/v1/documents", json={"text": "Coffee grows on shrubs.", "title": "coffee",
                                            "collection_id": cid, "attributes": {"year": 2023}})
    assert by_json.status_code == 202, by_json.text
    two = by_json.json()
    assert set(two) == ACCEPTED and (two["collection_ids"], two["attributes"]) == ([cid], {"year": 2023})

    record = a.get(f"/v1/documents/{one['id']}").json()
    assert (record["collection_ids"], record["attributes"]) == ([cid], attributes)
    listed = {d["id"]: d for d in a.get("/v1/documents").json()["documents"]}
    assert (listed[two["id"]]["collection_ids"], listed[two["id"]]["attributes"]) == ([cid], {"year": 2023})

    ready = [wait_indexed(a, d["id"]) for d in (one, two)]
    assert all(r["status"] == "ready" for r in ready)
    counts = a.get(f"/v1/collections/{cid}").json()
    assert counts["document_counts"] == {"queued": 0, "indexing": 0, "ready": 2, "failed": 0, "total": 2}
    assert counts["chunks"] == sum(r["chunks"] for r in ready) and counts["tokens"] == sum(r["tokens"] for r in ready)
    assert counts["bytes"] == sum(r["size_bytes"] for r in ready)

    page = a.get(f"/v1/collections/{cid}/documents").json()
    assert [d["id"] for d in page["data"]] == [one["id"], two["id"]]  # oldest first
    assert page["has_more"] is False and page["last_id"] == two["id"]
    assert all(d["status"] == "ready" and d["progress"] == 1.0 for d in page["data"])
    assert page["data"][0]["attributes"] == attributes and page["data"][1]["collection_ids"] == [cid]


def test_several_files_in_one_request(a: httpx.Client) -> None:
    cid = create(a, "Many")["id"]
    files = [txt(f"part{i}.txt", f"Part {i} tells about river number {i}.") for i in range(3)]
    response = a.post("/v1/documents", files=files, data={"collection_id": cid, "attributes": '{"batch": 1}'})
    assert response.status_code == 202, response.text
    body = response.json()
    assert set(body) == {"documents"}
    docs = body["documents"]
    assert [d["title"] for d in docs] == ["part0.txt", "part1.txt", "part2.txt"]  # in the order of the files
    assert all(set(d) == ACCEPTED and d["collection_ids"] == [cid] and d["attributes"] == {"batch": 1} for d in docs)
    assert all(wait_indexed(a, d["id"])["status"] == "ready" for d in docs)  # each was submitted for indexing
    page = a.get(f"/v1/collections/{cid}/documents", params={"limit": 2}).json()
    assert [d["id"] for d in page["data"]] == [docs[0]["id"], docs[1]["id"]] and page["has_more"] is True
    rest = a.get(f"/v1/collections/{cid}/documents", params={"limit": 2, "after": page["last_id"]}).json()
    assert [d["id"] for d in rest["data"]] == [docs[2]["id"]] and rest["has_more"] is False
    assert a.get(f"/v1/collections/{cid}").json()["document_counts"]["ready"] == 3

    own = [{"quarter": 1, "final": False}, {}, {"quarter": 3, "region": "north"}]  # one object per file, in order
    each = a.post("/v1/documents", files=[txt(f"q{i}.txt", f"Quarter {i} report.") for i in range(3)],
                  data={"collection_id": cid, "attributes": json.dumps(own)})
    assert each.status_code == 202, each.text
    assert [d["attributes"] for d in each.json()["documents"]] == own
    assert [a.get(f"/v1/documents/{d['id']}").json()["attributes"] for d in each.json()["documents"]] == own

    titled = a.post("/v1/documents", files=[txt("x.txt", "One text."), txt("y.txt", "Another text.")],
                    data={"title": "shared"})
    assert titled.status_code == 202, titled.text
    assert [d["title"] for d in titled.json()["documents"]] == ["shared", "shared"]
    assert all(d["collection_ids"] == [] and d["attributes"] == {} for d in titled.json()["documents"])


def test_a_bad_file_among_several_stores_nothing(a: httpx.Client) -> None:
    cid = create(a, "Guarded")["id"]
    docs_before = doc_ids(a)
    good = txt("good.txt", "A fine document about lighthouses.")
    cases = [
        ([good, txt("empty.txt", ""), good], 422, "empty_document", "file 2 (empty.txt)"),
        ([good, ("file", ("logo.png", b"\x89PNG\r\n\x1a\n", "image/png"))], 415, "unsupported_document_type",
         "file 2 (logo.png)"),
        ([good, good, ("file", ("big.txt", b"a" * (UPLOAD_LIMIT + 1), "text/plain"))], 413, "payload_too_large",
         "file 3 (big.txt)"),
    ]
    for files, status, code, named in cases:
        body = error(a.post("/v1/documents", files=files, data={"collection_id": cid}), status)
        assert body["code"] == code and body["message"].startswith(named), body
    refused = [
        ({"collection_id": "col-unknown"}, 404, "collection_not_found"),
        ({"attributes": "not json"}, 422, "invalid_request"),
        ({"attributes": "[1, 2]"}, 422, "invalid_request"),
        ({"attributes": json.dumps({f"k{i}": i for i in range(17)})}, 422, "invalid_attributes"),
        ({"attributes": json.dumps({"k" * 65: 1})}, 422, "invalid_attributes"),
        ({"attributes": json.dumps({"k": None})}, 422, "invalid_attributes"),
    ]
    for data, status, code in refused:
        assert error(a.post("/v1/documents", files=[good, good], data=data), status)["code"] == code, data
        assert error(a.post("/v1/documents", files=[good], data=data), status)["code"] == code, data
    per_file = [  # a list of one object per file: as many as the files, each checked, naming its file
        ('[{"a": 1}, {"a": 2}, {"a": 3}]', 422, "invalid_request", "attributes: 3 objects for 2 files"),
        ('[{"a": 1}]', 422, "invalid_request", "attributes: 1 objects for 2 files"),
        ('[{"a": 1}, {"a": null}]', 422, "invalid_attributes", "attributes of file 2: attributes.a"),
        ('[{"a": 1}, "b"]', 422, "invalid_request", "attributes of file 2: must be a JSON object"),
    ]
    for raw, status, code, message in per_file:
        body = error(a.post("/v1/documents", files=[good, good], data={"collection_id": cid, "attributes": raw}),
                     status)
        assert body["code"] == code and body["message"].startswith(message), body
    json_bad = a.post("/v1/documents", json={"text": "Some text.", "attributes": {"k" * 65: 1}})
    assert error(json_bad, 422)["code"] == "invalid_attributes"
    assert error(a.post("/v1/documents", json={"text": "Some text.", "attributes": [1]}), 422)["code"] == \
        "invalid_request"
    assert error(a.post("/v1/documents", json={"text": "Some text.", "collection_id": "col-unknown"}), 404)["code"] \
        == "collection_not_found"
    assert doc_ids(a) == docs_before  # nothing stored, nothing half
    assert a.get(f"/v1/collections/{cid}").json()["document_counts"]["total"] == 0


def test_an_upload_abandoned_mid_way_keeps_nothing(tmp_path: Path) -> None:
    """A request cancelled while a file is being stored (in a worker thread): the batch is discarded, and the file
    that finishes storing afterwards is deleted at once."""
    store = DocumentStore(tmp_path / "documents")
    try:
        batch = UploadBatch(store, "tenant", attributes={"year": 2024})
        batch.add(b"The first text.", "a.txt", "text/plain", None)
        assert len(store.list("tenant")) == 1
        batch.discard()
        with pytest.raises(InvalidRequest):
            batch.add(b"The second text, stored after the discard.", "b.txt", "text/plain", None)
        assert store.list() == [] and batch.records == []
    finally:
        store.close()


def test_too_many_files_in_one_request(a: httpx.Client) -> None:
    before = doc_ids(a)
    files = [txt(f"f{i}.txt", "Tiny.") for i in range(65)]
    assert error(a.post("/v1/documents", files=files), 422)["code"] == "invalid_request"
    assert doc_ids(a) == before


def test_each_file_has_the_upload_limit(a: httpx.Client, server: ThreadServer) -> None:
    """Several files may together carry more than one file's limit; one file over it is refused while it is read
    (the body left open here: the answer comes before the rest would)."""

    def page(i: int) -> bytes:  # 80% of the limit in bytes, a few words of text (quick to index)
        comment = b"a" * int(UPLOAD_LIMIT * 0.8)
        return f"<html><body><p>Short note {i}.</p><!--".encode() + comment + b"--></body></html>"

    files = [("file", (f"n{i}.html", page(i), "text/html")) for i in range(3)]
    response = a.post("/v1/documents", files=files)
    assert response.status_code == 202, response.text
    assert len(response.json()["documents"]) == 3
    assert all(wait_indexed(a, d["id"])["status"] == "ready" for d in response.json()["documents"])

    part = (b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="big.txt"\r\n'
            b"Content-Type: text/plain\r\n\r\n" + b"a" * (UPLOAD_LIMIT + 96 * 1024))
    head = (f"POST /v1/documents HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY_A}\r\n"
            "Content-Type: multipart/form-data; boundary=xyz\r\nTransfer-Encoding: chunked\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head.encode() + f"{len(part):x}\r\n".encode() + part + b"\r\n")  # no last chunk
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_attributes_set_by_patch(a: httpx.Client) -> None:
    doc = upload_text(a, "The moon orbits the earth.", title="moon")
    plain = a.get(f"/v1/documents/{doc}").json()
    assert (plain["attributes"], plain["collection_ids"]) == ({}, [])
    patched = a.patch(f"/v1/documents/{doc}", json={"attributes": {"topic": "space", "year": 1969, "true": True}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["attributes"] == {"topic": "space", "year": 1969, "true": True}
    assert a.get(f"/v1/documents/{doc}").json()["attributes"] == {"topic": "space", "year": 1969, "true": True}

    for attributes, code in (
        ({f"k{i}": i for i in range(17)}, "invalid_attributes"),
        ({"k" * 65: 1}, "invalid_attributes"),
        ({"k": "v" * 513}, "invalid_attributes"),
        ({"k": [1]}, "invalid_attributes"),
        ([1, 2], "invalid_request"),
        ("a string", "invalid_request"),
    ):
        assert error(a.patch(f"/v1/documents/{doc}", json={"attributes": attributes}), 422)["code"] == code
    assert error(a.patch(f"/v1/documents/{doc}", json={"title": "x"}), 400)["code"] == "unsupported_parameter"
    assert a.get(f"/v1/documents/{doc}").json()["attributes"] == {"topic": "space", "year": 1969, "true": True}
    limits = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert a.patch(f"/v1/documents/{doc}", json={"attributes": limits}).json()["attributes"] == limits
    assert a.patch(f"/v1/documents/{doc}", json={"attributes": {}}).json()["attributes"] == {}
    assert error(a.patch("/v1/documents/doc-unknown", json={"attributes": {}}), 404)["code"] == "document_not_found"


# ---- membership -----------------------------------------------------------------------------------


def test_add_and_remove_documents_and_a_document_in_two_collections(a: httpx.Client) -> None:
    doc = upload_text(a, "Penguins live in the southern hemisphere.", title="penguins")
    other = upload_text(a, "Polar bears live in the Arctic.", title="bears")
    first, second = create(a, "Birds")["id"], create(a, "Animals")["id"]
    added = a.post(f"/v1/collections/{first}/documents", json={"document_ids": [doc]})
    assert added.status_code == 200, added.text
    assert added.json()["id"] == first and added.json()["document_counts"]["total"] == 1
    assert a.post(f"/v1/collections/{second}/documents", json={"document_ids": [doc, other]}).status_code == 200
    assert a.get(f"/v1/documents/{doc}").json()["collection_ids"] == [first, second]  # oldest collection first
    again = a.post(f"/v1/collections/{first}/documents", json={"document_ids": [doc, doc]}).json()
    assert again["document_counts"]["total"] == 1  # already in it: left as it is

    unknown = a.post(f"/v1/collections/{first}/documents", json={"document_ids": [other, "doc-unknown"]})
    assert error(unknown, 404)["code"] == "document_not_found"
    assert [d["id"] for d in a.get(f"/v1/collections/{first}/documents").json()["data"]] == [doc]  # none added
    assert error(a.post(f"/v1/collections/{first}/documents", json={"document_ids": []}), 422)["code"] == \
        "invalid_request"

    assert a.delete(f"/v1/collections/{second}/documents/{doc}").status_code == 204
    assert a.get(f"/v1/documents/{doc}").json()["collection_ids"] == [first]  # the document stays
    assert [d["id"] for d in a.get(f"/v1/collections/{second}/documents").json()["data"]] == [other]
    assert error(a.delete(f"/v1/collections/{second}/documents/{doc}"), 404)["code"] == "document_not_found"
    assert error(a.delete(f"/v1/collections/{second}/documents/doc-unknown"), 404)["code"] == "document_not_found"
    page = a.get(f"/v1/collections/{second}/documents", params={"after": "doc-unknown"})
    assert error(page, 422)["code"] == "invalid_request"


def test_delete_a_collection_with_and_without_its_documents(
    server: ThreadServer, a: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    forgotten: list[str] = []
    documents_forgotten: list[str] = []
    services = server.services
    forget_document = services.forget_document
    changed: list[str] = []
    monkeypatch.setattr(services, "forget_collection", forgotten.append)
    monkeypatch.setattr(services, "collection_changed_soon", changed.append)
    monkeypatch.setattr(services, "forget_document",
                        lambda d: (documents_forgotten.append(d), forget_document(d))[1])

    kept_doc = upload_text(a, "Owls hunt at night.", title="owls")
    shared_doc = upload_text(a, "Bats hunt at night too.", title="bats")
    keeps, drops, other = create(a, "Keeps")["id"], create(a, "Drops")["id"], create(a, "Other")["id"]
    a.post(f"/v1/collections/{keeps}/documents", json={"document_ids": [kept_doc]})
    a.post(f"/v1/collections/{drops}/documents", json={"document_ids": [shared_doc]})
    a.post(f"/v1/collections/{other}/documents", json={"document_ids": [shared_doc]})

    assert a.delete(f"/v1/collections/{keeps}").status_code == 204  # documents kept by default
    assert error(a.get(f"/v1/collections/{keeps}"), 404)["code"] == "collection_not_found"
    assert a.get(f"/v1/documents/{kept_doc}").json()["collection_ids"] == []
    assert forgotten == [keeps] and documents_forgotten == []

    assert a.delete(f"/v1/collections/{drops}", params={"delete_documents": "true"}).status_code == 204
    assert error(a.get(f"/v1/documents/{shared_doc}"), 404)["code"] == "document_not_found"
    assert a.get(f"/v1/collections/{other}").json()["document_counts"]["total"] == 0  # gone from there too
    assert forgotten == [keeps, drops] and documents_forgotten == [shared_doc]

    assert a.delete(f"/v1/collections/{other}/documents/{kept_doc}").status_code == 404  # never in it
    a.post(f"/v1/collections/{other}/documents", json={"document_ids": [kept_doc]})
    assert a.delete(f"/v1/collections/{other}/documents/{kept_doc}").status_code == 204
    assert forgotten == [keeps, drops] and changed[-1] == other  # a removal brings the collection's index in step
    assert error(a.delete(f"/v1/collections/{keeps}"), 404)["code"] == "collection_not_found"


# ---- tenants and unknown ids ----------------------------------------------------------------------


def test_unknown_collections_are_404(a: httpx.Client) -> None:
    for method, path, body in (
        ("GET", "/v1/collections/col-unknown", None),
        ("PATCH", "/v1/collections/col-unknown", {"name": "x"}),
        ("DELETE", "/v1/collections/col-unknown", None),
        ("POST", "/v1/collections/col-unknown/documents", {"document_ids": ["d"]}),
        ("GET", "/v1/collections/col-unknown/documents", None),
        ("DELETE", "/v1/collections/col-unknown/documents/d", None),
    ):
        response = a.request(method, path, json=body)
        assert error(response, 404)["code"] == "collection_not_found", (method, path)


def test_another_tenants_collection_is_never_found(a: httpx.Client, b: httpx.Client) -> None:
    secret = create(a, "Alpha's secret name", description="alpha only", metadata={"owner": "alpha"})
    cid = secret["id"]
    doc = upload_text(a, "Alpha's private notes about the harbour.", title="alpha notes")
    a.post(f"/v1/collections/{cid}/documents", json={"document_ids": [doc]})
    mine = create(b, "Bravo's own")["id"]

    for method, path, body in (
        ("GET", f"/v1/collections/{cid}", None),
        ("PATCH", f"/v1/collections/{cid}", {"name": "taken over"}),
        ("DELETE", f"/v1/collections/{cid}", None),
        ("POST", f"/v1/collections/{cid}/documents", {"document_ids": [doc]}),
        ("GET", f"/v1/collections/{cid}/documents", None),
        ("DELETE", f"/v1/collections/{cid}/documents/{doc}", None),
    ):
        response = b.request(method, path, json=body)
        assert error(response, 404)["code"] == "collection_not_found", (method, path)
        assert "secret name" not in response.text and "alpha only" not in response.text
    assert error(b.delete(f"/v1/collections/{cid}", params={"delete_documents": "true"}), 404)
    assert cid not in {c["id"] for c in b.get("/v1/collections", params={"limit": 100}).json()["data"]}
    assert error(b.get("/v1/collections", params={"after": cid}), 422)["code"] == "invalid_request"
    # B can neither put A's document in its own collection nor upload into A's
    adding = b.post(f"/v1/collections/{mine}/documents", json={"document_ids": [doc]})
    assert error(adding, 404)["code"] == "document_not_found"
    before = doc_ids(b)
    upload = b.post("/v1/documents", files=[txt("b.txt", "Bravo's text.")], data={"collection_id": cid})
    assert error(upload, 404)["code"] == "collection_not_found"
    assert error(b.patch(f"/v1/documents/{doc}", json={"attributes": {"x": 1}}), 404)["code"] == "document_not_found"
    assert doc_ids(b) == before

    now = a.get(f"/v1/collections/{cid}").json()  # A's collection as it was
    assert {k: now[k] for k in ("name", "description", "metadata", "created_at")} == {
        k: secret[k] for k in ("name", "description", "metadata", "created_at")}
    assert now["document_counts"]["total"] == 1
    assert a.get(f"/v1/documents/{doc}").json()["attributes"] == {}
    assert [d["id"] for d in a.get(f"/v1/collections/{cid}/documents").json()["data"]] == [doc]


# ---- capabilities and schema ----------------------------------------------------------------------


def test_capabilities_list_the_collection_limits(a: httpx.Client) -> None:
    limits = a.get("/v1/capabilities").json()["collections"]
    assert (limits["max_attributes"], limits["max_attribute_key_chars"], limits["max_attribute_string_chars"]) == (
        16, 64, 512)
    assert set(limits["filter_operators"]) == {"eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "and", "or"}
    assert (limits["page_size_default"], limits["page_size_max"]) == (20, 100)
    assert (limits["max_name_chars"], limits["max_description_chars"], limits["max_files_per_upload"]) == (
        256, 2048, 64)
    paths = a.get("/openapi.json").json()["paths"]
    assert {"/v1/collections", "/v1/collections/{collection_id}", "/v1/collections/{collection_id}/documents",
            "/v1/collections/{collection_id}/documents/{document_id}"} <= set(paths)
    assert "patch" in paths["/v1/documents/{document_id}"]
