"""bench.decode's measurements: losslessness, speed-ups and source shares per prompt and overall, the noise band,
cold prefill, the verify-cost curve and TTFT of a repeated question."""


from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import DocQA, median
from bench.decode_cases import make_cases
from bench.decode_methods import ENGINE_CONFIG, LLAMA_REFS, REFERENCES, Bench, Case, Run
from decoding.cache.prefix import PrefixCache
from decoding.cache.slot import SlotCache
from decoding.drafters.rapid import RapidKVDrafter
from decoding.runtime import kernels
from decoding.runtime.loader import LoadedModel
from decoding.runtime.quantized import QuantizedModel
from decoding.speculative.budget import _interpolate
from decoding.speculative.calibration import time_verifies, verify_costs
from decoding.speculative.drafter import DraftRequest, PromptInfo
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt

logger = logging.getLogger("bench.decode")

TTFT_DOC = "gpl-3.0"  # ~7.6K tokens
VERIFY_NODES = (0, 2, 4, 8, 16, 32, 64)  # draft nodes per verify forward in the cost curve (0: a plain step)

# ---- measurement ------------------------------------------------------------------------------------


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _sum_sources(rows: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def source_shares(results: Sequence[dict[str, Any]], name: str) -> dict[str, dict[str, float | int]]:
    """Per draft source over all prompts: nodes verified, accepted, acceptance rate, share of accepted."""
    drafted = _sum_sources([r["methods"][name]["drafted_by_source"] for r in results])
    accepted = _sum_sources([r["methods"][name]["accepted_by_source"] for r in results])
    total = sum(accepted.values())
    return {
        src: {
            "verified_nodes": n,
            "accepted": accepted.get(src, 0),
            "acceptance_rate": round(accepted.get(src, 0) / n, 4) if n else 0.0,
            "share_of_accepted": round(accepted.get(src, 0) / total, 4) if total else 0.0,
        }
        for src, n in drafted.items()
    }


def noise(runs: dict[str, dict[str, list[Run]]]) -> dict[str, float]:
    """How much plain decoding's speed moves between repetitions of the same prompt (the noise band)."""
    spreads = []
    for per_method in runs.values():
        tps = [r.decode_tps for r in per_method["autoregressive"]]
        if len(tps) >= 2 and min(tps) > 0:
            spreads.append(max(tps) / min(tps) - 1.0)
    if not spreads:
        return {}
    return {"ar_repeat_spread_median": round(median(spreads), 4), "ar_repeat_spread_max": round(max(spreads), 4)}


def summarize_case(runs: dict[str, list[Run]], reference: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ar_tps = median([r.decode_tps for r in runs["autoregressive"]])
    ar_total = median([r.total_s for r in runs["autoregressive"]])
    for name, reps in runs.items():
        mismatches = [first_mismatch(r.tokens, reference) for r in reps]
        tps = median([r.decode_tps for r in reps])
        total = median([r.total_s for r in reps])
        out[name] = {
            "lossless": all(m is None for m in mismatches),
            "first_mismatch": next((m for m in mismatches if m is not None), None),
            "reference": name in REFERENCES,  # not expected to equal our output (other numerics)
            "new_tokens": len(reps[0].tokens),
            "decode_tokens_per_s": round(tps, 3),
            "speedup_vs_ar": round(tps / ar_tps, 4) if ar_tps else 0.0,
            "ttft_s": round(median([r.ttft_s for r in reps]), 4),
            "total_s": round(total, 4),
            "e2e_speedup_vs_ar": round(ar_total / total, 4) if total else 0.0,
            "acceptance_length": round(median([r.acceptance_length for r in reps]), 4),
            "accepted_by_source": _sum_sources([r.accepted_by_source for r in reps]),
            "drafted_by_source": _sum_sources([r.drafted_by_source for r in reps]),
            "decode_tokens_per_s_reps": [round(r.decode_tps, 3) for r in reps],  # the spread behind the median
        }
        if any(r.draft_forwards for r in reps):  # an LM drafter: what its drafting cost
            out[name]["drafter"] = {
                "forwards": median([r.draft_forwards for r in reps]),
                "ms_per_forward": round(1000 * median([r.draft_s / r.draft_forwards
                                                       for r in reps if r.draft_forwards]), 3),
                "prefill_s": round(median([r.draft_prefill_s for r in reps]), 4),
                "share_of_decode": round(median([(r.draft_s + r.draft_prefill_s) / r.decode_s for r in reps
                                                 if r.decode_s > 0]), 4),
            }
    return out


def lm_forward_vs_step(bench: Bench, case: Case, repeats: int) -> dict[str, Any] | None:
    """What one token drafted by ``rapid_kv`` costs against a plain step, timed directly (interleaved, ``repeats``
    of each) on one cache holding the case's prompt: its drafting call for one token (one row over the prompt rows
    it reads: the system prompt, the retrieved chunks, the question) and a plain one-row forward. Independent of how
    often the budget policy let the drafter draft in the runs. None when the case has no retrieved rows."""
    prompt = case.prompt
    if prompt.draft_rows is None:
        return None
    engine, model = bench.engine, bench.target.model
    cache = SlotCache(engine.num_layers, engine.cache_rows(len(prompt.ids), GenerationConfig(max_new_tokens=8)))
    engine.prefill(prompt.ids, cache)
    drafter = RapidKVDrafter(model)
    drafter.begin(PromptInfo(prompt_ids=prompt.ids, draft_rows=prompt.draft_rows, target_cache=cache))
    root, length = int(prompt.ids[-1]), cache.length
    step: list[float] = []
    draft: list[float] = []
    for _ in range(repeats + 2):  # the first of each warms up
        pos = torch.tensor([length], device=bench.target.device)
        t = time.perf_counter()
        model.forward(torch.tensor([[root]], device=pos.device), cache, pos[None], None, 1)
        step.append(time.perf_counter() - t)
        cache.truncate(length)
        t = time.perf_counter()
        drafter.propose(DraftRequest(root=root, generated=[root], budget=1, max_depth=1))  # one forward, cut back
        draft.append(time.perf_counter() - t)
        assert cache.length == length
    plain_s, draft_s = median(step[2:]), median(draft[2:])
    return {"context_tokens": length, "visible_rows": sum(min(b, length) - max(a, 0) for a, b in prompt.draft_rows),
            "step_ms": round(1000 * plain_s, 3), "drafted_token_ms": round(1000 * draft_s, 3),
            "forward_vs_step": round(draft_s / plain_s, 3)}


def _relative_verify(curve: dict[str, float], nodes: int) -> float:
    """A verify over ``nodes`` draft nodes relative to a plain step, from ``verify_cost.ours_vs_step`` (0 nodes is
    the step itself), interpolated as the budget policy interpolates its cost table."""
    return _interpolate({0: 1.0, **{int(k): v for k, v in curve.items()}}, nodes, extrapolate=True)


def _chain_model(a: float, ratio: float, verify: dict[str, float]) -> dict[str, Any]:
    """The best chain depth g (0: none) and its speedup: tokens 1 + a + .. + a^g per 1 + g * ratio + verify(g) - 1
    steps."""
    best_g, best = 0, 1.0
    for g in range(1, 17):
        rate = (1.0 + sum(a**d for d in range(1, g + 1))) / (1.0 + g * ratio + _relative_verify(verify, g) - 1.0)
        if rate > best:
            best_g, best = g, rate
    return {"best_depth": best_g, "speedup_bound": round(best, 4)}


def lm_drafter_costs(results: Sequence[dict[str, Any]], names: Sequence[str],
                     verify: dict[str, float], timed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Why an LM drafter the target's own size pays or not here: per method (medians over prompts), the target's
    plain step, one drafter forward, its acceptance per drafted token (its own nodes: sources ``rapid*``, in a
    mode that merges other drafters too), its own prefill, and what chains of g tokens would give at best with
    those figures, every step drafting (``_chain_model``; the drafter's prefill and catch-up not counted). With
    ``timed`` (``lm_forward_vs_step``), modes drafting with ``rapid_kv`` also get ``chain_model_timed``: the same
    on the forward's directly timed cost."""
    out: dict[str, Any] = {}
    for name in names:
        rows = [r["methods"][name] for r in results if "drafter" in r["methods"].get(name, {})]
        if not rows:
            continue
        ar = [r["methods"]["autoregressive"] for r in results if "drafter" in r["methods"].get(name, {})]
        step_ms = median([1000.0 / row["decode_tokens_per_s"] for row in ar if row["decode_tokens_per_s"] > 0])
        forward_ms = median([row["drafter"]["ms_per_forward"] for row in rows])
        drafted = sum(n for row in rows for src, n in row["drafted_by_source"].items() if src.startswith("rapid"))
        accepted = sum(n for row in rows for src, n in row["accepted_by_source"].items() if src.startswith("rapid"))
        a = accepted / drafted if drafted else 0.0
        ratio = forward_ms / step_ms if step_ms else 0.0
        out[name] = {
            "target_step_ms": round(step_ms, 3),
            "drafter_forward_ms": round(forward_ms, 3),
            "forward_vs_step": round(ratio, 3),
            "drafted_tokens": drafted,  # the LM drafter's own nodes verified (the acceptance's sample)
            "acceptance_per_drafted_token": round(a, 4),
            "drafter_prefill_s": round(median([row["drafter"]["prefill_s"] for row in rows]), 4),
            "drafting_share_of_decode": round(median([row["drafter"]["share_of_decode"] for row in rows]), 4),
            "speedup_vs_ar_measured": round(median([row["speedup_vs_ar"] for row in rows]), 4),
            "chain_model": _chain_model(a, ratio, verify),
        }
        if timed is not None and any(src.startswith("rapid_kv") for row in rows for src in row["drafted_by_source"]):
            # the drafter's cost timed directly (lm_forward_vs_step): robust where the runs drafted little
            out[name]["chain_model_timed"] = _chain_model(a, timed["forward_vs_step"], verify)
    return out


def measure_ttft_repeat(
    target: LoadedModel, doc: DocQA, repeats: int, max_doc_tokens: int | None = None
) -> dict[str, Any]:
    """Cold TTFT (prefix computed) vs repeated-question TTFT (prefix KV reused) on one long document."""
    [case] = make_cases(target, [doc], 1, 32, max_doc_tokens)
    config = GenerationConfig(max_new_tokens=16)
    cold: list[float] = []
    warm: list[float] = []
    same = True
    hits = True
    for rep in range(repeats):
        cache = PrefixCache(byte_budget=4 << 30)
        engine = Engine(target, cache, config=ENGINE_CONFIG)
        prompt = Prompt(case.prompt.prefix_ids, case.prompt.suffix_ids, prefix_key=f"{doc.name}-{rep}")
        first = next(e for e in engine.generate(prompt, config) if isinstance(e, DoneEvent))
        again = next(e for e in engine.generate(prompt, config) if isinstance(e, DoneEvent))
        cold.append(first.stats.ttft_s)
        warm.append(again.stats.ttft_s)
        same &= first.token_ids == again.token_ids
        hits &= again.stats.prefix_cache_hit and not first.stats.prefix_cache_hit
    return {
        "document": doc.name,
        "prompt_tokens": len(case.prompt.ids),
        "prefix_tokens": len(case.prompt.prefix_ids),
        "cold_ttft_s": [round(x, 4) for x in cold],
        "warm_ttft_s": [round(x, 4) for x in warm],
        "prefix_cache_hit": hits,
        "same_output": same,
        "ratio": round(median(cold) / median(warm), 3) if median(warm) > 0 else 0.0,
    }


def gguf_of(spec: str, data_dir: Path) -> Path | None:
    """The GGUF file a target spec is served from (what llama.cpp gets), if any."""
    from decoding.runtime.bundled import GGUF_LINK, bundled_gguf_dir

    if spec == "bundled":
        return bundled_gguf_dir(data_dir / "models") / GGUF_LINK
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def measure_prefill(bench: Bench, case: Case, repeats: int, ours: bool = True) -> dict[str, Any]:
    """Cold prefill throughput of the case's whole prompt: ours (no cached prefix; left out when ``ours`` is False)
    and each llama.cpp build's, interleaved per repetition; medians, and every repetition (``*_reps``)."""
    mine: list[float] = []
    theirs: dict[str, list[float]] = {name: [] for name in bench.llama}
    n = len(case.prompt.ids)
    for _ in range(repeats):
        if ours:
            engine = Engine(bench.target, None, config=ENGINE_CONFIG)
            done = next(e for e in engine.generate(case.prompt, GenerationConfig(max_new_tokens=1))
                        if isinstance(e, DoneEvent))
            mine.append(n / done.stats.prefill_s)
        for name, worker in bench.llama.items():
            theirs[name].append(n / worker.eval(list(case.prompt.ids)))
    out: dict[str, Any] = {"prompt_tokens": n}
    if mine:
        out |= {"ours_tokens_per_s": round(median(mine), 1), "ours_ttft_s": round(n / median(mine), 3),
                "ours_tokens_per_s_reps": [round(v, 1) for v in mine]}
    for name, speeds in theirs.items():
        out[f"{name}_tokens_per_s"] = round(median(speeds), 1)
        out[f"{name}_tokens_per_s_reps"] = [round(v, 1) for v in speeds]
        if mine:
            out[f"ours_vs_{name}"] = round(median(mine) / median(speeds), 3)
    return out


def _curve(costs: dict[int, float]) -> dict[str, Any]:
    step = costs[0]
    ratios = {str(k): round(v / step, 3) for k, v in costs.items() if k}
    return {"step_ms": round(1000 * step, 2), "ours_vs_step": ratios}


def verify_by_path(bench: Bench, context: int, repeats: int) -> dict[str, dict[str, Any]]:
    """The curve on every CPU kernel path this machine runs, on one prefilled cache (the paths give the same
    bits, so the cache is the same whichever path wrote it): ``QuantizedModel.lib`` swapped per path."""
    engine = bench.engine
    model = engine.model
    if not isinstance(model, QuantizedModel):
        return {}
    gen = torch.Generator().manual_seed(context)
    vocab = bench.target.vocab_size
    ctx = torch.randint(0, vocab, (context,), generator=gen).tolist()
    cache = SlotCache(engine.num_layers, context + max(VERIFY_NODES) + 2)
    with torch.inference_mode():
        engine.prefill(ctx, cache)
    own = model.lib
    paths = {isa: kernels.library(isa) for isa in reversed(kernels.available_isas())}
    times: dict[str, dict[int, list[float]]] = {isa: {n: [] for n in VERIFY_NODES} for isa in paths}
    try:
        for _ in range(repeats):  # paths interleaved per repetition: the machine's drift moves them all
            for isa, lib in paths.items():
                model.lib = lib
                costs = time_verifies(engine, cache, ctx[-1], VERIFY_NODES, 1, gen)
                assert costs is not None  # nothing cancels it
                for n, seconds in costs.items():
                    times[isa][n].append(seconds)
    finally:
        model.lib = own
    return {isa: _curve({n: median(v) for n, v in by_size.items()}) for isa, by_size in times.items()}


def verify_curve(bench: Bench, context: int, repeats: int) -> dict[str, Any]:
    """A forward over 2 .. 64 draft nodes (3 .. 65 rows) relative to a plain step, ours (on the configured kernel
    path, and per path) and llama.cpp's (evaluating as many tokens at once) on a ``context``-token cache."""
    base, costs = verify_costs(bench.engine, context, VERIFY_NODES, repeats)
    step = costs[0]
    out: dict[str, Any] = {"context_tokens": base, **_curve(costs), "by_path": verify_by_path(bench, base, repeats)}
    gen = torch.Generator().manual_seed(context)
    for name, worker in bench.llama.items():
        vocab = bench.target.vocab_size
        worker.eval(torch.randint(0, vocab, (base,), generator=gen).tolist())
        times: dict[int, list[float]] = {k: [] for k in VERIFY_NODES}
        for _ in range(repeats):
            for nodes in VERIFY_NODES:
                times[nodes].append(worker.eval(torch.randint(0, vocab, (nodes + 1,), generator=gen).tolist(), base))
        theirs = {k: median(v) for k, v in times.items()}
        out[f"{name}_step_ms"] = round(1000 * theirs[0], 2)
        out[f"{name}_vs_step"] = {str(k): round(v / theirs[0], 3) for k, v in theirs.items() if k}
        out[f"ours_step_vs_{name}_step"] = round(step / theirs[0], 3)
    return out


def summarize(results: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Medians over prompts per method, and the two comparisons the CPU runtime is judged by."""
    methods = {}
    for name in names:
        rows = [r["methods"][name] for r in results]
        methods[name] = {
            "tokens_per_second_median": round(median([row["decode_tokens_per_s"] for row in rows]), 3),
            "speedup_vs_ar_median": round(median([row["speedup_vs_ar"] for row in rows]), 4),
            "speedup_vs_ar_min": round(min(row["speedup_vs_ar"] for row in rows), 4),
            "acceptance_length_median": round(median([row["acceptance_length"] for row in rows]), 4),
            "ttft_s_median": round(median([row["ttft_s"] for row in rows]), 4),
        }
        if name in REFERENCES:
            methods[name]["agreement_with_ar_median"] = round(median([
                (row["first_mismatch"] if row["first_mismatch"] is not None else row["new_tokens"])
                / max(1, row["new_tokens"]) for row in rows]), 4)
    out: dict[str, Any] = {
        "prompts": len(results),
        "all_lossless": all(
            row["lossless"] for r in results for name, row in r["methods"].items() if name not in REFERENCES
        ),
        "methods": methods,
    }
    ours = [n for n in names if n not in REFERENCES and not n.startswith("hf_")]
    for ref in (n for n in names if n in LLAMA_REFS):
        theirs = [r["methods"][ref]["decode_tokens_per_s"] for r in results]

        def vs(name: str, theirs: list[float] = theirs) -> float:
            tps = [r["methods"][name]["decode_tokens_per_s"] for r in results]
            return round(median([a / b for a, b in zip(tps, theirs, strict=True) if b > 0]), 4)

        ratios = {name: vs(name) for name in ours}
        out[f"vs_{ref}"] = {
            "autoregressive": ratios["autoregressive"],
            "best_speculative": max((v for k, v in ratios.items() if k != "autoregressive"), default=0.0),
            "best_speculative_method": max((k for k in ratios if k != "autoregressive"), key=ratios.__getitem__,
                                           default=""),
            "by_method": ratios,
        }
    return out
