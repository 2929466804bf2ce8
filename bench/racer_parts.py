"""RACER part by part: the drafter with each part removed or added, on the bundled target, side by side.

    python -m bench.racer_parts --threads 2 --json bench/results/racer_parts.json
                                [--documents 3] [--max-new-tokens 64] [--repeats 2] [--context 3500]

Greedy long-document QA prompts (two questions per document, documents cut to ``--context`` tokens), every
variant on the same prompts, interleaved per prompt (rep -> prompt -> variant), our autoregressive decoding
among them so every speed is a ratio from the same run. Each variant has its own engine (its own acceptance
statistics, as if the service ran only that mode) over one shared document-prefix KV cache.

Variants (``racer`` is RACER per request: the automaton over prompt + output, the logits table learned from
this prompt's prefill, no earlier sessions):

- ``racer-logits`` / ``racer-retrieval``: without the logits table / without the n-gram automaton;
- ``racer-snapshots``: the prompt automaton built from scratch instead of copied from a document snapshot;
- ``racer+table_related``: the logits table as a session on the document's other question left it;
- ``racer+tier_related`` / ``racer+tier_same``: the cross-session tier fed with the answer to the
  document's other question / to this very question (a second session asking the same thing);
- ``racer+tier_document``: the cross-session tier fed with the document's n-grams (the removed document
  learning);
- ``auto`` / ``auto+tier_related`` / ``auto+tier_same``: the service's default mode (prompt lookup + the
  cross-session tier alone) with the tier empty / fed with the other question's answer / with this one's.

Per variant: tokens per target step, verified draft nodes and accepted tokens per step by source, the
drafter's thread CPU time per step (begin apart), decode tokens/s over our autoregressive decoding on the
same prompt (median of repetitions, then median / min / max over prompts) and whether every output equals
the autoregressive one. The noise band is how far autoregressive decoding moved between repetitions.
Apart (``--prefill-repeats``): cold prefill of the first prompt with and without the prompt top-k the
logits table learns from.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, load_target, machine_info, median, qa_documents, write_json
from bench.decode import ENGINE_CONFIG, Case, make_cases
from decoding.budget import AcceptanceModel, BudgetPolicy
from decoding.calibration import calibrate
from decoding.drafter import BaseDrafter, Drafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.drafters import DraftingKit, build_drafters
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.racer import (
    AutomatonCache,
    CrossSessionConfig,
    InProcessSharedTier,
    LogitsTable,
    NgramAutomaton,
    RacerConfig,
    RacerDrafter,
    RacerFactory,
)
from decoding.drafters.racer.cross_session import ngram_items
from decoding.engine import Engine
from decoding.generation import DoneEvent, GenerationConfig
from decoding.kv_cache import PrefixCache
from decoding.models import LoadedModel
from decoding.tree import DraftTree

logger = logging.getLogger("bench.racer_parts")

TENANT = "bench"


class Timed(BaseDrafter):
    """A drafter with its hooks timed in thread CPU time (less sensitive to other load than wall time)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.begin_s = 0.0
        self.step_s = 0.0  # propose + observe

    def begin(self, prompt: PromptInfo) -> None:
        t = time.thread_time()
        self.inner.begin(prompt)
        self.begin_s += time.thread_time() - t

    def propose(self, request: DraftRequest) -> DraftTree:
        t = time.thread_time()
        tree = self.inner.propose(request)
        self.step_s += time.thread_time() - t
        return tree

    def observe(self, outcome: VerifyOutcome) -> None:
        t = time.thread_time()
        self.inner.observe(outcome)
        self.step_s += time.thread_time() - t

    def end(self, output_ids: Sequence[int]) -> None:
        self.inner.end(output_ids)

    def reset(self) -> None:
        self.inner.reset()


class _Unlearned(LogitsTable):
    """A logits table that never learns: logits paths find nothing (RACER without its logits table)."""

    def update(self, tokens: Any, topk: Any) -> int:
        return 0


