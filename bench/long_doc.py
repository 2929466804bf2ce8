"""Long documents: the QA set's six texts as one ~40K-token document, far beyond the bundled target's window.

    python -m bench.long_doc [--quick] [--json PATH]

Everything goes through the service's own parts: ``DocumentStore`` ingest (512-token chunks, the bundled
embedder), ``Retriever.rank`` and ``PromptBuilder.fit`` (the target's prompt: the documents' lead,
then the best chunks in document order, each chunk a cacheable segment), and the ``Engine`` with a
``PrefixCache``.

1. Budget table, every QA question (no model run): for each (budget, lead), the share of questions whose gold
   passage is inside the target's prompt ("containment"), the prompt length, and the KV a session asking all
   the questions in turn reuses from the chunk radix cache (the engine's own segment keys; nothing evicted;
   the lead's KV computed at upload).
2. Time to first token, the real engine (bundled target, 2 threads), per (budget, lead): a few questions each
   asked cold (only the lead cached, as right after the upload), the same question again, and a related
   question (the next question on the same source text): median TTFT of each, the repeat's speed-up and the
   share of the related question's prompt whose KV was reused.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.answering.prompts import DocumentText, PromptBuilder
from bench.common import REPO, load_target, machine_info, median, write_json
from bench.datasets import DATA_DIR, DECODING_DOCS, load_qa, passage_pattern
from decoding.cache.prefix import PrefixCache, segment_keys
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt
from retrieval.embedding import load_embedder
from retrieval.retriever import Retriever
from retrieval.store import DocumentStore

logger = logging.getLogger("bench.long_doc")

DEFAULT_JSON = REPO / "bench" / "results" / "long_doc.json"
MAX_TOKENS = 256  # the service's default max_tokens: the room a prompt leaves for the answer
BUDGETS = (2048, 4096, 0)  # 0: as much as the window holds
LEADS = (0, 512, 1024)
DISTRACTORS = (("GNU General Public License, version 2", "gpl-2.0.txt"), ("The Artistic License", "artistic-1.0.txt"))


@dataclass(frozen=True)
class Question:
    text: str
    source: str  # the QA document it was written for
    passage: str  # the quote holding its answer


def out(text: str) -> None:
    print(text, flush=True)


def long_document() -> tuple[str, list[Question]]:
    """The QA texts one after the other under their titles, then two texts without questions (near-duplicates
    of the licences, bench/data/README.md), and every question with its gold passage."""
    parts, questions = [], []
    for doc in load_qa():
        if doc.doc_id not in DECODING_DOCS:
            continue
        parts.append(f"{doc.title}\n\n{doc.text.strip()}")
        questions += [Question(q.question, doc.doc_id, q.answer_passage) for q in doc.questions]
    for title, name in DISTRACTORS:
        parts.append(f"{title}\n\n{(DATA_DIR / name).read_text(encoding='utf-8').strip()}")
    return "\n\n\n".join(parts), questions


class Setup:
    """The document ingested as the service does it, and the target."""

    def __init__(self, root: Path, threads: int) -> None:
        self.target = load_target("bundled", threads=threads)
        self.tokenizer = self.target.tokenizer
        self.embedder = load_embedder("bundled", device="cpu")
        self.store = DocumentStore(root)
        text, self.questions = long_document()
        record = self.store.create(None, "QA texts", "qa.txt", "text/plain", text.encode("utf-8"))
        t = time.perf_counter()
        self.store.ingest(record.id, self.tokenizer, self.embedder, 512)
        self.ingest_s = time.perf_counter() - t
        self.record = self.store.get(record.id)
        self.retriever = Retriever(self.store, self.embedder)
        self.docs = [DocumentText(self.record.id, self.record.title, self.record.n_tokens,
                                  lambda: self.store.load_text(self.record.id))]

    def builder(self, budget: int, lead: int) -> PromptBuilder:
        return PromptBuilder(self.tokenizer, self.target.name, self.target.max_context, long_budget=budget,
                             lead_tokens=lead)

    def prompt(self, builder: PromptBuilder, question: str) -> Prompt:
        ranking = self.retriever.rank([question], [self.record.id])
        return builder.fit(self.docs, question, [], MAX_TOKENS, ranking)

    def warm(self, builder: PromptBuilder) -> Prompt | None:
        return builder.warm_prompt(self.docs, MAX_TOKENS, self.retriever)


def contains(tokenizer: Any, prompt: Prompt, passage: str) -> bool:
    return passage_pattern(passage).search(tokenizer.decode(list(prompt.prefix_ids))) is not None


def budget_table(setup: Setup, budgets: tuple[int, ...], leads: tuple[int, ...]) -> list[dict[str, Any]]:
    """Containment, prompt length and session reuse for every (budget, lead), over every question."""
    rows = []
    model = setup.target.name
    for budget in budgets:
        for lead in leads:
            if budget and lead >= budget:
                continue
            builder = setup.builder(budget, lead)
            seen: set[str] = set()
            warm = setup.warm(builder)
            if warm is not None and warm.prefix_key:
                seen.update(segment_keys(model, warm.prefix_key, warm.prefix_ids, warm.segment_ends))
            found, lengths, reused = 0, [], []
            for q in setup.questions:
                prompt = setup.prompt(builder, q.text)
                found += contains(setup.tokenizer, prompt, q.passage)
                keys = segment_keys(model, prompt.prefix_key or "", prompt.ids, prompt.segment_ends)
                hit = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
                reused.append(prompt.segment_ends[hit - 1] if hit else 0)
                lengths.append(len(prompt.ids))
                seen.update(keys)
            row = {
                "budget": budget or "window",
                "lead": lead,
                "questions": len(setup.questions),
                "containment": round(found / len(setup.questions), 3),
                "prompt_tokens_median": median(lengths),
                "session_reuse_share_mean": round(sum(r / n for r, n in zip(reused, lengths, strict=True))
                                                  / len(lengths), 3),
                "session_prefill_tokens_median": median([n - r for r, n in zip(reused, lengths, strict=True)]),
            }
            rows.append(row)
            out(f"  budget {row['budget']!s:>6} lead {lead:>5}: containment {row['containment']:.2f}, prompt "
                f"{row['prompt_tokens_median']:.0f} tokens, session reuse {row['session_reuse_share_mean']:.2f}")
    return rows


def first_token(engine: Engine, prompt: Prompt) -> DoneEvent:
    done = None
    for event in engine.generate(prompt, GenerationConfig(max_new_tokens=1)):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done


def ttft(setup: Setup, budget: int, lead: int, picks: list[tuple[Question, Question]]) -> dict[str, Any]:
    """Cold / repeated / related question TTFT with the real engine, a fresh cache per question pair."""
    builder = setup.builder(budget, lead)
    cold, repeat, related, related_share, warm_s = [], [], [], [], []
    for q, r in picks:
        engine = Engine(setup.target, PrefixCache(8 << 30))
        warm = setup.warm(builder)
        if warm is not None:
            t = time.perf_counter()
            engine.warm_prefix(warm)
            warm_s.append(time.perf_counter() - t)
        prompt = setup.prompt(builder, q.text)
        first = first_token(engine, prompt)
        again = first_token(engine, prompt)
        assert again.token_ids == first.token_ids  # greedy: the same first token from cached KV
        other = first_token(engine, setup.prompt(builder, r.text))
        cold.append(first.stats.ttft_s)
        repeat.append(again.stats.ttft_s)
        related.append(other.stats.ttft_s)
        related_share.append(other.stats.prefix_reused_tokens / other.stats.prompt_tokens)
        out(f"  budget {budget or 'window'!s:>6} lead {lead:>5}: cold {first.stats.ttft_s:6.2f} s "
            f"({first.stats.prompt_tokens} tokens, {first.stats.prefix_reused_tokens} reused), repeat "
            f"{again.stats.ttft_s:5.2f} s, related {other.stats.ttft_s:6.2f} s "
            f"({other.stats.prefix_reused_tokens}/{other.stats.prompt_tokens} reused)")
    return {
        "budget": budget or "window",
        "lead": lead,
        "questions": len(picks),
        "lead_warm_s_median": round(median(warm_s), 3) if warm_s else None,
        "ttft_cold_s_median": round(median(cold), 3),
        "ttft_repeat_s_median": round(median(repeat), 3),
        "repeat_speedup_median": round(median([c / a for c, a in zip(cold, repeat, strict=True)]), 1),
        "ttft_related_s_median": round(median(related), 3),
        "related_reuse_share_median": round(median(related_share), 3),
        "ttft_cold_s": [round(x, 3) for x in cold],
        "ttft_repeat_s": [round(x, 3) for x in repeat],
        "ttft_related_s": [round(x, 3) for x in related],
    }


def pairs(questions: list[Question], n: int) -> list[tuple[Question, Question]]:
    """``n`` (question, related question) pairs from different source texts: a question and the next one
    written for the same text."""
    by_source: dict[str, list[Question]] = {}
    for q in questions:
        by_source.setdefault(q.source, []).append(q)
    picks = [(qs[0], qs[1]) for qs in by_source.values() if len(qs) > 1]
    return picks[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one question per TTFT row, fewer configurations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3, help="question pairs per TTFT row")
    parser.add_argument("--default-budget", type=int, default=4096)
    parser.add_argument("--default-lead", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="ragspec-longdoc-") as tmp:
        setup = Setup(Path(tmp), args.threads)
        out(f"document: {setup.record.n_tokens} tokens in {setup.record.n_chunks} chunks (window "
            f"{setup.target.max_context}), {len(setup.questions)} questions; ingest {setup.ingest_s:.1f} s")
        out("budget table (every question, no model run):")
        leads = (0, 512) if args.quick else LEADS
        table = budget_table(setup, BUDGETS, leads)
        out("time to first token (real engine):")
        picks = pairs(setup.questions, 1 if args.quick else args.questions)
        configs = [(b, 0) for b in BUDGETS]  # then the default budget with a lead (warmed as at upload)
        configs += [(args.default_budget, lead) for lead in sorted({512, args.default_lead} - {0})]
        timing = [ttft(setup, b, lead, picks) for b, lead in configs]
        default = next(t for t in timing if t["budget"] == (args.default_budget or "window")
                       and t["lead"] == args.default_lead)
        result = {
            "benchmark": "long_doc",
            "machine": machine_info(),
            "threads": args.threads,
            "document": {"tokens": setup.record.n_tokens, "chunks": setup.record.n_chunks,
                         "window": setup.target.max_context, "questions": len(setup.questions),
                         "ingest_s": round(setup.ingest_s, 2)},
            "budget_table": table,
            "ttft": timing,
            "default": {"budget": args.default_budget, "lead": args.default_lead,
                        "repeat_speedup_median": default["repeat_speedup_median"],
                        "repeat_speedup_min": round(min(c / a for c, a in zip(
                            default["ttft_cold_s"], default["ttft_repeat_s"], strict=True)), 1),
                        "related_reuse_share_median": default["related_reuse_share_median"]},
            "noise": {"cold_ttft_spread": round(statistics.pstdev(default["ttft_cold_s"])
                                                / max(1e-9, default["ttft_cold_s_median"]), 3)},
        }
    write_json(args.json, result)
    out(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
