"""bench.decode's methods: the cases and the drafter sets it compares, and how one run of each is timed.

``DRAFTERS`` names our speculative methods (one line each); ``all_methods`` adds plain decoding, the HF
generate references on the torch runtime, llama.cpp and the other KV precision.
"""


from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from bench.llama_ref import BUILDS, LlamaWorker
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.drafters.racer import (
    CrossSessionConfig,
    InProcessSharedTier,
    LogitsTable,
    RacerConfig,
    RacerFactory,
)
from decoding.drafters.rapid import RapidDrafter
from decoding.drafters.registry import DraftingKit, DraftLM, build_drafters
from decoding.runtime.loader import LoadedModel
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.drafter import Drafter
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt

if TYPE_CHECKING:
    from decoding.runtime.quantized import QuantizedModel  # noqa: F401

logger = logging.getLogger("bench.decode")

SYSTEM = "You answer questions about the document below. Answer briefly, using only the document."
# our decoding on another KV storage
KV_TWINS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
LLAMA_REFS = tuple(BUILDS)  # llama.cpp builds: the best one here, the AVX2 one
REFERENCES = (*LLAMA_REFS, *(f"autoregressive_kv_{name}" for name in KV_TWINS))  # not expected to equal ours
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
    llama: dict[str, LlamaWorker] = field(default_factory=dict)  # llama.cpp builds on the same GGUF (bench.llama_ref)
    other_kv: dict[str, Engine] = field(default_factory=dict)  # our engine on the same weights, other KV storage


# Our speculative methods: name -> drafters for one case (fresh per run). One line per method.
DrafterFactory = Callable[[Bench, Case], list[Drafter]]
RACER = RacerConfig()


def racer_single(bench: Bench, case: Case) -> list[Drafter]:
    """RACER with per-request knowledge only: a fresh logits table, no shared tier."""
    table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
    return [RacerFactory(RACER, table, None).drafter()]


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
                factory = RacerFactory(RACER, table, tier, model_id=bench.target.name)
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
    factory = RacerFactory(RACER, table, tier, model_id=bench.target.name)
    shared = tier.cache(bench.target.name, "", "bench")
    for tail, answer in past.answers:
        shared.learn([*tail, *answer], len(tail))
    return [factory.drafter("bench")]


def mode(name: str) -> DrafterFactory:
    """A service mode from the drafter registry, with RACER's per-request knowledge as in ``racer_single`` and
    an empty cross-session tier (a tenant's first question)."""

    def make(bench: Bench, case: Case) -> list[Drafter]:
        table = LogitsTable(bench.target.vocab_size, k=RACER.topk, model_id=bench.target.name)
        tier = InProcessSharedTier(CrossSessionConfig())
        kit = DraftingKit(racer=RacerFactory(RACER, table, tier, model_id=bench.target.name),
                          draft_lm=lambda: DraftLM(bench.target.model, bench.target.device),
                          target_model=bench.target.model)
        return build_drafters(name, kit)

    return make


DRAFTERS: dict[str, DrafterFactory] = {
    "prompt_lookup": lambda bench, case: [PromptLookupDrafter()],
    "suffix": mode("suffix"),
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
    # an LM drafter's spend (RAPID, rapid_kv): its forwards, their seconds, its own prefill (inside decode_s)
    draft_forwards: int = 0
    draft_s: float = 0.0
    draft_prefill_s: float = 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


# ---- methods ----------------------------------------------------------------------------------------


def run_engine(bench: Bench, case: Case, drafters: Sequence[Drafter]) -> Run:
    config = GenerationConfig(max_new_tokens=bench.max_new_tokens)
    done = next(e for e in bench.engine.generate(case.prompt, config, drafters) if isinstance(e, DoneEvent))
    s = done.stats
    lms = [d for d in drafters if isinstance(d, RapidDrafter)]
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
        draft_forwards=sum(d.forwards for d in lms),
        draft_s=sum(d.draft_s for d in lms),
        draft_prefill_s=sum(d.prefill_s for d in lms),
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
    assert isinstance(target.model, TorchRuntime), "HF generate runs on the torch runtime"
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.model.module.generate(
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


def run_llama_cpp(bench: Bench, case: Case, name: str) -> Run:
    """llama.cpp's own greedy decoding of the same prompt ids (it reuses its KV of a shared prompt prefix)."""
    if name not in bench.llama:
        raise RuntimeError(f"{name} needs llama-cpp-python (pip install -e .[bench]), its build "
                           "(scripts/build-llama-cpp) and a GGUF target")
    out = bench.llama[name].generate(list(case.prompt.ids), bench.max_new_tokens, list(bench.target.eos_token_ids))
    n = len(out["tokens"])
    return Run(
        tokens=out["tokens"],
        ttft_s=out["ttft_s"],
        decode_s=out["decode_s"],
        total_s=out["total_s"],
        decode_tokens=max(0, n - 1),
        forwards=max(0, n - 1),
        acceptance_length=1.0,
    )


def run_other_kv(bench: Bench, case: Case, name: str) -> Run:
    return run_engine(Bench(bench.target, bench.other_kv[name], bench.max_new_tokens), case, [])


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
    for name in LLAMA_REFS:
        methods[name] = lambda bench, case, n=name: run_llama_cpp(bench, case, n)  # type: ignore[misc]
    if target.runtime.startswith("cpu-quantized"):
        for name, dtype in KV_TWINS.items():
            if not target.runtime.endswith("/kv-" + str(dtype).removeprefix("torch.")):
                methods[f"autoregressive_kv_{name}"] = lambda bench, case, n=name: run_other_kv(bench, case, n)  # type: ignore[misc]
    return methods


def default_methods(methods: dict[str, Method], llama: Sequence[str]) -> list[str]:
    """Everything but the other-KV references (a separate question: ``--methods autoregressive_kv_...``) and the
    llama.cpp builds that are not there."""
    return [m for m in methods if not m.startswith("autoregressive_kv") and (m not in LLAMA_REFS or m in llama)]

