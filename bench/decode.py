"""Decoding benchmark: long-document QA prompts on the target, greedy, methods side by side, per context length.

    python -m bench.decode [--quick] [--json PATH] [--methods NAME ...] [--repeats N] [--threads N]
                           [--contexts 3500 7500] [--kv-dtype auto|float16|float32] [--cpu-quant ...]

Every method runs on the same prompts in one process with the same threads, interleaved per prompt
(rep -> prompt -> method), after one warm-up run each. Figures, as the papers report them:

- decode throughput: tokens after the first / seconds after the first token; speedup = method / ours
  autoregressive on the same prompt (median of repetitions), then median and min over prompts;
- prefill (time to first token) and end-to-end seconds, reported beside it, separately;
- acceptance length: tokens emitted per target forward after prefill (1.0 for plain decoding);
- lossless: every method's token ids equal our autoregressive token ids (a mismatch is a bug);
- ttft_repeat_ratio: TTFT of a first question over TTFT of the same question asked again on the same
  ~7K-token document, where the engine reuses the cached document prefix KV.

Methods: ``autoregressive`` (our engine, no drafter), one entry per drafter set in ``DRAFTERS`` (adding a
speculative method is one line there), and references whose output is not expected to equal ours (their
agreement is reported, they are left out of ``all_lossless``): ``llama_cpp`` (llama.cpp's greedy decoding of
the same GGUF file, same prompt token ids, same thread count; ``pip install -e .[bench]``) and
``autoregressive_kv_fp32`` / ``_kv_fp16`` (our decoding with the other KV cache precision, same weights).
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
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from bench.common import REPO, DocQA, load_target, machine_info, median, qa_documents, rss_mb, write_json
from decoding.drafter import Drafter
from decoding.drafters import DraftingKit, DraftLM, build_drafters
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.racer import (
    AutomatonCache,
    CrossSessionConfig,
    InProcessSharedTier,
    LogitsTable,
    RacerConfig,
    RacerFactory,
)
from decoding.engine import Engine, EngineConfig
from decoding.generation import DoneEvent, GenerationConfig, Prompt
from decoding.kernels import kernels_active
from decoding.kv_cache import PrefixCache
from decoding.models import LoadedModel
from decoding.prompt import build_prompt, context_rows
from retrieval.retriever import Hit, join_hits

if TYPE_CHECKING:
    from decoding.cpu_llama import CpuLlama

logger = logging.getLogger("bench.decode")

SYSTEM = "You answer questions about the document below. Answer briefly, using only the document."
QUICK_DOCS = {3500: ("mpl-2.0",), 7500: ("gpl-3.0",)}  # one document per context length in --quick
TTFT_DOC = "gpl-3.0"  # ~7.6K tokens
VERIFY_NODES = (0, 2, 4, 8, 16)  # draft nodes per verify forward in the cost curve (0: a plain step)
REFERENCES = ("llama_cpp", "autoregressive_kv_fp32", "autoregressive_kv_fp16")  # not expected to equal ours


@dataclass(frozen=True)
class Case:
    name: str
    document: str
    question: str
    prompt: Prompt  # draft_ids: the RAG drafter's prompt at the default budget
    context: int = 0  # the context length class the document was cut to
    drafts: dict[int, list[int]] = field(default_factory=dict)  # RAG drafter prompt per retrieved budget

    def with_draft(self, budget: int) -> Case:
        return dataclasses.replace(self, prompt=dataclasses.replace(self.prompt, draft_ids=self.drafts[budget]))


@dataclass(frozen=True)
class Bench:
    target: LoadedModel
    engine: Engine
    max_new_tokens: int
    cases: Sequence[Case] = ()
    llama: Any = None  # a llama_cpp.Llama on the same GGUF, when the bench extra is installed
    other_kv: Engine | None = None  # our engine on the same weights with the other KV cache precision


# Our speculative methods: name -> drafters for one case (fresh per run). One line per method.
DrafterFactory = Callable[[Bench, Case], list[Drafter]]
RACER = RacerConfig()
AUTOMATA = AutomatonCache()  # prompt automata are a pure function of the prompt: reused, as in the service


def racer_single(bench: Bench, case: Case) -> list[Drafter]:
    """RACER with per-request knowledge only: a fresh logits table, no shared tier."""
    table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
    return [RacerFactory(RACER, table, None, automata=AUTOMATA).drafter()]


@dataclass
class EarlierSessions:
    """What earlier sessions on the same document left behind: the logits table and their answers."""

    table: np.ndarray
    filled: np.ndarray
    answers: list[tuple[list[int], list[int]]]  # (prompt tail, answer ids) per earlier session


_EARLIER: dict[str, EarlierSessions] = {}


def earlier_sessions(bench: Bench, case: Case) -> EarlierSessions:
    """Run the other questions on this case's document once (session 1), with RACER and a shared tier."""
    if case.name not in _EARLIER:
        table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
        tier = InProcessSharedTier(CrossSessionConfig())
        answers = []
        for other in bench.cases:
            if other.document == case.document and other.name != case.name:
                factory = RacerFactory(RACER, table, tier, model_id=bench.target.name, automata=AUTOMATA)
                out = run_engine(bench, other, [factory.drafter("bench")]).tokens
                answers.append((list(other.prompt.ids[-tier.config.context_len :]), out))
        _EARLIER[case.name] = EarlierSessions(table.table.copy(), table.filled.copy(), answers)
    return _EARLIER[case.name]


