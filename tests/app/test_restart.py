"""Restart on the same data dir: documents, indexes and the document KV cache come back from disk; an
upload whose indexing was cut by a crash (SIGKILL of a server process) ends failed, and asking over it is
a clear 409; KV prefixes of documents that are gone are removed at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.serving.prefix_registry import PrefixRegistry
from decoding.cache.prefix import PrefixCache, PrefixEntry
from tests.app.live import (
    LANDMARKS,
    ProcessServer,
    process_env,
    service_settings,
    thread_server,
    upload_text,
    wait_for,
    wait_indexed,
)

pytestmark = [pytest.mark.real_model, pytest.mark.heavy]


def test_restart_recovers_documents_and_fails_cut_ingest(tmp_path: Path) -> None:
    settings = service_settings(tmp_path / "data")
    question = {"question": "When was the Eiffel Tower completed?", "max_tokens": 12}

    with thread_server(settings) as first, first.client() as client:
        doc = upload_text(client, LANDMARKS, title="landmarks")
        assert wait_indexed(client, doc)["status"] == "ready"
        before = client.post("/v1/ask", json={**question, "document_ids": [doc]}).json()
        wait_for(lambda: list((tmp_path / "data" / "kv").glob("*.safetensors")), "the KV prefix on disk")
    # stopped gracefully; now a server process that crashes while indexing a big upload
    crashing = ProcessServer(process_env(settings), tmp_path / "server.log")
    try:
        with crashing.client() as client:
            assert client.get(f"/v1/documents/{doc}").json()["status"] == "ready"
            big = "\n\n".join(f"Paragraph {i}: " + "lorem ipsum dolor sit amet " * 20 for i in range(1500))
            cut = upload_text(client, big, title="cut")
    finally:
        crashing.kill()

    # a KV prefix of a document that is gone (its delete died before dropping the KV): removed at start-up
    orphan = PrefixCache(byte_budget=1 << 20, persist_dir=tmp_path / "data" / "kv")
    orphan.put("orphan", PrefixEntry((torch.zeros(1, 1, 2, 4),), (torch.zeros(1, 1, 2, 4),), None), tag="orphan")
    orphan.flush()
    PrefixRegistry(tmp_path / "data" / "kv-prefixes.json").add("orphan", ["f" * 32])
    assert (tmp_path / "data" / "kv" / "orphan.safetensors").exists()

    with thread_server(settings) as third, third.client() as client:
        assert not (tmp_path / "data" / "kv" / "orphan.safetensors").exists()
        assert "orphan" not in (tmp_path / "data" / "kv-prefixes.json").read_text()
        record = client.get(f"/v1/documents/{doc}").json()
        assert record["status"] == "ready" and record["title"] == "landmarks"
        after = client.post("/v1/ask", json={**question, "document_ids": [doc]}).json()
        assert after["answer"] == before["answer"]  # same index, same greedy answer
        assert after["sources"] == before["sources"]
        assert after["stats"]["prefix_cache_hit"] is True  # the document's KV came back from disk
        cut_record = client.get(f"/v1/documents/{cut}").json()
        assert cut_record["status"] == "failed" and "interrupted" in cut_record["message"]
        refused = client.post("/v1/ask", json={**question, "document_ids": [cut]})
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "document_not_ready" and "failed" in refused.text
        assert client.delete(f"/v1/documents/{cut}").status_code == 204  # a failed upload can be removed
        assert [d["id"] for d in client.get("/v1/documents").json()["documents"]] == [doc]