class _NoRetrieval(RacerDrafter):
    """RACER whose automaton never holds the text: retrieval paths find nothing."""

    def _sync(self, generated: Sequence[int]) -> NgramAutomaton:
        return NgramAutomaton(2, 16)


@dataclass
class Setup:
    target: LoadedModel
    cases: list[Case]
    reference: dict[str, list[int]]  # our autoregressive answer per case
    related: dict[str, Case]  # the document's other question
    related_tables: dict[str, LogitsTable] = field(default_factory=dict)  # as that session left the table
    automata: AutomatonCache = field(default_factory=AutomatonCache)


def _table(s: Setup, cls: type[LogitsTable] = LogitsTable) -> LogitsTable:
    return cls(s.target.vocab_size, k=RacerConfig().topk, model_id=s.target.name)


def _racer(s: Setup, *, config: RacerConfig | None = None, table: LogitsTable | None = None,
           tier: InProcessSharedTier | None = None, snapshots: bool = True) -> RacerDrafter:
    factory = RacerFactory(config or RacerConfig(), table or _table(s), tier, model_id=s.target.name,
                           automata=s.automata if snapshots else None)
    drafter = factory.drafter(TENANT)
    if not snapshots:
        drafter.automata = None
    return drafter


def _tier(s: Setup, answers: Sequence[tuple[Case, list[int]]], document: bool = False) -> InProcessSharedTier:
    """A fresh in-process tier fed as earlier sessions would have fed it (prompt tail + answer)."""
    tier = InProcessSharedTier(CrossSessionConfig())
    cache = tier.cache(s.target.name, "", TENANT)
    for case, answer in answers:
        ids = list(case.prompt.ids)
        if document:  # what the removed document learning did: the document's n-grams, as an answer's
            tier.learn(cache.namespace, ngram_items(ids, 0, cache.context_len, cache.continuation_len))
        else:
            tail = ids[-cache.context_len :]
            cache.learn([*tail, *answer], len(tail))
    return tier


def _copy_table(s: Setup, source: LogitsTable) -> LogitsTable:
    table = _table(s)
    table.table[:] = source.table
    table.filled[:] = source.filled
    return table


def _no_retrieval(s: Setup, c: Case) -> Drafter:
    return _NoRetrieval(RacerConfig(), _table(s), None, automata=s.automata)


def _auto(s: Setup, tier: InProcessSharedTier) -> list[Drafter]:
    """The service's default mode from the registry, over this tier."""
    factory = RacerFactory(RacerConfig(), _table(s), tier, model_id=s.target.name, automata=s.automata)
    return build_drafters("auto", DraftingKit(racer=factory, tenant=TENANT))


Variant = Callable[[Setup, Case], Drafter | list[Drafter] | None]
VARIANTS: dict[str, Variant] = {
    "autoregressive": lambda s, c: None,
    "prompt_lookup": lambda s, c: PromptLookupDrafter(),
    "racer": lambda s, c: _racer(s),
    "racer-logits": lambda s, c: _racer(s, table=_table(s, _Unlearned)),
    "racer-retrieval": _no_retrieval,
    "racer-snapshots": lambda s, c: _racer(s, snapshots=False),
    "racer+table_related": lambda s, c: _racer(s, table=_copy_table(s, s.related_tables[c.name])),
    "racer+tier_related": lambda s, c: _racer(s, tier=_tier(s, [(s.related[c.name],
                                                                 s.reference[s.related[c.name].name])])),
    "racer+tier_same": lambda s, c: _racer(s, tier=_tier(s, [(c, s.reference[c.name])])),
    "racer+tier_document": lambda s, c: _racer(s, tier=_tier(s, [(c, [])], document=True)),
    "auto": lambda s, c: _auto(s, _tier(s, [])),
    "auto+tier_related": lambda s, c: _auto(s, _tier(s, [(s.related[c.name], s.reference[s.related[c.name].name])])),
    "auto+tier_same": lambda s, c: _auto(s, _tier(s, [(c, s.reference[c.name])])),
}