def racer_cross_session(bench: Bench, case: Case) -> list[Drafter]:
    """A second session: the logits table and shared tier as the earlier sessions on this document left
    them (rebuilt per run, so a run never learns from its own earlier repetitions)."""
    past = earlier_sessions(bench, case)
    table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
    table.table[:] = past.table
    table.filled[:] = past.filled
    tier = InProcessSharedTier(CrossSessionConfig())
    factory = RacerFactory(RACER, table, tier, model_id=bench.target.name, automata=AUTOMATA)
    shared = tier.cache(bench.target.name, "", "bench")
    for tail, answer in past.answers:
        shared.learn([*tail, *answer], len(tail))
    return [factory.drafter("bench")]


def mode(name: str) -> DrafterFactory:
    """A service mode from the drafter registry, with RACER's per-request knowledge as in ``racer_single``."""

    def make(bench: Bench, case: Case) -> list[Drafter]:
        table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
        kit = DraftingKit(racer=RacerFactory(RACER, table, None, automata=AUTOMATA),
                          draft_lm=lambda: DraftLM(bench.target.model, bench.target.device),
                          target_model=bench.target.model)
        return build_drafters(name, kit)

    return make


DRAFTERS: dict[str, DrafterFactory] = {
    "prompt_lookup": lambda bench, case: [PromptLookupDrafter()],
    "racer": racer_single,
    "racer_cross_session": racer_cross_session,
    "rapid": mode("rapid"),
    "rapid_kv": mode("rapid_kv"),
    "combined": mode("combined"),
    "auto": mode("auto"),
}
RAPID_SWEEP = (512, 2048)  # other RAG drafter budgets, as methods rapid@512, rapid@2048
RAPID_BUDGET = 1024  # retrieved tokens in the RAG drafter's prompt (the service's RAGSPEC_RAPID_CONTEXT_TOKENS)
# The engine as the service configures it: RACER's logits table learns from the prompt's top-k.
ENGINE_CONFIG = EngineConfig(prompt_topk=RACER.topk)


@dataclass
class Run:
    tokens: list[int]
    ttft_s: float  # prefill + first token
    decode_s: float  # after the first emission
    total_s: float
    decode_tokens: int  # tokens emitted after the first emission
    forwards: int  # target forwards after the first emission
    acceptance_length: float
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # nodes verified, per source
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


# ---- methods ----------------------------------------------------------------------------------------


def run_engine(bench: Bench, case: Case, drafters: Sequence[Drafter]) -> Run:
    config = GenerationConfig(max_new_tokens=bench.max_new_tokens)
    done = next(e for e in bench.engine.generate(case.prompt, config, drafters) if isinstance(e, DoneEvent))
    s = done.stats
    return Run(
        tokens=list(done.token_ids),
        ttft_s=s.ttft_s,
        decode_s=s.decode_s,
        total_s=s.total_s,
        decode_tokens=max(0, s.completion_tokens - 1),
        forwards=s.steps,
        acceptance_length=s.acceptance_length or 1.0,
        drafted_by_source=dict(s.drafted_by_source),
        accepted_by_source=dict(s.accepted_by_source),
    )


