"""RACER drafter micro-benchmark: automaton build, per-token update, per-step propose / observe.

No model runs: the "target" is scripted (its output is a document span with edits), so only the
drafter's own costs are measured, at the size that matters (an ~8K-token prompt). Writes JSON.

    python -m bench.racer_micro --json bench/results/racer_micro.json [--redis-url redis://...]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import machine_info, median, write_json
from decoding.bundled import bundled_target_dir
from decoding.drafter import DraftRequest, PromptInfo, VerifyOutcome
from decoding.drafters.racer import (
    AutomatonCache,
    CrossSessionConfig,
    LogitsTable,
    NgramAutomaton,
    RacerConfig,
    RacerDrafter,
    open_shared_tier,
)
from decoding.tree import ROOT, DraftTree

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
TEXTS = REPO / "bench" / "data"
TOKENIZER = bundled_target_dir(REPO / "data" / "models") / "tokenizer.json"


def document_tokens(n: int) -> tuple[list[int], int, str]:
    """``n`` tokens of real English text (licence texts), with the bundled tokenizer when present."""
    text = "\n\n".join(p.read_text(errors="replace") for p in sorted(TEXTS.glob("*.txt")))
    if TOKENIZER.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(TOKENIZER))
        ids = tok.encode(text).ids
        vocab = tok.get_vocab_size()
        source = "smollm2 tokenizer"
    else:  # word-level ids keep the repetition statistics of real text
        words: dict[str, int] = {}
        ids = [words.setdefault(w, len(words)) for w in text.split()]
        vocab = len(words) + 1
        source = "word-level ids"
    while len(ids) < n:
        ids = ids + ids
    return ids[:n], vocab, source


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def timed(fn: Callable[[], Any], reps: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``reps`` calls (CPU time is less disturbed by other processes)."""
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def make_answer(doc: list[int], length: int, vocab: int, seed: int) -> list[int]:
    """A span of the document with a novel token every ~12 tokens (answers paraphrase a little)."""
    rng = random.Random(seed)
    start = rng.randrange(0, len(doc) - 2 * length)
    out: list[int] = []
    pos = start
    while len(out) < length:
        if rng.random() < 1 / 12:
            out.append(rng.randrange(vocab))
            pos += rng.choice([0, 1, 3])
        else:
            out.append(doc[pos])
            pos += 1
    return out


def verify(tree: DraftTree, truth: list[int], pos: int) -> list[int]:
    kids = tree.children()
    node, acc = ROOT, []
    while pos + 1 < len(truth):
        nxt = [i for i in kids[node + 1] if tree.tokens[i] == truth[pos + 1]]
        if not nxt:
            break
        node = nxt[0]
        acc.append(node)
        pos += 1
    return acc


