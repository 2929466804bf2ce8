"""Decoding benchmark: long-document QA prompts on the target, greedy, methods side by side, per context length.

    python -m bench.decode [--quick] [--json PATH] [--methods NAME ...] [--repeats N] [--threads N]
                           [--contexts 3500 7500] [--kv-dtype auto|float16|float32|int8] [--cpu-quant ...]
                           [--cpu-isa auto|avx2|avx512|amx]

Every method runs on the same prompts in one process with the same threads, interleaved per prompt
(rep -> prompt -> method, the methods' order rotated per prompt and repetition: method_order), after one
warm-up run each. Figures, as the papers report them:

- decode throughput: tokens after the first / seconds after the first token; speedup = method / ours
  autoregressive on the same prompt (median of repetitions), then median and min over prompts;
- prefill (time to first token) and end-to-end seconds, reported beside it, separately;
- acceptance length: tokens emitted per target forward after prefill (1.0 for plain decoding);
- lossless: every method's token ids equal our autoregressive token ids (a mismatch is a bug);
- ttft_repeat_ratio: TTFT of a first question over TTFT of the same question asked again on the same
  ~7K-token document, where the engine reuses the cached document prefix KV;
- the team scenario (``bench.decode_team``, ``--team-methods``): per document ten questions by different sessions
  of one tenant, paraphrased and repeated ones among them, each method learning across sessions as the service
  does; speed-ups per question and by kind (first, paraphrase, repeat), acceptance by source.

Methods: ``autoregressive`` (our engine, no drafter), one entry per drafter set in ``DRAFTERS`` (adding a
speculative method is one line there), and references whose output is not expected to equal ours (their
agreement is reported, they are left out of ``all_lossless``): ``llama_cpp`` (llama.cpp's greedy decoding of
the same GGUF file, same prompt token ids, same thread count; ``pip install -e .[bench]``) and
``autoregressive_kv_fp32`` / ``_kv_fp16`` / ``_kv_int8`` (our decoding with another KV cache storage, same weights).
On the torch runtime (``--cpu-quant none``) ``hf_generate`` and ``hf_prompt_lookup`` (HF generate, with
prompt_lookup_num_tokens=10) are available too.

Per context length (``--contexts``: documents cut to that many tokens; only documents that long take part)
the JSON also reports cold prefill throughput (ours and llama.cpp's), the verify-cost curve (a forward over
2 / 4 / 8 / 16 draft nodes relative to a plain step; llama.cpp evaluating as many tokens at once), and the
resident memory of each served model.
"""


from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, DocQA, load_target, machine_info, qa_documents, rss_mb, write_json
from bench.decode_cases import RagContext, make_cases
from bench.decode_measure import (
    TTFT_DOC,
    gguf_of,
    lm_drafter_costs,
    lm_forward_vs_step,
    measure_prefill,
    measure_ttft_repeat,
    noise,
    source_shares,
    summarize,
    summarize_case,
    verify_curve,
)
from bench.decode_methods import (
    DRAFTERS,
    ENGINE_CONFIG,
    KV_TWINS,
    LLAMA_REFS,
    SYSTEM,
    Bench,
    Case,
    Run,
    all_methods,
    default_methods,
)
from bench.decode_team import run_team
from bench.llama_ref import open_workers
from decoding.cache.prefix import PrefixCache
from decoding.runtime import kernels
from decoding.runtime.interface import RowKernels
from decoding.runtime.kernels import kernels_active
from decoding.runtime.loader import LoadOptions
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.calibration import calibrate
from decoding.speculative.engine import Engine

logger = logging.getLogger("bench.decode")

QUICK_DOCS = {3500: ("mpl-2.0",), 7500: ("gpl-3.0",)}  # one document per context length in --quick


