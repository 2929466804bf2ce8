"""How far RAPID's knowledge transfer (eta) moves the answer's distribution from the target's, and what it
does to answer quality.

    python -m bench.eta [--cases N] [--quality-questions N] [--json PATH]

On long-document QA prompts (as in ``bench.decode``): the target's greedy answer is teacher-forced through
the target (whole document) and through the RAG drafter (same weights, the retrieved chunks only, as the
service builds its prompt). At every answer position, with p the target's next-token distribution and q the
drafter's (temperature 1), one speculative step drafting x ~ q emits a token distributed as

    out = q a + (1 - sum_x q(x) a(x)) r,   a = min(1, p_hat / q),   r = norm(max(p - p_hat, p - q, 0)),

p_hat = ``decoding.speculative.verify.transfer(p, q, eta)``. The total variation TV(out, p) is 0 at eta = 0 (exact
speculative sampling) and measures how much eta > 0 changes the output: its mean over positions is reported
per eta, with the drafter's own TV(q, p) for scale.

Quality: sampled answers (temperature 0.7, ``rapid_kv``, a fixed budget of 6 draft nodes so that every step
drafts and eta acts) to the QA set's questions at eta = 0 and 10; an answer "contains the gold answer" when it
holds at least half of the gold passage's content words (words of 4+ letters outside a short stop list: the
QA set's gold answers are passages quoted from the document, not short spans).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, load_target, machine_info, qa_documents, write_json
from bench.datasets import load_qa
from bench.decode import RagContext, make_cases
from decoding.cache.prefix import PrefixCache
from decoding.cache.slot import SlotCache
from decoding.drafters.registry import DraftingKit, build_drafters
from decoding.runtime.interface import TargetRuntime
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, SamplingParams
from decoding.speculative.verify import one_step_output

logger = logging.getLogger("bench.eta")
ETAS = (0.0, 5.0, 10.0, 20.0)


def next_token_probs(model: TargetRuntime, context: list[int], answer: list[int]) -> torch.Tensor:
    """softmax of the model's logits at every answer position (teacher forcing), ``[len(answer), vocab]``."""
    cache = SlotCache(model.num_layers, len(context) + len(answer) + 8)
    with torch.inference_mode():
        for i in range(0, len(context) - 1, 512):
            model.forward(torch.tensor([context[i : min(i + 512, len(context) - 1)]]), cache)
        rows = [context[-1], *answer[:-1]]
        logits = model.forward(torch.tensor([rows]), cache)  # [len(answer), vocab]
    return torch.softmax(logits.float(), dim=-1)


STOP = frozenset((
    "that", "this", "with", "from", "your", "have", "which", "will", "when", "what", "such", "than", "them", "they",
    "their", "there", "these", "those", "also", "into", "other", "only", "each", "must", "shall", "does", "make",
))  # fmt: skip


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4 and w not in STOP}


def contains_gold(answer: str, gold: str, share: float = 0.5) -> bool:
    want = content_words(gold)
    return bool(want) and len(want & content_words(answer)) >= share * len(want)


def quality(target: Any, cases: list[Any], gold: dict[str, str], samples: int, max_new: int) -> dict[str, Any]:
    """Share of sampled answers containing the gold answer, per eta (same questions, same drafter)."""
    engine = Engine(target, PrefixCache(byte_budget=4 << 30))
    rates = {}
    for eta in (0.0, 10.0):
        sampling = SamplingParams(temperature=0.7, eta=eta)
        config = GenerationConfig(max_new_tokens=max_new, sampling=sampling, draft_budget=6)
        hits = total = 0
        for case in cases:
            for _ in range(samples):
                drafters = build_drafters("rapid_kv", DraftingKit(target_model=target.model, sampling=sampling))
                done = next(e for e in engine.generate(case.prompt, config, drafters) if isinstance(e, DoneEvent))
                hits += contains_gold(done.text, gold[case.question])
                total += 1
        rates[str(int(eta))] = {"answers": total, "containing_gold": hits, "rate": round(hits / total, 4)}
        logger.info("eta %g: %d / %d answers contain the gold answer", eta, hits, total)
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    target = load_target("bundled", Path(args.data_dir))
    rag = RagContext(target.tokenizer)
    cases = make_cases(target, qa_documents(), 1, args.max_new_tokens, 3500, rag=rag)[: args.cases]
    engine = Engine(target)
    tv: dict[float, list[float]] = {eta: [] for eta in ETAS}
    drafter_tv: list[float] = []
    for case in cases:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens)
        done = next(e for e in engine.generate(case.prompt, config) if isinstance(e, DoneEvent))
        answer = list(done.token_ids)
        assert case.prompt.draft_ids is not None
        p = next_token_probs(target.model, case.prompt.ids, answer)
        q = next_token_probs(target.model, list(case.prompt.draft_ids), answer)
        drafter_tv += (0.5 * (q - p).abs().sum(dim=-1)).tolist()
        for eta in ETAS:
            out = one_step_output(p, q, eta)
            tv[eta] += (0.5 * (out - p).abs().sum(dim=-1)).tolist()
        logger.info("%s: %d positions, TV at eta 10: %.3f", case.name, len(answer),
                    statistics.mean(tv[10.0][-len(answer):]))
    gold = {q.question: q.answer_passage for d in load_qa() for q in d.questions}
    asked = make_cases(target, qa_documents(), args.quality_questions, 64, 3500, rag=rag)
    return {
        "quality": quality(target, asked, gold, args.samples, 64),
        "benchmark": "eta",
        "config": {"cases": [c.name for c in cases], "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                   "drafter": "target weights over the 1024-token RAG context"},
        "machine": machine_info(),
        "positions": len(drafter_tv),
        "drafter_tv_mean": round(statistics.mean(drafter_tv), 4),
        "tv_mean_by_eta": {str(int(eta)): round(statistics.mean(v), 4) for eta, v in tv.items()},
        "tv_median_by_eta": {str(int(eta)): round(statistics.median(v), 4) for eta, v in tv.items()},
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=6)
    p.add_argument("--quality-questions", type=int, default=3, help="questions per QA document for quality")
    p.add_argument("--samples", type=int, default=2, help="sampled answers per question and eta")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "eta.json")
    args = p.parse_args()
    result = run(args)
    write_json(args.json, result)
    print({k: result[k] for k in ("positions", "drafter_tv_mean", "tv_mean_by_eta", "quality")})


if __name__ == "__main__":
    main()
