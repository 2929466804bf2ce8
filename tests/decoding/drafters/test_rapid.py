"""RAPID's RAG drafter: exact greedy output with any drafter LM and draft prompt, its KV rolled back to the
accepted output, the modes of the registry, and exact sampling with LM-drafted (sampled) nodes."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from decoding.drafters.racer import LogitsTable, RacerConfig, RacerFactory
from decoding.drafters.registry import (
    DraftingKit,
    DraftLM,
    ModeUnavailable,
    RapidDrafter,
    RapidKVDrafter,
    build_drafters,
)
from decoding.speculative import engine as engine_module
from decoding.speculative.drafter import DraftRequest, PromptInfo
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, SamplingParams
from decoding.speculative.tree import DraftTree
from decoding.speculative.verify import Verdict
from tests.decoding.conftest import (
    PROMPT,
    VOCAB,
    TinyTarget,
    naive_greedy,
    needs_kernels,
    next_token_probs,
    run,
    sampling_target,
    tiny_target,
    tv,
)

N = 40
DRAFT_IDS = [5, 17, 3, 3, 42, 9]  # a shorter "retrieved" context than PROMPT's


@pytest.fixture(scope="module")
def reference(tiny: TinyTarget) -> list[int]:
    return naive_greedy(tiny.model, PROMPT.ids, N)


def _prompt(draft_ids: Sequence[int] | None) -> Prompt:
    return Prompt(PROMPT.prefix_ids, PROMPT.suffix_ids, draft_ids=draft_ids)


@pytest.mark.parametrize("budget", [4, 12, None], ids=["budget4", "budget12", "policy"])
def test_rapid_same_weights_short_context_is_exact(tiny: TinyTarget, reference: list[int], budget: int | None) -> None:
    drafter = RapidDrafter(DraftLM(tiny.model), threshold=0.0)  # a random model is never 10 % sure
    done = run(Engine(tiny), _prompt(DRAFT_IDS), N, [drafter], budget)
    assert done.token_ids == reference
    assert done.stats.drafted_by_source.get("rapid", 0) > 0
    assert drafter.step_cost_s > 0 and drafter.forwards > 0


def test_rapid_on_the_whole_prompt_drafts_the_target_itself(tiny: TinyTarget, reference: list[int]) -> None:
    """Same weights, same context: the drafter's chain is the target's own greedy continuation, so every chain
    node it keeps is accepted (alternatives are the only misses)."""
    drafter = RapidDrafter(DraftLM(tiny.model), branches=0, threshold=0.0)
    done = run(Engine(tiny), _prompt(None), N, [drafter], 6)
    assert done.token_ids == reference
    assert done.stats.accepted == done.stats.drafted > 0
    assert done.stats.steps <= N // 4


def test_rapid_with_another_drafter_model_is_exact(tiny: TinyTarget, reference: list[int]) -> None:
    other = tiny_target(seed=7).model  # same vocabulary, different weights: mostly wrong drafts
    drafter = RapidDrafter(DraftLM(other), gamma=4, threshold=0.0)
    done = run(Engine(tiny), _prompt(DRAFT_IDS), N, [drafter], 8)
    assert done.token_ids == reference
    assert done.stats.drafted > 0


ROWS = [(0, 3), (6, 9), (10, 13)]  # "system", one retrieved chunk, the question part of PROMPT (13 tokens)


@pytest.mark.parametrize("budget", [5, None], ids=["budget5", "policy"])
def test_rapid_kv_over_a_subset_of_the_target_cache_is_exact(
    tiny: TinyTarget, reference: list[int], budget: int | None
) -> None:
    drafter = RapidKVDrafter(tiny.model, threshold=0.0)
    done = run(Engine(tiny), dataclasses.replace(_prompt(None), draft_rows=ROWS), N, [drafter], budget)
    assert done.token_ids == reference  # the drafted rows written past the target's were cut off again
    assert done.stats.drafted_by_source.get("rapid_kv", 0) > 0


def test_rapid_kv_over_every_row_is_the_target_itself(tiny: TinyTarget, reference: list[int]) -> None:
    drafter = RapidKVDrafter(tiny.model, threshold=0.0, branches=0)
    prompt = dataclasses.replace(_prompt(None), draft_rows=[(0, len(PROMPT.ids))])
    done = run(Engine(tiny), prompt, N, [drafter], 6)
    assert done.token_ids == reference
    assert done.stats.accepted >= 0.9 * done.stats.drafted > 0


def test_rapid_kv_without_rows_drafts_nothing(tiny: TinyTarget, reference: list[int]) -> None:
    done = run(Engine(tiny), _prompt(None), 8, [RapidKVDrafter(tiny.model, threshold=0.0)], 5)
    assert done.token_ids == reference[:8] and done.stats.drafted == 0


class RecordingRapid(RapidDrafter):
    def __init__(self, lm: DraftLM, **kw: object) -> None:
        super().__init__(lm, **kw)  # type: ignore[arg-type]
        self.calls: list[tuple[list[int], list[int], int]] = []

    def propose(self, request: DraftRequest) -> DraftTree:
        tree = super().propose(request)
        self.calls.append((list(request.generated), tree.tokens[:], request.budget))
        return tree


@needs_kernels
def test_drafter_cache_rolls_back_to_the_accepted_output() -> None:
    """After partial acceptance the drafter's chain equals the chain of a fresh drafter that prefilled
    draft prompt + output: its KV was cut back to what the target accepted (on the quantized runtime a row's
    KV is the same bits whether computed in a prefill or a step, so the chains match exactly)."""
    torch.set_num_threads(1)
    target = tiny_target(0, quantized=True)
    draft_model = target.model  # same weights, shorter context: partly right
    drafter = RecordingRapid(DraftLM(draft_model), gamma=5, branches=0, threshold=0.0)
    run(Engine(target), _prompt(DRAFT_IDS), 30, [drafter], 5)
    calls = drafter.calls
    accepted = [len(calls[i + 1][0]) - len(calls[i][0]) - 1 for i in range(len(calls) - 1)]
    assert any(0 < a < len(calls[i][1]) for i, a in enumerate(accepted))  # a chain cut after some accepted
    assert any(a == 0 for a in accepted)
    for generated, chain, budget in calls[1:]:
        fresh = RapidDrafter(DraftLM(draft_model), gamma=5, branches=0, threshold=0.0)
        fresh.begin(PromptInfo(prompt_ids=[], draft_ids=[*DRAFT_IDS, *generated[:-1]]))
        again = fresh.propose(DraftRequest(root=generated[-1], generated=generated[-1:], budget=budget))
        assert again.tokens == chain


def test_threshold_stops_the_chain_and_policy_depth_is_obeyed(tiny: TinyTarget) -> None:
    drafter = RapidDrafter(DraftLM(tiny.model), threshold=0.999, branches=0)
    drafter.begin(PromptInfo(prompt_ids=PROMPT.ids))
    assert len(drafter.propose(DraftRequest(root=3, generated=[3], budget=10))) == 0  # nothing that sure
    drafter = RapidDrafter(DraftLM(tiny.model), threshold=0.0, branches=2)
    drafter.begin(PromptInfo(prompt_ids=PROMPT.ids))
    tree = drafter.propose(DraftRequest(root=3, generated=[3], budget=20, max_depth=3))
    assert max(tree.depths()) == 3
    assert sum(k == "rapid/alt" for k in tree.kinds) == 4  # two alternatives at each of the first 2 depths
    assert len(drafter.propose(DraftRequest(root=3, generated=[3], budget=20, max_depth=0))) == 0


def test_modes_from_the_registry(tiny: TinyTarget, reference: list[int]) -> None:
    table = LogitsTable(VOCAB, k=RacerConfig().topk, model_id="tiny")
    kit = DraftingKit(racer=RacerFactory(RacerConfig(), table), draft_lm=lambda: DraftLM(tiny.model),
                      target_model=tiny.model)
    assert build_drafters("autoregressive", kit) == []
    assert [d.name for d in build_drafters("combined", kit)] == ["suffix", "racer", "rapid_kv"]
    prompt = dataclasses.replace(_prompt(DRAFT_IDS), draft_rows=ROWS)
    done = run(Engine(tiny), prompt, N, build_drafters("combined", kit), None)
    assert done.token_ids == reference
    with pytest.raises(ModeUnavailable, match="RAG drafter"):
        build_drafters("rapid", DraftingKit())
    with pytest.raises(ModeUnavailable, match="unknown mode"):
        build_drafters("fastest", kit)


def forgetful_verify(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None, eta: float = 0.0
) -> Verdict:
    """The lossy rule: a rejected draft is followed by a sample from the untouched p, not from the residual
    max(p - q, 0), so drafted tokens come out too often."""
    kids = tree.children()
    row, accepted = 0, list[int]()
    while kids[row]:
        child = kids[row][0]
        x, q = tree.tokens[child], tree.probs[child]
        qx = 1.0 if q is None else float(q[x])
        if float(torch.rand((), generator=generator)) >= min(1.0, float(probs[row, x]) / qx):
            break
        accepted.append(child)
        row = child + 1
    return Verdict(accepted, int(torch.multinomial(probs[row], 1, generator=generator)))


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "forgetful_rule"])
def test_sampled_lm_drafts_keep_the_target_distribution(lossy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sampled tokens with RAPID's sampled chain (q kept on its nodes) vs. the exact two-token
    distribution; a verifier that forgets the residual after a rejection is caught."""
    vocab = 6
    torch.set_num_threads(1)
    target = sampling_target(seed=3, vocab=vocab, peaked=5.0)
    draft_model = sampling_target(seed=4, vocab=vocab, peaked=8.0).model  # sure of itself, often wrong
    prompt = Prompt(prefix_ids=[1, 2, 3], suffix_ids=[4, 5], draft_ids=[2, 4, 5])
    params = SamplingParams(temperature=1.0)
    p1, p2 = next_token_probs(target.model, prompt, params)
    exact = {(a, b): float(p1[a] * p2[a, b]) for a in range(vocab) for b in range(vocab)}
    if lossy:
        monkeypatch.setattr(engine_module, "verify_sampling", forgetful_verify)
    engine = Engine(target)
    trials = 2000
    counts: Counter[object] = Counter()
    for _ in range(trials):
        cfg = GenerationConfig(max_new_tokens=2, sampling=params, draft_budget=4)
        drafter = RapidDrafter(DraftLM(draft_model), params, gamma=3, threshold=0.0, branches=0)
        done = list(engine.generate(prompt, cfg, [drafter]))[-1]
        assert isinstance(done, DoneEvent)
        counts[tuple(done.token_ids)] += 1
    if lossy:
        assert tv(counts, exact, trials) > 0.12
    else:  # 36 outcomes, 2000 draws: an exact sampler's distance is sampling noise, about 0.03-0.05
        assert tv(counts, exact, trials) < 0.09
