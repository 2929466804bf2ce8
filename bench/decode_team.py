"""bench.decode's team scenario: one tenant's sessions asking about the same documents one after another.

Per document (``bench/data/team.json``) ten questions in sequence, each by a new session: five asked for the first
time, three paraphrases of earlier ones and two asked again word for word. Every method keeps its own
cross-session state for the sequence (the tier, RACER's logits table) and learns from each answer as the service
does (``app.answering.drafters.Drafters.learn``: every answer whole, continuation counts for modes without RACER,
whose ``end`` counts its own), so a
repeated or paraphrased question meets what the earlier sessions left. Each question runs plain decoding first
(the speed-up's reference, the lossless check), then every method; the whole sequence is repeated with fresh state.
"""


from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import DocQA, qa_documents
from bench.datasets import DATA_DIR
from bench.decode_cases import RagContext, make_cases
from bench.decode_methods import RACER, Bench, Run, run_engine
from decoding.drafters.racer import CrossSessionConfig, InProcessSharedTier, LogitsTable, RacerFactory
from decoding.drafters.registry import MODES, DraftingKit, DraftLM, build_drafters
from decoding.speculative.drafter import Drafter
from decoding.speculative.generation import Prompt

TEAM_FILE = DATA_DIR / "team.json"
TENANT = "team"


@dataclass(frozen=True)
class TeamQuestion:
    text: str
    kind: str  # "first", "repeat" (word for word) or "paraphrase"
    of: int | None = None  # the earlier position (0-based) it repeats or paraphrases


def team_sequences(documents: Sequence[DocQA]) -> dict[str, list[TeamQuestion]]:
    """The question sequence of every document of ``team.json`` among ``documents``."""
    spec = json.loads(TEAM_FILE.read_text())["documents"]
    out: dict[str, list[TeamQuestion]] = {}
    for doc in documents:
        if doc.name not in spec:
            continue
        first: dict[str, int] = {}
        seq: list[TeamQuestion] = []
        for i, entry in enumerate(spec[doc.name]):
            if isinstance(entry, str):
                text = doc.questions[int(entry.removeprefix("q")) - 1]
                if entry in first:
                    seq.append(TeamQuestion(text, "repeat", first[entry]))
                else:
                    first[entry] = i
                    seq.append(TeamQuestion(text, "first"))
            else:
                seq.append(TeamQuestion(entry["question"], "paraphrase", first[entry["paraphrase_of"]]))
        out[doc.name] = seq
    return out


class _State:
    """One method's cross-session state over one document's sequence (what earlier sessions left)."""

    def __init__(self, bench: Bench) -> None:
        self.table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
        self.tier = InProcessSharedTier(CrossSessionConfig())
        self.factory = RacerFactory(RACER, self.table, self.tier, model_id=bench.target.name)

    def drafters(self, bench: Bench, mode: str) -> list[Drafter]:
        kit = DraftingKit(racer=self.factory, tenant=TENANT,
                          draft_lm=lambda: DraftLM(bench.target.model, bench.target.device),
                          target_model=bench.target.model)
        return build_drafters(mode, kit)

    def learn(self, mode: str, prompt: Prompt, answer: Sequence[int]) -> None:
        """As the service does after every answer (``app.answering.drafters.Drafters.learn``): the answer whole in
        its documents' answer list, its continuation counts unless RACER's drafter counted them itself."""
        cache = self.tier.cache(self.factory.model_id, self.factory.tokenizer_hash, TENANT)
        cache.remember(prompt.ids, answer, prompt.prefix_key or "", "racer" not in MODES[mode])


def run_team(bench: Bench, modes: Sequence[str], repeats: int, context: int, docs: Sequence[str] | None = None,
             rag: RagContext | None = None) -> dict[str, Any]:
    """The scenario over ``docs`` (default: every document of team.json) cut to ``context`` tokens; per question
    and method the speed-up over plain decoding (median over repetitions) and acceptance by source."""
    documents = qa_documents(docs) if docs is not None else [
        d for d in qa_documents() if d.name in json.loads(TEAM_FILE.read_text())["documents"]]
    sequences = team_sequences(documents)
    runs: dict[tuple[str, int], dict[str, list[Run]]] = {}
    lossless = True
    for _ in range(repeats):
        for doc in documents:
            states = {m: _State(bench) for m in modes}
            for i, q in enumerate(sequences[doc.name]):
                [case] = make_cases(bench.target, [DocQA(doc.name, doc.text, (q.text,))], 1, bench.max_new_tokens,
                                    context, 0, rag)
                per = runs.setdefault((doc.name, i), {m: [] for m in ("autoregressive", *modes)})
                plain = run_engine(bench, case, [])
                per["autoregressive"].append(plain)
                for m in modes:
                    run = run_engine(bench, case, states[m].drafters(bench, m))
                    lossless &= run.tokens == plain.tokens
                    per[m].append(run)
                    states[m].learn(m, case.prompt, run.tokens)
    questions = []
    for (name, i), per in runs.items():
        q = sequences[name][i]
        plain_tps = statistics.median(r.decode_tps for r in per["autoregressive"])
        row: dict[str, Any] = {"document": name, "position": i, "kind": q.kind, "of": q.of, "question": q.text,
                               "tokens": len(per["autoregressive"][0].tokens), "methods": {}}
        for m in modes:
            rs = per[m]
            tps = statistics.median(r.decode_tps for r in rs)
            row["methods"][m] = {
                "speedup_vs_ar": round(tps / plain_tps, 4) if plain_tps else None,
                "acceptance_length": round(statistics.median(r.acceptance_length for r in rs), 3),
                "accepted_by_source": _summed(r.accepted_by_source for r in rs),
                "drafted_by_source": _summed(r.drafted_by_source for r in rs),
            }
        questions.append(row)
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in ("first", "paraphrase", "repeat"):
        rows = [q for q in questions if q["kind"] == kind]
        by_kind[kind] = {m: _spread([q["methods"][m]["speedup_vs_ar"] for q in rows]) for m in modes}
    return {"context": context, "documents": [d.name for d in documents], "repeats": repeats,
            "all_lossless": lossless, "speedup_by_kind": by_kind, "questions": questions}


def _summed(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _spread(values: list[float | None]) -> dict[str, Any]:
    got = sorted(v for v in values if v is not None)
    if not got:
        return {}
    return {"median": round(statistics.median(got), 4), "min": got[0], "max": got[-1], "questions": len(got)}
