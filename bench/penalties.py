"""Does a default repetition / frequency penalty help the bundled model's answers? Greedy answers to every
question of the QA set, without and with each candidate penalty.

    python -m bench.penalties [--questions-per-doc N] [--max-new-tokens N] [--json PATH]

Each question's prompt is the service's: its system prompt, then the question's best chunks of its document as
the service's retriever ranks them (within ``--context-tokens``), then the question. An answer "contains the
gold answer" when it holds at least half of the gold passage's content words (``bench.eta.contains_gold``: the
QA set's gold answers are passages quoted from the document). An answer "loops" when some run of
``LOOP_NGRAM`` tokens occurs in it twice. Reported per setting: the share of answers containing gold, the
share that loop, the share cut by the token limit and the mean answer length; the shipped default
(``RAGSPEC_DEFAULT_*_PENALTY``) is the setting with the most answers containing gold (no penalty on a tie).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from app.answering.prompts import SYSTEM_PROMPT
from bench.common import REPO, load_target, machine_info, write_json
from bench.datasets import load_qa
from bench.decode_cases import RagContext
from bench.eta import contains_gold
from decoding.cache.prefix import PrefixCache
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, SamplingParams
from decoding.speculative.prompt import build_prompt

logger = logging.getLogger("bench.penalties")
LOOP_NGRAM = 8
SETTINGS: dict[str, SamplingParams] = {
    "none": SamplingParams(),
    "frequency_0.5": SamplingParams(frequency_penalty=0.5),
    "frequency_1.0": SamplingParams(frequency_penalty=1.0),
    "frequency_1.5": SamplingParams(frequency_penalty=1.5),
    "frequency_2.0": SamplingParams(frequency_penalty=2.0),
    "presence_1.0": SamplingParams(presence_penalty=1.0),
    "repetition_1.15": SamplingParams(repetition_penalty=1.15),
}


def loops(ids: Sequence[int], n: int = LOOP_NGRAM) -> bool:
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return bool(grams) and max(grams.values()) >= 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    target = load_target("bundled", Path(args.data_dir))
    rag = RagContext(target.tokenizer)
    engine = Engine(target, PrefixCache(byte_budget=2 << 30))  # each prompt's KV computed once for all settings
    answers: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for doc in load_qa():
        for i, qa in enumerate(doc.questions[: args.questions_per_doc]):
            context = rag.text(doc.text, qa.question, args.context_tokens)
            prompt = build_prompt(target.tokenizer, system=SYSTEM_PROMPT, document=context, question=qa.question,
                                  prefix_key=f"{doc.doc_id}/q{i}")
            for name, sampling in SETTINGS.items():
                config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling)
                done = next(e for e in engine.generate(prompt, config) if isinstance(e, DoneEvent))
                answers[name].append({"question": f"{doc.doc_id}/q{i + 1}", "gold": contains_gold(done.text,
                                      qa.answer_passage), "loops": loops(done.token_ids),
                                      "length": len(done.token_ids), "cut": done.finish_reason == "length"})
            logger.info("%s/q%d: gold %s", doc.doc_id, i + 1,
                        " ".join(f"{n}={int(a[-1]['gold'])}" for n, a in answers.items()))
    table = {}
    for name, rows in answers.items():
        table[name] = {
            "answers": len(rows),
            "containing_gold": sum(r["gold"] for r in rows),
            "gold_rate": round(sum(r["gold"] for r in rows) / len(rows), 4),
            "loop_rate": round(sum(r["loops"] for r in rows) / len(rows), 4),
            "cut_by_limit_rate": round(sum(r["cut"] for r in rows) / len(rows), 4),
            "mean_tokens": round(statistics.mean(r["length"] for r in rows), 1),
        }
    best = max(SETTINGS, key=lambda n: (table[n]["containing_gold"], n == "none"))
    return {
        "benchmark": "penalties",
        "config": {"questions_per_doc": args.questions_per_doc, "max_new_tokens": args.max_new_tokens,
                   "context_tokens": args.context_tokens, "decoding": "greedy", "loop_ngram": LOOP_NGRAM,
                   "settings": {n: {k: v for k, v in vars(s).items() if k.endswith("penalty")}
                                for n, s in SETTINGS.items()}},
        "machine": machine_info(),
        "table": table,
        "best": best,
        "per_question": answers,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--questions-per-doc", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--context-tokens", type=int, default=1536)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data-dir", default=str(REPO / "data"))
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "penalties.json")
    args = p.parse_args()
    result = run(args)
    write_json(args.json, result)
    for name, row in result["table"].items():
        logger.info("%-16s gold %.3f  loops %.3f  cut %.3f  tokens %.1f", name, row["gold_rate"], row["loop_rate"],
                    row["cut_by_limit_rate"], row["mean_tokens"])
    logger.info("best: %s", result["best"])


if __name__ == "__main__":
    main()
