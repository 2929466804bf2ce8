"""Lossless on the device: speculative greedy == autoregressive greedy through the engine, with the registry's
drafters (prompt lookup, rapid on its own cache, rapid_kv over a subset of the target's rows) and with random
trees around the answer (right and wrong tokens at random depths and widths); in bf16, how often the two agree
(rounding may flip a near tie between a verify row and a decode step), reported with a loose bound."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from decoding.drafters.registry import DRAFTERS, DraftingKit, DraftLM
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.drafter import Drafter
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt
from tests.decoding.conftest import RandomTreeDrafter, first_mismatch
from tests.gpu.conftest import VOCAB, device_target, nocache_greedy, tiny_llama

N = 32  # new tokens per generation


def make_prompt(seed: int) -> Prompt:
    """A document with a repeated stretch (prompt lookup finds it), a question, and the RAG drafters' view:
    two 'retrieved chunks' of it plus the question."""
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(48)]
    doc = base + base[8:40] + [rng.randrange(VOCAB) for _ in range(16)]
    question = [rng.randrange(VOCAB) for _ in range(4)]
    chunks = [(0, 8), (40, 80)]
    draft_ids = [t for a, b in chunks for t in doc[a:b]] + question
    rows = [*chunks, (len(doc), len(doc) + len(question))]
    return Prompt(doc, question, draft_ids=draft_ids, draft_rows=rows)


def generate(engine: Engine, prompt: Prompt, drafters: Sequence[Drafter] = (), budget: int | None = None) -> DoneEvent:
    events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=N, draft_budget=budget), drafters))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return done


def peaked_llama(device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A tiny Llama whose head is scaled up: confident enough (> 10 %) for the RAPID drafters' default threshold,
    and with fewer near ties, which fp32 kernels of different shapes (a verify, a decode step) may round apart."""
    model = tiny_llama(device, dtype, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


MODES = [("prompt_lookup",), ("rapid",), ("rapid_kv",), ("rapid_kv", "rapid", "prompt_lookup")]


@pytest.mark.parametrize("names", MODES)
def test_registry_drafters_are_lossless(device: torch.device, names: tuple[str, ...]) -> None:
    model = peaked_llama(device)
    engine = Engine(device_target(model, device))
    prompt = make_prompt(0)
    ar = generate(engine, prompt)
    assert ar.token_ids == nocache_greedy(model, prompt.ids, N)
    kit = DraftingKit(draft_lm=lambda: DraftLM(engine.model, device), target_model=engine.model)
    drafters = [DRAFTERS[name](kit) for name in names]
    spec = generate(engine, prompt, drafters, budget=8)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accepted > 0 and spec.stats.steps < N  # the drafts were verified, some accepted
    assert set(spec.stats.drafted_by_source) <= set(names)


def test_rapid_kv_drafts_on_the_model_device(device: torch.device) -> None:
    """The KV-subset drafter's forwards go to the device its model is on (its own inputs and mask too)."""
    model = tiny_llama(device)
    drafter: Any = DRAFTERS["rapid_kv"](DraftingKit(target_model=TorchRuntime(model)))
    assert drafter.lm.device == next(model.parameters()).device


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forced_random_trees_are_lossless(device: torch.device, seed: int) -> None:
    model = peaked_llama(device, seed=seed)
    engine = Engine(device_target(model, device), config=EngineConfig(max_budget=32))
    prompt = make_prompt(seed)
    ar = generate(engine, prompt)
    spec = generate(engine, prompt, [RandomTreeDrafter(ar.token_ids, seed, VOCAB)], budget=24)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accepted > 0 and spec.stats.steps < N


def test_bf16_speculative_agrees_with_autoregressive(device: torch.device, report: Any) -> None:
    """bf16 may round a verify row unlike a decode step; over several prompts most tokens must still agree (on
    the sharpened model: an unsharpened random head has ~4 % of steps within one bf16 step of a tie)."""
    rows: list[dict[str, Any]] = []
    for seed in range(4):
        model = peaked_llama(device, torch.bfloat16, seed=seed)
        engine = Engine(device_target(model, device), config=EngineConfig(max_budget=32))
        prompt = make_prompt(seed)
        ar = generate(engine, prompt)
        spec = generate(engine, prompt, [RandomTreeDrafter(ar.token_ids, seed, VOCAB)], budget=24)
        miss = first_mismatch(spec.token_ids, ar.token_ids)
        rows.append({"seed": seed, "tokens": len(ar.token_ids), "first_mismatch": miss,
                     "accepted": spec.stats.accepted, "steps": spec.stats.steps})  # fmt: skip
    agreed = sum(r["tokens"] if r["first_mismatch"] is None else r["first_mismatch"] for r in rows)
    rate = agreed / sum(r["tokens"] for r in rows)
    report("bf16_agreement", {"device": str(device), "agreement_rate": round(rate, 4), "prompts": rows})
    assert rate >= 0.5
