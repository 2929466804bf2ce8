"""bench.collections' search section on a tiny index (2,000 chunks, ``exact_max`` lowered so that the flat index
turns into HNSW and the graph path runs): the JSON holds every measure the full run reports, the exact path and the
brute force agree, and a later run merges its sizes into the file instead of replacing the section."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.collections import SECTIONS, main
from bench.collections_search import KS, Corpus, brute_force

TINY = ["--sections", "search", "--sizes", "2000", "--exact-max", "500", "--embed-questions", "0",
        "--queries", "20", "--lexical-queries", "8", "--rounds", "1"]


def test_brute_force_finds_each_stored_vector_first() -> None:
    corpus = Corpus.make(500, seed=3)
    assert corpus.n_docs == 10 and np.allclose(np.linalg.norm(corpus.vectors, axis=1), 1, atol=1e-5)
    rows = np.arange(500)
    found = brute_force(corpus.vectors, rows, corpus.vectors[[7, 123, 499]], 10)
    assert [int(f[0]) for f in found] == [7, 123, 499] and all(len(f) == 10 for f in found)
    inside = brute_force(corpus.vectors, corpus.rows([2]), corpus.vectors[[7]], 10)[0]
    assert set(inside.tolist()) <= set(range(100, 150))  # only the allowed document's rows


def test_the_quick_search_section_writes_every_field(tmp_path: Path) -> None:
    path = tmp_path / "collections.json"
    assert main([*TINY, "--json", str(path), "--sweep-sizes", "2000", "--sweep-m", "16", "--sweep-efc", "40",
                 "--sweep-ef", "32,64"]) == 0
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "collections" and doc["machine"]["cpu_flags"] is not None and doc["started"]
    search = doc["sections"]["search"]
    size = search["sizes"]["2000"]
    assert size["kind"] == "hnsw" and size["build"]["rebuild_to_hnsw"]["at_vectors"] > 500
    assert size["build"]["add_total_s"] > 0 and size["incremental_add"]["median_ms"] > 0
    assert size["memory"]["rss_bytes_per_chunk"] is not None and size["memory"]["sqlite_bytes_per_chunk"] > 0
    cells = size["search"]
    for k in KS:
        for name in ("none", "10pct", "10pct_in", "1pct", "1pct_in"):
            cell = cells[f"k{k}/{name}"]
            assert {"p50_ms", "p99_ms", "p99_ms_rounds", "recall@10", f"recall@{k}", "path"} <= set(cell)
            if cell["path"] == "exact":
                assert cell["recall@10"] == 1.0  # the exact path is the brute force
    assert cells["k10/none"]["path"].startswith("graph") and cells["k10/none"]["recall@10"] > 0.5
    assert set(size["goal"]) >= {"met", "failing", "worst_p99_ms", "worst_recall@10"}
    lexical = size["lexical"]
    assert {"zipf/k64/none", "topical/k10/1pct", "zipf/term_stats"} <= set(lexical)
    assert lexical["topical/k64/10pct"]["fill"] is not None and "recall_vs_fts5" in lexical["topical/k64/10pct"]
    removal = size["removal"]
    assert removal["removed_documents"] == 8 and removal["remove_ms"]["n"] == 8 and removal["compact_s"] >= 0
    assert removal["vectors_after_compact"] == 1600 and "k10/none" in removal["search_after"]
    sweep = search["sweeps"]["2000"]
    assert {(r["hnsw_m"], r["ef_search"], r["k"]) for r in sweep["grid"]} >= {(16, 32, 10), (16, 64, 64)}
    assert {r["path"] for r in sweep["filter_share_curve"]} >= {"exact"} and "best" in sweep
    assert {(c["hnsw_m"], c["hnsw_ef_construction"]) for c in sweep["build_cost"]} == {(16, 40), (32, 80)}
    assert size["snapshot"]["reopened_same"] and size["snapshot"]["bytes_per_chunk"] > 1536

    assert main([*TINY[:3], "1000", *TINY[4:], "--no-lexical", "--no-removal", "--json", str(path),
                 "--sweep-sizes", "none"]) == 0  # a second run: its size is merged in beside the first
    again = json.loads(path.read_text())
    merged = again["sections"]["search"]
    assert set(merged["sizes"]) == {"1000", "2000"} and set(merged["sweeps"]) == {"2000"}
    assert len(again["runs"]) == 2 and set(SECTIONS) >= {"search"}