def decode_loop(drafter: RacerDrafter, prompt: list[int], topk: np.ndarray, answer: list[int], budget: int,
                topk_of: Callable[[int], list[int]]) -> dict[str, Any]:
    """Drive the drafter as the engine does; time begin, propose, observe; report acceptance."""
    t = time.perf_counter()
    drafter.begin(PromptInfo(prompt_ids=prompt, prompt_topk=torch.from_numpy(topk)))
    begin_s = time.perf_counter() - t
    propose, propose_cpu, observe = [], [], []
    out = [answer[0]]
    pos, steps, accepted = 0, 0, 0
    while pos + 1 < len(answer):
        root = answer[pos]
        t, c = time.perf_counter(), time.process_time()
        tree = drafter.propose(DraftRequest(root=root, generated=out, budget=budget))
        propose.append(time.perf_counter() - t)
        propose_cpu.append(time.process_time() - c)
        acc = verify(tree, answer, pos)
        pos += len(acc)
        new = [tree.tokens[i] for i in acc]
        if pos + 1 < len(answer):
            new.append(answer[pos + 1])
        pos += 1
        rows = torch.tensor([topk_of(x) for x in [root, *tree.tokens]], dtype=torch.long)  # [n + 1, 8]
        t = time.perf_counter()
        outcome = VerifyOutcome(root=root, tree=tree, accepted_nodes=acc, new_tokens=new, node_topk=rows)
        drafter.observe(outcome)
        observe.append(time.perf_counter() - t)
        out.extend(new)
        steps += 1
        accepted += len(acc)
    t = time.perf_counter()
    drafter.end(out)
    end_s = time.perf_counter() - t
    return {
        "budget": budget,
        "steps": steps,
        "answer_tokens": len(answer),
        "acceptance_length": round((accepted + steps) / steps, 3),
        "begin_ms": round(begin_s * 1e3, 3),
        "propose_us_median": round(median(propose) * 1e6, 1),
        "propose_us_p90": round(percentile(propose, 90) * 1e6, 1),
        "propose_cpu_us_median": round(median(propose_cpu) * 1e6, 1),
        "observe_us_median": round(median(observe) * 1e6, 1),
        "observe_us_p90": round(percentile(observe, 90) * 1e6, 1),
        "end_ms": round(end_s * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "racer_micro.json")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)

    doc, vocab, source = document_tokens(args.tokens + 64)
    prompt, question = doc[: args.tokens], doc[args.tokens :][:32]
    cfg = RacerConfig()
    result: dict[str, Any] = {"machine": machine_info(), "tokens": args.tokens, "text": source,
                              "vocab": vocab, "config": cfg.__dict__,
                              "load_average": list(os.getloadavg())}

    # ---- automaton build ------------------------------------------------------------------------
    bulk, bulk_cpu = timed(lambda: NgramAutomaton.build(prompt, cfg.max_ngram, cfg.max_nodes), args.reps)
    auto = NgramAutomaton.build(prompt, cfg.max_ngram, cfg.max_nodes)

    def incremental() -> None:
        a = NgramAutomaton(cfg.max_ngram, cfg.max_nodes)
        a.extend(prompt)

    inc, inc_cpu = timed(incremental, max(1, args.reps // 2))
    copy, copy_cpu = timed(auto.copy, args.reps)
    cache = AutomatonCache()
    q2 = [*prompt, *question[:16]]
    cache.automaton([*prompt, *question], max_ngram=cfg.max_ngram, max_nodes=cfg.max_nodes)
    cache.automaton(q2, max_ngram=cfg.max_ngram, max_nodes=cfg.max_nodes)  # makes the snapshot
    snap, snap_cpu = timed(lambda: cache.automaton([*prompt, *question[16:]], max_ngram=cfg.max_ngram,
                                         max_nodes=cfg.max_nodes), args.reps)
    result["automaton"] = {
        "nodes": len(auto),
        "approx_bytes": auto.nbytes(),
        "build_numpy_ms_median": round(median(bulk) * 1e3, 2),
        "build_numpy_cpu_ms_median": round(median(bulk_cpu) * 1e3, 2),
        "build_token_by_token_ms_median": round(median(inc) * 1e3, 2),
        "build_token_by_token_cpu_ms_median": round(median(inc_cpu) * 1e3, 2),
        "copy_ms_median": round(median(copy) * 1e3, 2),
        "copy_cpu_ms_median": round(median(copy_cpu) * 1e3, 2),
        "snapshot_reuse_ms_median": round(median(snap) * 1e3, 2),
        "snapshot_reuse_cpu_ms_median": round(median(snap_cpu) * 1e3, 2),
        "snapshot_hits": cache.hits,
    }

    # ---- per-token update at an 8K prompt -------------------------------------------------------
    per_token = []
    for tok in make_answer(doc, 1024, vocab, seed=1):
        t = time.perf_counter()
        auto.feed(tok)
        per_token.append(time.perf_counter() - t)
    bounded = NgramAutomaton.build(prompt, cfg.max_ngram, max_nodes=40_000)
    per_token_evicting = []
    for tok in make_answer(doc, 1024, vocab, seed=2):
        t = time.perf_counter()
        bounded.feed(tok)
        per_token_evicting.append(time.perf_counter() - t)
    result["feed"] = {
        "us_per_token_median": round(median(per_token) * 1e6, 2),
        "us_per_token_p99": round(percentile(per_token, 99) * 1e6, 2),
        "bounded_40k_us_per_token_mean": round(float(np.mean(per_token_evicting)) * 1e6, 2),
        "bounded_40k_us_per_token_max": round(max(per_token_evicting) * 1e6, 1),
        "bounded_40k_evicted": bounded.evicted,
    }

    # ---- per-step propose / observe -------------------------------------------------------------
    nxt = dict(itertools.pairwise(prompt))  # a stand-in for the target's top-1

    def topk_of(x: int) -> list[int]:
        return [nxt.get(x, 0), *((x * 7919 + j) % vocab for j in range(1, 8))]

    prompt_topk = np.array([topk_of(x) for x in prompt], dtype=np.int64)  # [n, 8]
    steps: list[dict[str, Any]] = []
    shared_cfgs: list[tuple[str, CrossSessionConfig | None]] = [
        ("none", None), ("in-process", CrossSessionConfig())]
    if args.redis_url:
        shared_cfgs.append(("redis", CrossSessionConfig(redis_url=args.redis_url)))
    for tier_name, scfg in shared_cfgs:
        tier = open_shared_tier(scfg) if scfg is not None else None
        for budget in (8, 16, 64):
            table = LogitsTable(vocab, 8)
            answer = make_answer(doc, 256, vocab, seed=budget)
            for session in (1, 2):
                shared = tier.cache("bench", "tok", "tenant") if tier is not None else None
                drafter = RacerDrafter(cfg, table, shared, automata=AutomatonCache())
                row = decode_loop(drafter, [*prompt, *question], prompt_topk, answer, budget, topk_of)
                row.update(shared_tier=tier_name, session=session)
                steps.append(row)
                if tier is not None:
                    tier.drain()
                if tier is None:
                    break
        if tier is not None:
            result.setdefault("shared_tier_status", {})[tier_name] = tier.status()
            tier.close()
    result["steps"] = steps
    write_json(args.json, result)
    sys.stdout.write(f"wrote {args.json}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