def method_order(names: Sequence[str], turn: int) -> list[str]:
    """The methods in the order a prompt's repetition runs them: ``names`` rotated by ``turn`` (the repetition plus
    the prompt's index), so over as many prompts as there are methods each runs once in every position: in a fixed
    order the method run last of a prompt's measured slower than the same decoding run earlier
    (docs/benchmarks.md#decoding)."""
    k = turn % len(names)
    return [*names[k:], *names[:k]]


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    before = rss_mb()
    kernels.configure(isa=args.cpu_isa)  # KernelUnavailable: a path this CPU lacks
    options = LoadOptions(cpu_quant=args.cpu_quant, kv_dtype=args.kv_dtype)
    target = load_target(args.model, Path(args.data_dir), options=options)
    target_rss = rss_mb() - before
    methods = all_methods(target)
    wanted = [m for m in LLAMA_REFS if args.methods is None or m in args.methods]
    llama = open_workers(gguf_of(args.model, Path(args.data_dir)), threads, wanted)
    for name in sorted(set(wanted) - set(llama)):
        logger.warning("%s not built (scripts/build-llama-cpp, make bench): left out", name)
    names = ["autoregressive", *[m for m in (args.methods or default_methods(methods, list(llama)))
                                 if m != "autoregressive"]]
    unknown = [m for m in names if m not in methods]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {sorted(methods)}")

    cases: list[Case] = []
    rag = RagContext(target.tokenizer) if any(n.startswith(("rapid", "combined", "auto")) for n in names) else None
    for context in args.contexts:
        docs = qa_documents(QUICK_DOCS.get(context, QUICK_DOCS[3500]) if args.quick else None)
        min_tokens = int(0.9 * context) if context > 4000 else 0  # the long class: documents that fill it
        cases += make_cases(target, docs, args.questions, args.max_new_tokens, context, min_tokens, rag)
    # Our methods share the document prefix KV (as in the service); speedups compare decode throughput.
    engine = Engine(target, PrefixCache(byte_budget=6 << 30), config=ENGINE_CONFIG)
    calibrate(engine)
    other_kv = {}
    for name in names:
        if name.startswith("autoregressive_kv_"):
            from decoding.runtime.quantized import QuantizedModel

            kv = KV_TWINS[name.removeprefix("autoregressive_kv_")]
            assert isinstance(target.model, QuantizedModel)  # the twins are the quantized runtime's (all_methods)
            twin = dataclasses.replace(target, model=QuantizedModel(target.model.weights, kv, target.model.rope_tag))
            other_kv[name.removeprefix("autoregressive_kv_")] = Engine(twin, PrefixCache(byte_budget=6 << 30),
                                                                       config=ENGINE_CONFIG)
    bench = Bench(target, engine, args.max_new_tokens, cases, llama, other_kv)

    warmup = make_cases(target, [DocQA(d.name, d.text[:1500], d.questions) for d in qa_documents()[:1]], 1, 8,
                        rag=rag)[0]
    for name in names:
        methods[name](dataclasses.replace(bench, max_new_tokens=8), warmup)

    runs: dict[str, dict[str, list[Run]]] = {c.name: {m: [] for m in names} for c in cases}
    for rep in range(args.repeats):
        for index, case in enumerate(cases):
            for name in method_order(names, rep + index):
                run = methods[name](bench, case)
                runs[case.name][name].append(run)
                logger.info(
                    "rep %d %s %-22s %5.1f tok/s  ttft %.2fs  accept %.2f  %d tokens",
                    rep + 1,
                    case.name,
                    name,
                    run.decode_tps,
                    run.ttft_s,
                    run.acceptance_length,
                    len(run.tokens),
                )

    results = []
    for case in cases:
        reference = runs[case.name]["autoregressive"][0].tokens
        results.append(
            {
                "name": case.name,
                "context": case.context,
                "question": case.question,
                "prompt_tokens": len(case.prompt.ids),
                "answer": target.tokenizer.decode(reference),
                "methods": summarize_case(runs[case.name], reference),
            }
        )

    contexts: dict[str, Any] = {}
    for context in args.contexts:
        subset = [r for r in results if r["context"] == context]
        if not subset:
            continue
        longest = max((c for c in cases if c.context == context), key=lambda c: len(c.prompt.ids))
        contexts[str(context)] = {
            **summarize(subset, names),
            "prefill": measure_prefill(bench, longest, 1 if args.quick else 2),
            "verify_cost": verify_curve(bench, len(longest.prompt.ids), 3 if args.quick else 5),
        }
        timed = lm_forward_vs_step(bench, longest, 15 if args.quick else 30) if "rapid_kv" in names else None
        contexts[str(context)]["rapid_kv_forward"] = timed
        contexts[str(context)]["lm_drafter_costs"] = lm_drafter_costs(
            subset, names, contexts[str(context)]["verify_cost"]["ours_vs_step"], timed)
        logger.info("context %d: %s", context, {k: v for k, v in contexts[str(context)].items() if k.startswith("vs_")})

    team = None
    if args.team_methods:
        team = run_team(bench, args.team_methods, args.repeats, args.team_context,
                        docs=["mpl-2.0"] if args.quick else None)
        logger.info("team scenario: %s", team["speedup_by_kind"])

    [ttft_doc] = qa_documents([TTFT_DOC])
    ttft = measure_ttft_repeat(target, ttft_doc, 1 if args.quick else 2, None)  # always the whole ~7K-token document

    overall = summarize(results, names)
    summary = {
        "all_lossless": overall["all_lossless"] and (team is None or team["all_lossless"]),
        "ttft_repeat_ratio": ttft["ratio"],
        "methods": {k: v for k, v in overall["methods"].items() if k != "autoregressive"},
        "contexts": {
            c: {k: v for k, v in row.items() if k in ("prompts", "all_lossless") or k.startswith("vs_llama")}
            | {"ar_tokens_per_second_median": row["methods"]["autoregressive"]["tokens_per_second_median"],
               "verify_8_nodes_vs_step": row["verify_cost"]["ours_vs_step"].get("8"),
               "verify_16_nodes_vs_step": row["verify_cost"]["ours_vs_step"].get("16"),
               "prefill_tokens_per_s": row["prefill"]["ours_tokens_per_s"],
               "prefill_ours_vs_llama_cpp": row["prefill"].get("ours_vs_llama_cpp")}
            for c, row in contexts.items()
        },
    }
    if team is not None:
        summary["team"] = team["speedup_by_kind"]
    for worker in llama.values():
        worker.close()
    per_method = {name: overall["methods"][name] for name in names}
    sources = {name: source_shares(results, name) for name in names if name in DRAFTERS or "@" in name}
    return {
        "benchmark": "decode",
        "config": {
            "model": target.name,
            "runtime": target.runtime,
            "device": str(target.device),
            "dtype": str(target.dtype).removeprefix("torch."),
            "quick": args.quick,
            "repeats": args.repeats,
            "max_new_tokens": args.max_new_tokens,
            "contexts": args.contexts,
            "methods": names,
            "greedy": True,
            "system": SYSTEM,
            "threads": threads,
            "verify_cost_s": {str(k): round(v, 5) for k, v in sorted(engine.policy.cost_s.items())},
            "verify_cost_context": engine.policy.cost_context,
            # per forward rows (index; the last: that many or more): pairs of weight groups (True) or one group at a
            # time, as the first calibration measured them on this CPU (empty: one kernel only on this path)
            "row_kernels": engine.model.row_kernels() if isinstance(engine.model, RowKernels) else [],
            "verify_cost_slope_s_per_1k_tokens": {
                str(k): round(1000 * v, 5) for k, v in sorted(engine.policy.cost_slope.items())
            },
            "cpu_kernels": target.runtime.startswith("cpu-quantized")
            or (isinstance(target.model, TorchRuntime) and kernels_active(target.model.module)),
            "llama_cpp": {name: worker.info for name, worker in llama.items()},
        },
        "memory": {
            "served_weights_mb": round(target.weight_bytes / 1e6, 1),
            "target_rss_mb": round(target_rss, 1),
            **{f"{name}_rss_mb": worker.info["rss_mb"] for name, worker in llama.items()},
        },
        "noise": noise(runs),
        "sources": sources,
        "acceptance_by_kind": {
            k: {"rate": round(r, 4), "tested": n} for k, (r, n) in sorted(engine.policy.acceptance.snapshot().items())
        },
        "machine": machine_info(),
        "cases": results,
        "contexts": contexts,
        "ttft_repeat": ttft,
        "team": team,
        "per_method": per_method,
        "summary": summary,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1 prompt per context length, 1 repetition, 48 new tokens (minutes)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--methods", nargs="+", default=None, help="subset of methods (autoregressive always runs)"
    )
    p.add_argument("--repeats", type=int, default=None, help="repetitions per prompt (default 3; quick 1)")
    p.add_argument("--questions", type=int, default=None, help="questions per document (default 3; quick 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 48")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--contexts", type=int, nargs="+", default=[3500, 7500],
                   help="context length classes: documents cut to this many tokens (default 3500 7500)")
    p.add_argument("--team-methods", nargs="*", default=["auto", "racer", "suffix"],
                   help="methods of the team scenario (none: skip it)")
    p.add_argument("--team-context", type=int, default=3500, help="the team scenario's documents cut to this")
    p.add_argument("--model", default="bundled", help="target: 'bundled', a GGUF file, a local HF dir or hub id")
    p.add_argument("--data-dir", default=str(REPO / "data"), help="where the bundled model lives")
    p.add_argument("--cpu-quant", default="auto", help="CPU target weights: auto, q8_0, q4_1, none (torch fp32)")
    p.add_argument("--cpu-isa", default="auto", choices=["auto", *kernels.ISAS],
                   help="ISA path of the CPU kernels (auto: the best this CPU runs)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float16", "float32", "int8"],
                   help="KV cache of the quantized CPU runtime")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.questions = args.questions or (1 if args.quick else 3)
    args.max_new_tokens = args.max_new_tokens or (48 if args.quick else 128)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    result = run_benchmark(args)
    if args.json:
        write_json(args.json, result)
        logger.info("wrote %s", args.json)
    summary = result["summary"]
    sys.stdout.write(
        f"all_lossless={summary['all_lossless']}  ttft_repeat_ratio={summary['ttft_repeat_ratio']}\n"
    )
    for name, row in summary["methods"].items():
        sys.stdout.write(
            f"{name:24s} {row['tokens_per_second_median']:6.1f} tok/s  speedup median "
            f"{row['speedup_vs_ar_median']:.3f}  min {row['speedup_vs_ar_min']:.3f}  "
            f"acceptance {row['acceptance_length_median']:.2f}\n"
        )
    for context, row in summary["contexts"].items():
        sys.stdout.write(f"context {context}: {json.dumps(row)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
