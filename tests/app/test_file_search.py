"""OpenAI's file search surface driven by the official ``openai`` client against the real server: Files (upload,
list in pages, get, content, delete), Vector Stores (create with files, list in pages both orders, get, modify,
delete), their files (add with attributes, status, filter, update, remove, content), file batches (create, get,
list, cancel while indexing) and search (filters, max results, score threshold); every refusal in OpenAI's error
shape with OpenAI's status (400 naming the field, 404 for unknown ids and another tenant's objects).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.app.live import LANDMARKS, LIGHTHOUSE, ThreadServer, wait_for
from tests.app.live import openai_refused as refused
from tests.app.slow_indexing import long_text, slow_indexing

pytestmark = pytest.mark.real_model

KEY, OTHER_KEY = "key-of-the-files-team", "key-of-someone-else"
TEA = ("Green tea is harvested in spring. The first flush of Darjeeling is picked in March and April, and its "
       "leaves are withered for about sixteen hours before rolling.")


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    return {"api_keys": f"{KEY},{OTHER_KEY}", "default_max_tokens": 12}


@pytest.fixture(scope="module")
def oa(server: ThreadServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def other(server: ThreadServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.url + "/v1", api_key=OTHER_KEY, max_retries=0) as client:
        yield client


def upload(oa: OpenAI, name: str, text: str) -> str:
    return oa.files.create(file=(name, text.encode(), "text/plain"), purpose="assistants").id


def completed(oa: OpenAI, store_id: str, file_id: str) -> Any:
    return wait_for(lambda: (f := oa.vector_stores.files.retrieve(file_id, vector_store_id=store_id)).status
                    in ("completed", "failed") and f, f"{file_id} indexed")


def test_files_upload_list_content_delete(oa: OpenAI, other: OpenAI) -> None:
    first = oa.files.create(file=("tea.txt", TEA.encode(), "text/plain"), purpose="assistants")
    assert (first.object, first.filename, first.purpose, first.bytes) == ("file", "tea.txt", "assistants", len(TEA))
    second = oa.files.create(file=("notes.md", b"# Notes\n\nSome notes about rivers.", "text/markdown"),
                             purpose="user_data")
    assert oa.files.retrieve(first.id).id == first.id
    assert wait_for(lambda: oa.files.retrieve(first.id).status == "processed", "the file indexed")
    assert oa.files.content(first.id).content == TEA.encode()  # the bytes as uploaded

    page = oa.files.list(limit=1)  # newest first, one per page: the client follows has_more / after
    assert [f.id for f in page.data] == [second.id] and page.has_more
    every = [f.id for f in oa.files.list(limit=1)]  # auto-paging over every page
    assert every[:2] == [second.id, first.id]
    assert [f.id for f in oa.files.list(order="asc", limit=100)][-2:] == [first.id, second.id]
    assert [f.id for f in oa.files.list(purpose="user_data")] == [second.id]
    assert first.id in {f.id for f in oa.files.list(purpose="assistants")} and second.id not in {
        f.id for f in oa.files.list(purpose="assistants")}

    refused(lambda: oa.files.create(file=("x.txt", b"text", "text/plain"), purpose="fine-tune"), 400, "purpose")
    refused(lambda: oa.files.create(file=("x.png", b"\x89PNG\r\n\x1a\n", "image/png"), purpose="assistants"), 415)
    refused(lambda: oa.files.list(after="not-an-id"), 400, "after")
    refused(lambda: other.files.retrieve(first.id), 404)  # another tenant's file: not found, never shown
    assert second.id not in [f.id for f in other.files.list()]

    deleted = oa.files.delete(second.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (second.id, True, "file")
    refused(lambda: oa.files.retrieve(second.id), 404)
    refused(lambda: oa.files.content(second.id), 404)


def test_a_vector_store_with_files_attributes_and_search(oa: OpenAI, other: OpenAI) -> None:
    lighthouse, landmarks = upload(oa, "lighthouse.txt", LIGHTHOUSE), upload(oa, "landmarks.txt", LANDMARKS)
    store = oa.vector_stores.create(name="library", file_ids=[lighthouse], metadata={"team": "search"},
                                    expires_after={"anchor": "last_active_at", "days": 7})
    assert (store.object, store.name, store.metadata, store.expires_after.days) == (  # type: ignore[union-attr]
        "vector_store", "library", {"team": "search"}, 7)
    assert store.file_counts.total == 1 and store.expires_at is not None
    added = oa.vector_stores.files.create(vector_store_id=store.id, file_id=landmarks,
                                          attributes={"kind": "guide", "year": 2024})
    assert (added.object, added.vector_store_id, added.attributes) == (
        "vector_store.file", store.id, {"kind": "guide", "year": 2024})
    assert added.chunking_strategy is not None and added.chunking_strategy.type == "static"
    for file_id in (lighthouse, landmarks):
        assert completed(oa, store.id, file_id).status == "completed"
    oa.vector_stores.files.update(lighthouse, vector_store_id=store.id, attributes={"kind": "history", "year": 2019})
    got = oa.vector_stores.retrieve(store.id)
    assert got.status == "completed" and got.file_counts.completed == 2 and got.usage_bytes > 0
    listed = oa.vector_stores.files.list(vector_store_id=store.id, filter="completed")
    assert {f.id for f in listed} == {lighthouse, landmarks}
    assert list(oa.vector_stores.files.list(vector_store_id=store.id, filter="failed")) == []
    content = oa.vector_stores.files.content(landmarks, vector_store_id=store.id)
    assert "".join(part.text for part in content) == LANDMARKS

    results = oa.vector_stores.search(store.id, query="Who built the lighthouse of Varnholm?")
    found = list(results)
    assert found[0].file_id == lighthouse and found[0].filename == "lighthouse.txt"
    assert found[0].attributes == {"kind": "history", "year": 2019} and "Ada Kessling" in found[0].content[0].text
    assert all(0.0 <= r.score <= 1.0 for r in found) and [r.score for r in found] == sorted(
        (r.score for r in found), reverse=True)
    guide = list(oa.vector_stores.search(store.id, query="Who built the lighthouse of Varnholm?",
                                         filters={"type": "eq", "key": "kind", "value": "guide"}))
    assert guide and {r.file_id for r in guide} == {landmarks}
    recent = list(oa.vector_stores.search(store.id, query="lighthouse", max_num_results=1,
                                          filters={"type": "and", "filters": [
                                              {"type": "gte", "key": "year", "value": 2020},
                                              {"type": "in", "key": "kind", "value": ["guide", "map"]}]}))
    assert len(recent) == 1 and recent[0].file_id == landmarks
    assert list(oa.vector_stores.search(store.id, query="lighthouse",
                                        ranking_options={"score_threshold": 1.0})) == []
    assert oa.vector_stores.retrieve(store.id).last_active_at is not None

    refused(lambda: oa.vector_stores.search(store.id, query="x", rewrite_query=True), 400, "rewrite_query")
    refused(lambda: oa.vector_stores.search(store.id, query="x", filters={"type": "near", "key": "k", "value": 1}),
            400, "filters.type")
    refused(lambda: oa.vector_stores.search(store.id, query="x", filters={"type": "eq", "key": "k", "value": [1]}),
            400, "filters.value")
    refused(lambda: oa.vector_stores.search(store.id, query="x", max_num_results=51), 400, "max_num_results")
    refused(lambda: oa.vector_stores.files.create(vector_store_id=store.id, file_id=lighthouse,
                                                  chunking_strategy={"type": "static", "static": {
                                                      "max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}}),
            400, "chunking_strategy")
    refused(lambda: oa.vector_stores.files.create(vector_store_id=store.id, file_id=lighthouse,
                                                  attributes={"k" * 65: 1}), 400)
    refused(lambda: oa.vector_stores.files.create(vector_store_id=store.id, file_id="0" * 32), 404)
    refused(lambda: oa.vector_stores.create(name="x", file_ids=["0" * 32]), 404)
    refused(lambda: oa.vector_stores.retrieve("col" + "0" * 32), 404)
    refused(lambda: other.vector_stores.retrieve(store.id), 404)  # another tenant's store
    refused(lambda: other.vector_stores.search(store.id, query="lighthouse"), 404)
    refused(lambda: other.vector_stores.files.create(vector_store_id=store.id, file_id=lighthouse), 404)

    # a file taken out is gone from the next search; the file itself stays
    removed = oa.vector_stores.files.delete(lighthouse, vector_store_id=store.id)
    assert (removed.id, removed.deleted, removed.object) == (lighthouse, True, "vector_store.file.deleted")
    after = list(oa.vector_stores.search(store.id, query="Who built the lighthouse of Varnholm?"))
    assert lighthouse not in {r.file_id for r in after}
    refused(lambda: oa.vector_stores.files.retrieve(lighthouse, vector_store_id=store.id), 404)
    assert oa.files.retrieve(lighthouse).id == lighthouse
    # deleting the file takes it out of every store
    oa.vector_stores.files.create(vector_store_id=store.id, file_id=lighthouse)
    oa.files.delete(landmarks)
    assert {f.id for f in oa.vector_stores.files.list(vector_store_id=store.id)} == {lighthouse}

    renamed = oa.vector_stores.update(store.id, name="renamed", metadata={"team": "docs"}, expires_after=None)
    assert (renamed.name, renamed.metadata, renamed.expires_after, renamed.expires_at) == (
        "renamed", {"team": "docs"}, None, None)
    gone = oa.vector_stores.delete(store.id)
    assert (gone.id, gone.deleted, gone.object) == (store.id, True, "vector_store.deleted")
    refused(lambda: oa.vector_stores.retrieve(store.id), 404)
    assert oa.files.retrieve(lighthouse).id == lighthouse  # the files stay


def test_vector_store_pages_and_an_expired_store(oa: OpenAI, server: ThreadServer) -> None:
    made = [oa.vector_stores.create(name=f"page {i}").id for i in range(3)]
    newest = [s.id for s in oa.vector_stores.list(limit=2)]  # auto-paging, newest first
    assert newest[:3] == made[::-1]
    first = oa.vector_stores.list(limit=2, order="asc")
    assert first.has_more and len(first.data) == 2
    oldest = [s.id for s in oa.vector_stores.list(limit=2, order="asc")]
    assert oldest[-3:] == made
    stale = oa.vector_stores.create(name="stale", expires_after={"anchor": "last_active_at", "days": 1})
    server.services.store.touch_collections([stale.id], at=time.time() - 2 * 86_400)
    assert oa.vector_stores.retrieve(stale.id).status == "expired"
    refused(lambda: oa.vector_stores.search(stale.id, query="anything"), 400, "vector_store_id")
    refused(lambda: oa.vector_stores.list(limit=101), 400, "limit")
    refused(lambda: oa.vector_stores.list(before=made[0]), 400, "before")  # pages forward only, said by name
    refused(lambda: oa.vector_stores.create(name="x", metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata")
    refused(lambda: oa.vector_stores.create(name="x", expires_after={"anchor": "created_at", "days": 1}), 400)


def test_file_batches_and_cancel_while_indexing(oa: OpenAI, server: ThreadServer) -> None:
    store = oa.vector_stores.create(name="batches")
    ready = [upload(oa, f"ready{i}.txt", f"Ready note {i} about the harbour of Varnholm.") for i in range(2)]
    for file_id in ready:
        wait_for(lambda f=file_id: oa.files.retrieve(f).status == "processed", "indexed")
    batch = oa.vector_stores.file_batches.create(vector_store_id=store.id, file_ids=ready,
                                                 attributes={"source": "batch"})
    assert (batch.object, batch.vector_store_id, batch.file_counts.total) == ("vector_store.files_batch", store.id, 2)
    done = wait_for(lambda: (b := oa.vector_stores.file_batches.retrieve(batch.id, vector_store_id=store.id)).status
                    == "completed" and b, "the batch done")
    assert done.file_counts.completed == 2
    files = oa.vector_stores.file_batches.list_files(batch.id, vector_store_id=store.id)
    assert {f.id for f in files} == set(ready) and all(f.attributes == {"source": "batch"} for f in files)

    with slow_indexing(server, pause_s=0.5):  # the worker embeds slowly: these stay in progress
        slow = [upload(oa, f"slow{i}.txt", long_text()) for i in range(3)]
        oa.vector_stores.files.create(vector_store_id=store.id, file_id=slow[2])  # in the store before the batch
        pending = oa.vector_stores.file_batches.create(vector_store_id=store.id, file_ids=slow)
        assert pending.status == "in_progress" and pending.file_counts.in_progress == 3
        cancelled = oa.vector_stores.file_batches.cancel(pending.id, vector_store_id=store.id)
    assert cancelled.status == "cancelled" and cancelled.file_counts.cancelled == 2  # the batch's own two
    one_by_one = [f.id for f in oa.vector_stores.files.list(vector_store_id=store.id, filter="cancelled", limit=1)]
    assert sorted(one_by_one) == sorted(slow[:2])  # paged one at a time after each page's last id
    assert {f.id for f in oa.vector_stores.files.list(vector_store_id=store.id)} == {*ready, slow[2]}
    assert oa.vector_stores.retrieve(store.id).file_counts.cancelled == 2
    assert oa.files.retrieve(slow[0]).id == slow[0]  # still a file
    refused(lambda: oa.vector_stores.file_batches.retrieve("vsfb_unknown", vector_store_id=store.id), 404)


def test_errors_keep_ragspec_shape_outside_the_openai_surface(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        body = c.post("/v1/collections", json={"name": ""}).json()
        assert set(body["error"]) == {"code", "message"}  # ragspec's API: 422 as before
        body = c.post("/v1/vector_stores", json={"name": "x", "unknown": 1})
        assert body.status_code == 400 and body.json()["error"]["param"] == "unknown"
        offered = c.get("/v1/capabilities").json()["file_search"]
        assert offered["tools"] == ["file_search"] and offered["purposes"] == ["assistants", "user_data"]
        assert offered["max_chunk_size_tokens"] == server.services.indexing.config.chunk_tokens
