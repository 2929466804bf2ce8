"""bench.routing's simulation on a small cluster: every policy serves every request; routing by document keeps
documents warm (a higher prefix hit rate and a shorter time to first token than random or least-loaded routing) where
unbounded hashing lets a hot document's replica queue; the JSON holds every policy and the sweep."""

from __future__ import annotations

import json
from pathlib import Path

from bench.routing import POLICIES, Workload, main, simulate


def test_document_affine_routing_beats_random_and_least_loaded_on_a_skewed_workload() -> None:
    w = Workload(replicas=10, rho=0.7, requests_per_replica=200, zipf=1.1)
    got = {policy: simulate(w, policy) for policy in POLICIES}
    assert all(o.requests == 2000 - 2000 // 4 for o in got.values())  # after the warm-up quarter
    affine, hashed = got["affine"], got["hash"]
    for other in (got["random"], got["least_loaded"]):
        assert affine.hit_rate > other.hit_rate + 0.1
        assert affine.ttft_p50_s < other.ttft_p50_s
    assert affine.busiest_over_mean < hashed.busiest_over_mean  # the cap spreads a hot document's requests
    again = simulate(w, "affine")  # the same seed: the same arrivals, the same figures
    assert (again.hit_rate, again.ttft_p95_s) == (affine.hit_rate, affine.ttft_p95_s)


def test_the_bench_writes_every_policy_and_the_sweep(tmp_path: Path) -> None:
    path = tmp_path / "routing.json"
    main(["--replicas", "10", "--rho", "0.5", "--requests-per-replica", "40", "--sweep-replicas", "10",
          "--json", str(path)])
    doc = json.loads(path.read_text())
    assert [row["replicas"] for row in doc["results"]] == [10]
    assert set(doc["results"][0]["policies"]) == set(POLICIES)
    assert doc["sweep"] and doc["best_in_sweep"]["load_factor"] in {row["load_factor"] for row in doc["sweep"]}
