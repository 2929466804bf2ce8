"""Many people at once: aggregate tokens/s, time to first token and per-request tokens/s at 1, 2, 4 and 8 concurrent
generations on the bundled model, batched (every generation in its own thread, their forwards shared) against the
same requests one at a time, in one run.

Two scenarios: (a) every user asks a different question about one ~3.5K-token document, (b) each user asks about a
different document. The documents' KV is warmed first (as the service does at upload), so a request reads its
document from the prefix cache and prefills its question; greedy, ``--max-new`` tokens each. Plain batched decoding
(``autoregressive``) and with prompt-lookup speculation on (``prompt_lookup``). Every batched answer is checked
against its one-at-a-time answer, token for token.

The reference (``llama_cpp_batched``, where ``make bench`` built it): llama.cpp (its best build here,
``bench.llama_ref``) decoding the same prompts as one batch through its low-level API, one sequence id per user,
each on its own KV stream (one unified cache whose document cells every user's id labels, ``llama_memory_seq_cp``, when
they share a document), each document evaluated once before the clock, greedy, ``--max-new`` tokens per user (EOS
does not end a sequence, so its batches stay whole; every decoded token counts), same GGUF and threads.

    python -m bench.concurrency [--users 1 2 4 8] [--max-new 64] [--repeats 2] [--modes autoregressive prompt_lookup]
        [--kv-dtype auto|float16|bfloat16|int8]

Writes ``bench/results/concurrency.json``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.serving.kv_tuning import START_CONTEXTS
from bench.common import REPO, load_target, machine_info, median, out, qa_documents, write_json
from bench.decode_cases import make_cases
from bench.decode_measure import gguf_of
from bench.decode_methods import Case
from bench.llama_ref import LlamaWorker, open_workers
from decoding.cache.prefix import PrefixCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.runtime.loader import LoadOptions
from decoding.speculative.calibration import calibrate
from decoding.speculative.drafter import Drafter
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, TokenEvent

RESULTS = REPO / "bench" / "results" / "concurrency.json"
DOC_TOKENS = 3500
MODES: dict[str, Callable[[], Sequence[Drafter]]] = {
    "autoregressive": lambda: (),
    "prompt_lookup": lambda: (PromptLookupDrafter(),),
}


@dataclass
class Answer:
    tokens: list[int]
    ttft_s: float  # from the moment the whole group was started
    end_s: float


def answer(engine: Engine, case: Case, config: GenerationConfig, drafters: Sequence[Drafter], t0: float) -> Answer:
    ttft, done = None, None
    for event in engine.generate(case.prompt, config, drafters):
        if isinstance(event, TokenEvent) and ttft is None and event.token_ids:
            ttft = time.perf_counter() - t0
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    end = time.perf_counter() - t0
    return Answer(done.token_ids, ttft if ttft is not None else end, end)


def one_at_a_time(engine: Engine, cases: Sequence[Case], config: GenerationConfig,
                  mode: Callable[[], Sequence[Drafter]]) -> tuple[list[Answer], float]:
    """The requests arrive together and are served in turn (today's scheduler with one slot)."""
    t0 = time.perf_counter()
    answers = [answer(engine, case, config, mode(), t0) for case in cases]
    return answers, time.perf_counter() - t0


def batched(engine: Engine, cases: Sequence[Case], config: GenerationConfig,
            mode: Callable[[], Sequence[Drafter]]) -> tuple[list[Answer], float]:
    """The requests arrive together and run at once, each in its own thread (the scheduler's slots)."""
    answers: list[Answer | None] = [None] * len(cases)
    start = threading.Barrier(len(cases) + 1)

    def go(i: int) -> None:
        start.wait()
        answers[i] = answer(engine, cases[i], config, mode(), t0)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None], wall


def summary(answers: Sequence[Answer], wall: float) -> dict[str, Any]:
    tokens = sum(len(a.tokens) for a in answers)
    ttfts = sorted(a.ttft_s for a in answers)
    rates = [len(a.tokens) / max(a.end_s - a.ttft_s, 1e-9) for a in answers if len(a.tokens) > 1]
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p95_s": round(ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))], 3),
        "per_request_tok_s": round(statistics.median(rates), 2) if rates else None,
    }


def llama_batched(worker: LlamaWorker, cases: Sequence[Case], max_new: int) -> dict[str, Any]:
    """llama.cpp's batched decoding of the same prompts (``LlamaWorker.batch``: ``max_new`` tokens each, EOS or
    not), summarised as ours is."""
    reply = worker.batch([list(c.prompt.ids) for c in cases], [len(c.prompt.prefix_ids) for c in cases], max_new)
    answers = [Answer(tokens, ttft, end) for tokens, ttft, end in zip(reply["tokens"], reply["ttft_s"],
                                                                      reply["end_s"], strict=True)]
    return summary(answers, reply["wall_s"])


