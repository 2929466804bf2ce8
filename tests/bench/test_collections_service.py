"""bench.collections' ingest, quality and ttft sections at tiny sizes (a few library documents, 2 QA documents + 3
distractors, a 1024-token window, one round): a real server each, over HTTP, and every field the full run reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import collections_service
from bench.collections import SECTIONS, main
from bench.collections_service import Upload, request_groups

pytestmark = pytest.mark.real_model  # the bundled SmolLM2 and MiniLM, served for real

TINY = ["--sections", "ingest,quality,ttft", "--library-docs", "6", "--upload-batch", "4", "--ingest-variants",
        "no_kv_cache", "--poll-s", "0.2", "--server-max-context", "1024", "--quality-docs", "2",
        "--quality-distractors", "3", "--ttft-docs", "2", "--ttft-rounds", "1", "--ttft-library-questions", "1",
        "--ttft-repeats", "1", "--ttft-pad-chunks", "1500"]


def test_requests_group_files_by_their_shared_attributes() -> None:
    uploads = [Upload(f"{i}.txt", "x", {"kind": "module" if i % 3 else "class", "tier": "bronze",
                                        "deprecated": False, "year": 2015 + i}) for i in range(7)]
    groups = request_groups(uploads, 2)
    assert sorted(i for g in groups for i in g) == list(range(7)) and all(len(g) <= 2 for g in groups)
    assert all(len({uploads[i].attributes["kind"] for i in g}) == 1 for g in groups)
    assert groups[0] == [0, 3]  # the library's order within a group


def test_the_tiny_sections_write_every_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collections_service, "_LIBRARY", None)
    path = tmp_path / "collections.json"
    path.write_text(json.dumps({"benchmark": "collections", "sections": {"search": {"kept": True}}, "runs": []}))
    assert main([*TINY, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["sections"]["search"] == {"kept": True} and {"ingest", "quality", "ttft"} <= set(SECTIONS)

    ingest = doc["sections"]["ingest"]
    text = ingest["text"]
    assert text["documents"] == 6 and text["licence"] == "PSF-2.0" and text["chars"] > 6000
    assert text["embedder_tokens"] > 0 and text["windows"] >= 6 and ingest["windows_match_store"] is True
    row = ingest["variants"]["no_kv_cache"]
    assert row["ready"] == 6 and row["failed"] == 0 and row["collection"]["chunks"] >= 6
    assert row["upload"]["requests"] >= 2 and row["upload"]["files"] == 6 and row["upload"]["patch_ms"]["n"] == 6
    assert row["documents_per_minute"] > 0 and row["embedded_tokens_per_s"] > 0 and "overhead" in row
    assert row["server_cpu_s"] > 0 and len(row["documents_per_minute_by_quarter"]) == 4
    assert ingest["embed_alone"]["tokens_per_s"] > 0 and len(ingest["embed_alone"]["per_document_s"]) == 2
    assert set(ingest["goal"]["met"]) == {"no_kv_cache"} and ingest["upload_ms_per_file"] > 0

    quality = doc["sections"]["quality"]
    assert quality["distractors"] == 3 and len(quality["qa_documents"]) == 2 and quality["questions"] > 0
    for name in ("named", "named_held_out", "collection_asked", "collection_held_out"):
        assert {"best_source_holds_evidence", "evidence_in_sources", "evidence_rank_mean", "mrr",
                "evidence_in_prompt"} <= set(quality[name])
    assert quality["collection_asked"]["questions"] == quality["questions"]
    assert quality["named"]["best_source_holds_evidence"] > 0 and quality["sources_match_ranking"] is True
    assert quality["collection_context"] == ["chunks"]  # past the 1024-token window

    ttft = doc["sections"]["ttft"]
    fit = ttft["fits_window"]
    assert fit["cold_really_cold"] is True and fit["contexts"] == ["documents"] and len(fit["rounds"]) == 1
    for key in ("collection_cold", "collection_warm", "one_cold", "one_warm"):
        assert fit[key]["ttft_ms_median"] > 0 and fit[key]["first_token_ms_median"] > 0
    assert fit["collection_warm"]["prefix_reused_tokens"][0] > 0
    past = ttft["past_window"]
    assert past["padding"]["vectors"] >= 1500 and past["padding"]["vectors_after_sync"] == past["padding"]["vectors"]
    for phase in ("as_ingested", "padded"):
        assert past[phase]["rank_library_ms_median"] > 0 and past[phase]["ttft_ms_median"] > 0
        assert past[phase]["questions"][0]["ask"]["context"] == "chunks"
        assert set(past[phase]["index_call_ms_median"]) == {"search", "lexical", "term_stats"}
    assert past["estimate_100k_ttft_ms"] > past["estimate_100k_ms"] > 0 and {"max_retrieval_share", "met"} <= set(
        past["goal"])