class _Clock(BaseStreamer):
    """Records when HF generate emits tokens (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []
        self.counts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        return None


def run_hf(bench: Bench, case: Case, **generate_kwargs: Any) -> Run:
    target = bench.target
    ids = torch.tensor([case.prompt.ids], device=target.device)  # [1, n]
    clock = _Clock()
    eos = list(target.eos_token_ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=bench.max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            streamer=clock,
            **generate_kwargs,
        )
    end = time.perf_counter()
    new = out[0, ids.shape[1] :].tolist()
    # Cut at EOS; HF assisted generation can overshoot max_new_tokens by one accepted token: cut there too.
    tokens = new[: next((i for i, t in enumerate(new) if t in eos), len(new))][: bench.max_new_tokens]
    first = clock.times[0] if clock.times else end
    first_n = min(clock.counts[0], len(tokens)) if clock.counts else len(tokens)
    return Run(
        tokens=tokens,
        ttft_s=first - t0,
        decode_s=end - first,
        total_s=end - t0,
        decode_tokens=len(tokens) - first_n,
        forwards=max(0, len(clock.times) - 1),
        acceptance_length=(sum(clock.counts[1:]) / (len(clock.times) - 1)) if len(clock.times) > 1 else 1.0,
    )


def run_llama_cpp(bench: Bench, case: Case) -> Run:
    """llama.cpp's own greedy decoding of the same prompt ids (it reuses its KV of a shared prompt prefix)."""
    llm = bench.llama
    if llm is None:
        raise RuntimeError("llama_cpp needs llama-cpp-python (pip install -e .[bench]) and a GGUF target")
    eos = set(bench.target.eos_token_ids)
    tokens: list[int] = []
    t0 = time.perf_counter()
    first = end = t0
    for tok in llm.generate(list(case.prompt.ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        end = time.perf_counter()
        if not tokens:
            first = end
        if tok in eos:
            break
        tokens.append(int(tok))
        if len(tokens) >= bench.max_new_tokens:
            break
    return Run(
        tokens=tokens,
        ttft_s=first - t0,
        decode_s=end - first,
        total_s=end - t0,
        decode_tokens=max(0, len(tokens) - 1),
        forwards=max(0, len(tokens) - 1),
        acceptance_length=1.0,
    )


def run_other_kv(bench: Bench, case: Case) -> Run:
    assert bench.other_kv is not None
    return run_engine(Bench(bench.target, bench.other_kv, bench.max_new_tokens), case, [])


Method = Callable[[Bench, Case], Run]


def all_methods(target: LoadedModel) -> dict[str, Method]:
    methods: dict[str, Method] = {"autoregressive": lambda bench, case: run_engine(bench, case, [])}
    if target.runtime.startswith("torch"):
        methods["hf_generate"] = lambda bench, case: run_hf(bench, case)
        methods["hf_prompt_lookup"] = lambda bench, case: run_hf(bench, case, prompt_lookup_num_tokens=10)
    for name, make in DRAFTERS.items():
        methods[name] = lambda bench, case, make=make: run_engine(bench, case, make(bench, case))  # type: ignore[misc]
    for budget in RAPID_SWEEP:
        methods[f"rapid@{budget}"] = lambda bench, case, b=budget: run_engine(  # type: ignore[misc]
            bench, case.with_draft(b), mode("rapid")(bench, case))
    methods["llama_cpp"] = run_llama_cpp
    if target.runtime.startswith("cpu-quantized"):
        other = "fp32" if target.runtime.endswith("float16") else "fp16"
        methods[f"autoregressive_kv_{other}"] = run_other_kv
    return methods


def default_methods(methods: dict[str, Method], has_llama: bool) -> list[str]:
    """Everything but the other-KV reference (a separate question: ``--methods autoregressive_kv_...``)."""
    return [m for m in methods if not m.startswith("autoregressive_kv") and (has_llama or m != "llama_cpp")]


# ---- prompts ----------------------------------------------------------------------------------------


class RagContext:
    """The RAG drafter's context for a question, as the service picks it: the document ingested into a document
    store (512-token chunks, the bundled embedder) and ranked by the service's retriever with its default
    scoring, threshold and top-k; the best that fit the budget, in document order."""

    def __init__(self, tokenizer: Any) -> None:
        import tempfile

        from retrieval.embedding import load_embedder
        from retrieval.retriever import Retriever
        from retrieval.store import DocumentStore

        self.tokenizer = tokenizer
        self.embedder = load_embedder("bundled", device="cpu")
        self._dir = tempfile.TemporaryDirectory(prefix="ragspec-bench-rag-")
        self.store = DocumentStore(Path(self._dir.name))
        self.retriever = Retriever(self.store, self.embedder)
        self._ids: dict[str, str] = {}

    def text(self, document: str, question: str, budget: int, top_k: int = 16) -> str:
        return join_hits(self.hits(document, question, budget, top_k))

    def hits(self, document: str, question: str, budget: int, top_k: int = 16) -> list[Hit]:
        if document not in self._ids:
            record = self.store.create(None, "bench", "doc.txt", "text/plain", document.encode("utf-8"))
            self.store.ingest(record.id, self.tokenizer, self.embedder, 512)
            self._ids[document] = record.id
        doc_id = self._ids[document]
        return self.retriever.retrieve(question, [doc_id], top_k=top_k, budget_tokens=budget).hits


def make_cases(
    target: LoadedModel,
    docs: Sequence[DocQA],
    questions_per_doc: int,
    max_new: int,
    max_doc_tokens: int | None = None,
    min_doc_tokens: int = 0,
    rag: RagContext | None = None,
) -> list[Case]:
    """One case per (document, question); documents longer than the window (or the cap) are cut, documents
    shorter than ``min_doc_tokens`` left out. With ``rag``, each case carries the RAG drafter's prompts."""
    tok = target.tokenizer
    room = min(target.max_context - max_new - 256, max_doc_tokens or target.max_context)
    cases = []
    for doc in docs:
        text = doc.text
        ids = tok(text, add_special_tokens=False).input_ids
        if len(ids) < min_doc_tokens:
            continue
        if len(ids) > room:
            text = tok.decode(ids[:room])
            text = text[: text.rfind("\n\n")] if "\n\n" in text else text
        tag = f"@{max_doc_tokens}" if max_doc_tokens else ""
        for i, question in enumerate(doc.questions[:questions_per_doc]):
            prompt = build_prompt(tok, system=SYSTEM, document=text, question=question, prefix_key=doc.name + tag)
            drafts = {}
            for budget in (RAPID_BUDGET, *RAPID_SWEEP) if rag is not None else ():
                context = rag.text(text, question, budget)  # type: ignore[union-attr]
                drafts[budget] = build_prompt(tok, system=SYSTEM, document=context, question=question,
                                              prefix_key=None).ids
            rows = None
            if rag is not None:
                spans = [(h.start, h.end) for h in rag.hits(text, question, RAPID_BUDGET)]
                rows = context_rows(tok, prompt, text, spans)
            prompt = dataclasses.replace(prompt, draft_ids=drafts.get(RAPID_BUDGET), draft_rows=rows)
            cases.append(Case(f"{doc.name}/q{i + 1}{tag}", text, question, prompt, max_doc_tokens or 0, drafts))
    return cases


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
            "reps": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in reps],
        }
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
    from decoding.bundled import GGUF_LINK, bundled_gguf_dir

    if spec == "bundled":
        return bundled_gguf_dir(data_dir / "models") / GGUF_LINK
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def open_llama(gguf: Path | None, threads: int) -> tuple[Any, float]:
    """llama.cpp on ``gguf`` (full window, this many threads) and the resident MB it added; None if unavailable."""
    if gguf is None:
        return None, 0.0
    try:
        from llama_cpp import Llama
    except ImportError:
        logger.warning("llama-cpp-python not installed (pip install -e .[bench]): no llama_cpp method")
        return None, 0.0
    before = rss_mb()
    llm = Llama(model_path=str(gguf), n_ctx=8192, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    return llm, rss_mb() - before


def measure_prefill(bench: Bench, case: Case, repeats: int) -> dict[str, Any]:
    """Cold prefill throughput of the case's whole prompt: ours (no cached prefix) and llama.cpp's."""
    ours: list[float] = []
    theirs: list[float] = []
    n = len(case.prompt.ids)
    for _ in range(repeats):
        engine = Engine(bench.target, None, config=ENGINE_CONFIG)
        done = next(e for e in engine.generate(case.prompt, GenerationConfig(max_new_tokens=1))
                    if isinstance(e, DoneEvent))
        ours.append(n / done.stats.prefill_s)
        if bench.llama is not None:
            bench.llama.reset()
            t = time.perf_counter()
            bench.llama.eval(list(case.prompt.ids))
            theirs.append(n / (time.perf_counter() - t))
            bench.llama.reset()
    out: dict[str, Any] = {"prompt_tokens": n, "ours_tokens_per_s": round(median(ours), 1)}
    if theirs:
        out["llama_cpp_tokens_per_s"] = round(median(theirs), 1)
        out["ours_vs_llama_cpp"] = round(median(ours) / median(theirs), 3)
    return out


def verify_curve(bench: Bench, context: int, repeats: int) -> dict[str, Any]:
    """A forward over 2 / 4 / 8 / 16 draft nodes (3 / 5 / 9 / 17 rows) relative to a plain step, ours and
    llama.cpp's (evaluating as many tokens at once) on a ``context``-token cache."""
    base, costs = bench.engine.verify_costs(context, VERIFY_NODES, repeats)
    step = costs[0]
    out: dict[str, Any] = {
        "context_tokens": base,
        "step_ms": round(1000 * step, 2),
        "ours_vs_step": {str(k): round(v / step, 3) for k, v in costs.items() if k},
    }
    llm = bench.llama
    if llm is not None:
        gen = torch.Generator().manual_seed(context)
        vocab = bench.target.vocab_size
        llm.reset()
        llm.eval(torch.randint(0, vocab, (base,), generator=gen).tolist())
        times: dict[int, list[float]] = {k: [] for k in VERIFY_NODES}
        for _ in range(repeats):
            for nodes in VERIFY_NODES:
                llm.n_tokens = base  # eval drops the KV beyond n_tokens first
                batch = torch.randint(0, vocab, (nodes + 1,), generator=gen).tolist()
                t = time.perf_counter()
                llm.eval(batch)
                times[nodes].append(time.perf_counter() - t)
        llm.reset()
        theirs = {k: median(v) for k, v in times.items()}
        out["llama_cpp_step_ms"] = round(1000 * theirs[0], 2)
        out["llama_cpp_vs_step"] = {str(k): round(v / theirs[0], 3) for k, v in theirs.items() if k}
        out["ours_step_vs_llama_cpp_step"] = round(step / theirs[0], 3)
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
    if "llama_cpp" in names:
        llama = [r["methods"]["llama_cpp"]["decode_tokens_per_s"] for r in results]
        ours = [n for n in names if n not in REFERENCES and not n.startswith("hf_")]

        def vs_llama(name: str) -> float:
            tps = [r["methods"][name]["decode_tokens_per_s"] for r in results]
            return round(median([a / b for a, b in zip(tps, llama, strict=True) if b > 0]), 4)

        ratios = {name: vs_llama(name) for name in ours}
        out["vs_llama_cpp"] = {
            "autoregressive": ratios["autoregressive"],
            "best_speculative": max((v for k, v in ratios.items() if k != "autoregressive"), default=0.0),
            "best_speculative_method": max((k for k in ratios if k != "autoregressive"), key=ratios.__getitem__,
                                           default=""),
            "by_method": ratios,
        }
    return out


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    before = rss_mb()
    target = load_target(args.model, Path(args.data_dir), cpu_quant=args.cpu_quant, kv_dtype=args.kv_dtype)
    target_rss = rss_mb() - before
    methods = all_methods(target)
    llm, llama_rss = (None, 0.0)
    if args.methods is None or "llama_cpp" in args.methods:
        llm, llama_rss = open_llama(gguf_of(args.model, Path(args.data_dir)), threads)
    names = ["autoregressive", *[m for m in (args.methods or default_methods(methods, llm is not None))
                                 if m != "autoregressive"]]
    unknown = [m for m in names if m not in methods]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {sorted(methods)}")

    cases: list[Case] = []
    rag = RagContext(target.tokenizer) if any(n.startswith(("rapid", "combined", "auto")) for n in names) else None
    for context in args.contexts:
        docs = qa_documents(QUICK_DOCS.get(context, QUICK_DOCS[3500]) if args.quick else None)
        min_tokens = int(0.9 * context) if context > 4000 else 0  # the long class: documents that fill it
        cases += make_cases(target, docs, 1 if args.quick else 2, args.max_new_tokens, context, min_tokens, rag)
    # Our methods share the document prefix KV (as in the service); speedups compare decode throughput.
    engine = Engine(target, PrefixCache(byte_budget=6 << 30), config=ENGINE_CONFIG)
    engine.calibrate()
    other_kv = None
    if any(n.startswith("autoregressive_kv") for n in names):
        from decoding.cpu_llama import CpuLlama

        model: CpuLlama = target.model
        kv = torch.float32 if model.kv_dtype == torch.float16 else torch.float16
        twin = dataclasses.replace(target, model=CpuLlama(model.weights, kv))
        other_kv = Engine(twin, PrefixCache(byte_budget=6 << 30), config=ENGINE_CONFIG)
    bench = Bench(target, engine, args.max_new_tokens, cases, llm, other_kv)

    warmup = make_cases(target, [DocQA(d.name, d.text[:1500], d.questions) for d in qa_documents()[:1]], 1, 8,
                        rag=rag)[0]
    for name in names:
        methods[name](dataclasses.replace(bench, max_new_tokens=8), warmup)

    runs: dict[str, dict[str, list[Run]]] = {c.name: {m: [] for m in names} for c in cases}
    for rep in range(args.repeats):
        for case in cases:
            for name in names:
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
        logger.info("context %d: %s", context, contexts[str(context)].get("vs_llama_cpp"))

    [ttft_doc] = qa_documents([TTFT_DOC])
    ttft = measure_ttft_repeat(target, ttft_doc, 1 if args.quick else 2, None)  # always the whole ~7K-token document

    overall = summarize(results, names)
    summary = {
        "all_lossless": overall["all_lossless"],
        "ttft_repeat_ratio": ttft["ratio"],
        "methods": {k: v for k, v in overall["methods"].items() if k != "autoregressive"},
        "contexts": {
            c: {k: v for k, v in row.items() if k in ("prompts", "all_lossless", "vs_llama_cpp")}
            | {"ar_tokens_per_second_median": row["methods"]["autoregressive"]["tokens_per_second_median"],
               "verify_8_nodes_vs_step": row["verify_cost"]["ours_vs_step"].get("8"),
               "prefill_ours_vs_llama_cpp": row["prefill"].get("ours_vs_llama_cpp")}
            for c, row in contexts.items()
        },
    }
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
            "verify_cost_slope_s_per_1k_tokens": {
                str(k): round(1000 * v, 5) for k, v in sorted(engine.policy.cost_slope.items())
            },
            "cpu_kernels": target.runtime.startswith("cpu-quantized") or kernels_active(target.model),
            "llama_cpp": _llama_version() if llm is not None else None,
        },
        "memory": {
            "served_weights_mb": round(target.weight_bytes / 1e6, 1),
            "target_rss_mb": round(target_rss, 1),
            "llama_cpp_rss_mb": round(llama_rss, 1) if llm is not None else None,
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
        "per_method": per_method,
        "summary": summary,
    }


def _llama_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1 prompt per context length, 1 repetition, 48 new tokens (minutes)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--methods", nargs="+", default=None, help="subset of methods (autoregressive always runs)"
    )
    p.add_argument("--repeats", type=int, default=None, help="repetitions per prompt (default 3; quick 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; quick 48")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--contexts", type=int, nargs="+", default=[3500, 7500],
                   help="context length classes: documents cut to this many tokens (default 3500 7500)")
    p.add_argument("--model", default="bundled", help="target: 'bundled', a GGUF file, a local HF dir or hub id")
    p.add_argument("--data-dir", default=str(REPO / "data"), help="where the bundled model lives")
    p.add_argument("--cpu-quant", default="auto", help="CPU target weights: auto, q8_0, q4_1, none (torch fp32)")
    p.add_argument("--kv-dtype", default="auto", help="KV cache of the quantized CPU runtime: auto, float16, float32")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
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