def scenario_cases(target: Any, users: int, same_document: bool, max_new: int) -> list[Case]:
    from bench.datasets import load_qa

    docs = qa_documents([d.doc_id for d in load_qa()])
    if same_document:
        cases = make_cases(target, docs, 8, max_new, max_doc_tokens=DOC_TOKENS, min_doc_tokens=DOC_TOKENS)
        first = cases[0].name.split("/")[0]
        return [c for c in cases if c.name.startswith(first + "/")][:users]
    cases = make_cases(target, docs, 1, max_new, max_doc_tokens=DOC_TOKENS, min_doc_tokens=DOC_TOKENS)
    return cases[:users]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float16", "bfloat16", "int8"],
                    help="the target's KV cache storage (RAGSPEC_KV_DTYPE)")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(threads=args.threads, options=LoadOptions(kv_dtype=args.kv_dtype))
    engine = Engine(target, PrefixCache(4 << 30))
    if engine.batcher is None:
        raise SystemExit("the target runtime does not batch forwards (the quantized CPU runtime does)")
    calibrate(engine, START_CONTEXTS)  # the verify costs the service measures at start-up (its budget policy's)
    config = GenerationConfig(max_new_tokens=args.max_new)
    llama = open_workers(gguf_of("bundled", REPO / "data"), args.threads, ["llama_cpp"]).get("llama_cpp")
    if llama is None:
        out("llama_cpp not built (scripts/build-llama-cpp, make bench): its batched reference left out")
    most = max(args.users)
    scenarios = {"one_document": scenario_cases(target, most, True, args.max_new),
                 "different_documents": scenario_cases(target, most, False, args.max_new)}
    for name, cases in scenarios.items():
        if len(cases) < most:
            raise SystemExit(f"{name}: {len(cases)} cases of >= {DOC_TOKENS} tokens, {most} users asked for")
        for case in cases:  # the documents' KV, as warmed at upload
            engine.warm_prefix(case.prompt)
        out(f"{name}: documents {sorted({c.name.split('/')[0] for c in cases})}, prompts "
            f"{[len(c.prompt.ids) for c in cases]}")

    gc.collect()
    gc.freeze()  # as the service does after start-up
    results: dict[str, Any] = {}
    for scenario, cases in scenarios.items():
        if llama is not None:
            reference = {}
            for users in args.users:
                runs_l = [llama_batched(llama, cases[:users], args.max_new) for _ in range(args.repeats)]
                reference[str(users)] = {**_median_runs(runs_l), "runs": runs_l}
                out(f"{scenario:20s} llama_cpp batched users {users}: aggregate "
                    f"{reference[str(users)]['aggregate_tok_s']:7.1f} tok/s, ttft p50 "
                    f"{reference[str(users)]['ttft_p50_s']:.2f} s")
            results.setdefault(scenario, {})["llama_cpp_batched"] = reference
        for mode_name in args.modes:
            mode = MODES[mode_name]
            rows: dict[str, Any] = {}
            for users in args.users:
                group = cases[:users]
                runs: dict[str, list[dict[str, Any]]] = {"one_at_a_time": [], "batched": []}
                equal = True
                for _ in range(args.repeats):
                    solo, solo_wall = one_at_a_time(engine, group, config, mode)
                    together, wall = batched(engine, group, config, mode)
                    equal &= [a.tokens for a in solo] == [a.tokens for a in together]
                    runs["one_at_a_time"].append(summary(solo, solo_wall))
                    runs["batched"].append(summary(together, wall))
                row: dict[str, Any] = {k: _median_runs(v) for k, v in runs.items()}
                row["aggregate_vs_one_at_a_time"] = round(
                    row["batched"]["aggregate_tok_s"] / row["one_at_a_time"]["aggregate_tok_s"], 3)
                row["answers_equal"] = equal
                if llama is not None:
                    ref = results[scenario]["llama_cpp_batched"][str(users)]["aggregate_tok_s"]
                    row["batched_vs_llama_cpp_batched"] = round(row["batched"]["aggregate_tok_s"] / ref, 3)
                row["runs"] = runs
                rows[str(users)] = row
                out(f"{scenario:20s} {mode_name:15s} users {users}: aggregate {row['batched']['aggregate_tok_s']:7.1f}"
                    f" tok/s vs {row['one_at_a_time']['aggregate_tok_s']:7.1f} one at a time "
                    f"({row['aggregate_vs_one_at_a_time']:.2f}x), ttft p50 {row['batched']['ttft_p50_s']:.2f} s "
                    f"(one at a time {row['one_at_a_time']['ttft_p50_s']:.2f} s), equal {equal}")
            results.setdefault(scenario, {})[mode_name] = rows
    for scenario in results:  # speculation inside the batch against plain batched decoding
        modes = results[scenario]
        if "autoregressive" in modes and "prompt_lookup" in modes:
            for users in modes["autoregressive"]:
                plain = modes["autoregressive"][users]["batched"]["aggregate_tok_s"]
                spec = modes["prompt_lookup"][users]["batched"]["aggregate_tok_s"]
                modes["prompt_lookup"][users]["batched_vs_plain_batched"] = round(spec / plain, 3)
    stats = engine.batcher.stats
    llama_info = llama.info if llama is not None else None
    if llama is not None:
        llama.close()
    write_json(args.json, {
        "benchmark": "concurrency",
        "command": "python -m bench.concurrency " + " ".join(argv or []),
        "machine": machine_info(),
        "setup": {"document_tokens": DOC_TOKENS, "kv_dtype": str(getattr(target.model, "kv_dtype", args.kv_dtype)),
                  "max_new_tokens": args.max_new, "repeats": args.repeats,
                  "threads": args.threads, "greedy": True, "documents_warmed": True,
                  "prefill_rows_per_step": engine.batcher.prefill_rows},
        "batcher": {"forwards": stats.forwards, "sequences": stats.sequences, "rows": stats.rows},
        "llama_cpp": llama_info,
        "results": results,
    })
    out(f"wrote {args.json}")
    return 0


def _median_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {k: round(median([r[k] for r in runs if r[k] is not None]), 3) for k in keys}


if __name__ == "__main__":
    raise SystemExit(main())