@dataclass
class Run:
    tokens: list[int]
    steps: int  # target forwards after the first token
    decode_tokens: int
    decode_s: float
    draft_cpu_s: float  # propose + observe
    begin_cpu_s: float
    verified: dict[str, int]
    accepted: dict[str, int]

    @property
    def tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def run(engine: Engine, case: Case, drafters: Drafter | list[Drafter] | None, max_new: int) -> Run:
    given = [] if drafters is None else drafters if isinstance(drafters, list) else [drafters]
    timed = [Timed(d) for d in given]
    config = GenerationConfig(max_new_tokens=max_new)
    events = engine.generate(case.prompt, config, list(timed))
    done = next(e for e in events if isinstance(e, DoneEvent))
    s = done.stats
    return Run(list(done.token_ids), s.steps, max(0, s.completion_tokens - 1), s.decode_s,
               sum(t.step_s for t in timed), sum(t.begin_s for t in timed),
               dict(s.drafted_by_source), dict(s.accepted_by_source))


def summarize(runs: dict[str, dict[str, list[Run]]], reference: dict[str, list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = next(iter(runs.values())).keys()
    for name in names:
        every = [r for per in runs.values() for r in per[name]]
        steps = sum(r.steps for r in every) or 1
        ratios = []
        for per in runs.values():
            ar = median([r.tps for r in per["autoregressive"]])
            ratios.append(median([r.tps for r in per[name]]) / ar if ar else 0.0)
        sources = sorted({k for r in every for k in r.verified})
        out[name] = {
            "lossless": all(r.tokens == reference[c] for c, per in runs.items() for r in per[name]),
            "tokens_per_step": round(sum(r.decode_tokens for r in every) / steps, 4),
            "verified_nodes_per_step": {k: round(sum(r.verified.get(k, 0) for r in every) / steps, 4)
                                        for k in sources},
            "accepted_per_step": {k: round(sum(r.accepted.get(k, 0) for r in every) / steps, 4)
                                  for k in sources},
            "draft_cpu_ms_per_step": round(1000 * sum(r.draft_cpu_s for r in every) / steps, 4),
            "begin_cpu_ms_median": round(1000 * median([r.begin_cpu_s for r in every]), 3),
            "speedup_vs_ar_median": round(median(ratios), 4),
            "speedup_vs_ar_min": round(min(ratios), 4),
            "speedup_vs_ar_max": round(max(ratios), 4),
        }
    return out


def noise(runs: dict[str, dict[str, list[Run]]]) -> dict[str, float]:
    spreads = [max(t) / min(t) - 1.0 for per in runs.values()
               if len(t := [r.tps for r in per["autoregressive"]]) >= 2 and min(t) > 0]
    if not spreads:
        return {}
    return {"ar_repeat_spread_median": round(median(spreads), 4), "ar_repeat_spread_max": round(max(spreads), 4)}


def prefill_cost(target: LoadedModel, case: Case, repeats: int) -> dict[str, Any]:
    """Cold prefill of ``case``'s prompt with and without the prompt top-k the logits table learns from (its
    cost: the LM head and a top-k at every prompt row instead of the last one), alternated, medians."""
    times: dict[int, list[float]] = {0: [], ENGINE_CONFIG.prompt_topk: []}
    for _ in range(repeats):
        for k in times:
            engine = Engine(target, None, config=dataclasses.replace(ENGINE_CONFIG, prompt_topk=k))
            done = next(e for e in engine.generate(case.prompt, GenerationConfig(max_new_tokens=1))
                        if isinstance(e, DoneEvent))
            times[k].append(done.stats.ttft_s)
    without, with_topk = median(times[0]), median(times[ENGINE_CONFIG.prompt_topk])
    return {"prompt_tokens": len(case.prompt.ids), "ttft_s_without_topk": round(without, 4),
            "ttft_s_with_topk": round(with_topk, 4), "ratio": round(with_topk / without, 4)}


def _policy_copy(policy: BudgetPolicy) -> BudgetPolicy:
    """The calibrated verify costs, with fresh acceptance statistics."""
    return dataclasses.replace(policy, cost_s=dict(policy.cost_s), cost_slope=dict(policy.cost_slope),
                               acceptance=AcceptanceModel(), _lock=threading.Lock(),
                               _calibrated=copy.deepcopy(policy._calibrated))


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target("bundled", Path(args.data_dir))
    docs = [d for d in qa_documents() if len(d.questions) >= 2][: args.documents]
    cases = make_cases(target, docs, 2, args.max_new_tokens, args.context)
    by_doc: dict[str, list[Case]] = {}
    for c in cases:
        by_doc.setdefault(c.document, []).append(c)
    related = {c.name: next(o for o in by_doc[c.document] if o is not c) for c in cases}
    names = [n for n in VARIANTS if args.variants is None or n in args.variants or n == "autoregressive"]

    prefix = PrefixCache(byte_budget=4 << 30)
    base = Engine(target, prefix, config=ENGINE_CONFIG)
    calibrate(base)
    engines = {n: Engine(target, prefix, policy=_policy_copy(base.policy), config=ENGINE_CONFIG) for n in names}
    setup = Setup(target, cases, {}, related)
    for c in cases:  # reference answers (and each document's prefix KV, cached for every variant)
        setup.reference[c.name] = run(base, c, None, args.max_new_tokens).tokens
    for c in cases:  # what a session on the other question leaves in the logits table
        table = _table(setup)
        run(base, related[c.name], _racer(setup, table=table), args.max_new_tokens)
        setup.related_tables[c.name] = table

    runs: dict[str, dict[str, list[Run]]] = {c.name: {n: [] for n in names} for c in cases}
    for rep in range(args.repeats):
        for c in cases:
            for n in names:
                r = run(engines[n], c, VARIANTS[n](setup, c), args.max_new_tokens)
                runs[c.name][n].append(r)
                logger.info("rep %d %s %-20s %6.1f tok/s  %.2f tok/step  draft %.2f ms/step", rep + 1, c.name,
                            n, r.tps, r.decode_tokens / max(1, r.steps), 1000 * r.draft_cpu_s / max(1, r.steps))
    prefill = prefill_cost(target, cases[0], args.prefill_repeats) if args.prefill_repeats else None
    return {
        "benchmark": "racer_parts",
        "prefill_topk_cost": prefill,
        "config": {"model": target.name, "runtime": target.runtime, "threads": torch.get_num_threads(),
                   "context": args.context, "documents": [d.name for d in docs], "prompts": len(cases),
                   "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "variants": names},
        "machine": machine_info(),
        "noise": noise(runs),
        "variants": summarize(runs, setup.reference),
        "answer_tokens": {c: len(t) for c, t in setup.reference.items()},
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.racer_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--documents", type=int, default=3, help="documents (two questions each)")
    p.add_argument("--context", type=int, default=3500, help="documents cut to this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prefill-repeats", type=int, default=2,
                   help="cold prefills with and without the prompt top-k, each (0: skip)")
    p.add_argument("--variants", nargs="+", default=None, help=f"subset of {', '.join(VARIANTS)}")
    p.add_argument("--data-dir", default=str(REPO / "data"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    result = run_benchmark(args)
    if args.json:
        write_json(args.json, result)
    sys.stdout.write(f"noise: {result['noise']}\nprefill: {result['prefill_topk_cost']}\n")
    for name, row in result["variants"].items():
        sys.stdout.write(
            f"{name:20s} x{row['speedup_vs_ar_median']:.3f} [{row['speedup_vs_ar_min']:.3f}, "
            f"{row['speedup_vs_ar_max']:.3f}]  {row['tokens_per_step']:.3f} tok/step  "
            f"draft {row['draft_cpu_ms_per_step']:.3f} ms/step  begin {row['begin_cpu_ms_median']:.1f} ms  "
            f"accepted {row['accepted_per_step']}  lossless {row['lossless']}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
