"""Lossless: speculative greedy output == plain greedy output, token for token, whatever is drafted."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import replace

import pytest

from decoding.cache.prefix import PrefixCache
from decoding.drafters.prompt_lookup import PromptLookupDrafter
from decoding.speculative.budget import BudgetPolicy
from decoding.speculative.calibration import calibrate
from decoding.speculative.drafter import BaseDrafter, DraftRequest, PromptInfo, VerifyOutcome
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.generation import DoneEvent, GenerationConfig, PrefillEvent, Prompt, TokenEvent
from decoding.speculative.tree import ROOT, DraftTree
from tests.decoding.conftest import (
    PROMPT,
    VOCAB,
    RandomTreeDrafter,
    TinyTarget,
    fixed_cost_policy,
    naive_greedy,
    run,
)


class ScriptedDrafter(BaseDrafter):
    """Proposes from a known answer: right for ``right`` tokens of each draft, then wrong ones."""

    def __init__(self, answer: Sequence[int], right: int | None, width: int = 1, name: str = "scripted") -> None:
        self.answer = list(answer)
        self.right = right
        self.width = width
        self.name = name
        self.observed: list[VerifyOutcome] = []

    def begin(self, prompt: PromptInfo) -> None:
        self.observed.clear()

    def propose(self, request: DraftRequest) -> DraftTree:
        pos = len(request.generated)  # answer[pos] is the token after the root
        tree = DraftTree()
        parent = ROOT
        for j in range(request.budget):
            if pos + j >= len(self.answer):
                break
            good = self.answer[pos + j]
            wrong = self.right is not None and j >= self.right
            tok = (good + 1 + j) % VOCAB if wrong else good
            # siblings: wrong alternatives placed before the real branch (forces search among children)
            for w in range(1, self.width):
                if len(tree) < request.budget - 1:
                    tree.add(parent, (tok + 7 * w) % VOCAB, self.name)
            if len(tree) >= request.budget:
                break
            parent = tree.add(parent, tok, self.name)
        return tree

    def observe(self, outcome: VerifyOutcome) -> None:
        self.observed.append(outcome)

    def reset(self) -> None:
        self.observed.clear()


N = 40


@pytest.fixture(scope="module")
def engine(tiny: TinyTarget) -> Engine:
    return Engine(tiny)


@pytest.fixture(scope="module")
def reference(tiny: TinyTarget) -> list[int]:
    return naive_greedy(tiny.model, PROMPT.ids, N)


def test_autoregressive_equals_naive_greedy(engine: Engine, reference: list[int]) -> None:
    done = run(engine, PROMPT, N)
    assert done.token_ids == reference
    assert done.finish_reason == "length"
    assert done.stats.steps == N - 1  # the first token comes from prefill
    assert done.stats.acceptance_length == 1.0


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_always_right_drafter(engine: Engine, reference: list[int], budget: int) -> None:
    drafter = ScriptedDrafter(reference, right=None)
    done = run(engine, PROMPT, N, [drafter], budget)
    assert done.token_ids == reference
    assert done.stats.accepted == done.stats.drafted  # every drafted node accepted
    assert done.stats.acceptance_length > 1.0 + 0.5 * budget or budget == 1
    assert done.stats.steps < N - 1


@pytest.mark.parametrize("width", [1, 3])
def test_always_wrong_drafter(engine: Engine, reference: list[int], width: int) -> None:
    drafter = ScriptedDrafter(reference, right=0, width=width)
    done = run(engine, PROMPT, N, [drafter], 6)
    assert done.token_ids == reference
    assert done.stats.accepted == 0
    assert done.stats.steps == N - 1


@pytest.mark.parametrize("right", [1, 2, 5])
def test_partial_acceptance_and_compaction(engine: Engine, reference: list[int], right: int) -> None:
    drafter = ScriptedDrafter(reference, right=right, width=2)
    done = run(engine, PROMPT, N, [drafter], 12)
    assert done.token_ids == reference
    # every step accepts exactly `right` tokens except where the answer runs out
    per_step = [len(o.accepted_nodes) for o in drafter.observed]
    assert max(per_step) == right
    assert per_step.count(right) >= len(per_step) - 2
    # accepted nodes were not first in the flattened tree (wrong siblings first): rows got compacted
    assert any(o.accepted_nodes and o.accepted_nodes[0] != 0 for o in drafter.observed)


@pytest.mark.parametrize("seed", range(6))
def test_random_trees(engine: Engine, reference: list[int], seed: int) -> None:
    drafters = [RandomTreeDrafter(reference, seed), ScriptedDrafter(reference, right=3, name="other")]
    budget = [3, 8, 24, 48][seed % 4]
    done = run(engine, PROMPT, N, drafters, budget)
    assert done.token_ids == reference
    assert done.stats.drafted <= budget * done.stats.steps


def test_policy_budget_and_prompt_lookup(tiny: TinyTarget, reference: list[int]) -> None:
    engine = Engine(tiny)
    done = run(engine, PROMPT, N, [PromptLookupDrafter()], None)
    assert done.token_ids == reference


def test_selector_stops_verifying_useless_drafts(tiny: TinyTarget, reference: list[int]) -> None:
    """Always-wrong drafts: after learning, steps verify nothing but exploration probes; output exact."""
    engine = Engine(tiny, policy=fixed_cost_policy(explore_every=8))
    first = run(engine, PROMPT, N, [ScriptedDrafter(reference, right=0, width=3)], None)
    again = run(engine, PROMPT, N, [ScriptedDrafter(reference, right=0, width=3)], None)  # learned engine-wide
    assert first.token_ids == again.token_ids == reference
    assert again.stats.accepted == 0
    assert again.stats.drafted <= 2 * ((again.stats.steps // 8) + 1)  # only the exploration probes
    assert again.stats.drafted < first.stats.drafted


def test_selector_verifies_more_of_good_drafts(tiny: TinyTarget, reference: list[int]) -> None:
    engine = Engine(tiny, policy=fixed_cost_policy())
    run(engine, PROMPT, N, [ScriptedDrafter(reference, right=None)], None)  # teaches: this kind is always right
    done = run(engine, PROMPT, N, [ScriptedDrafter(reference, right=None)], None)
    assert done.token_ids == reference
    assert done.stats.accepted == done.stats.drafted
    assert done.stats.acceptance_length > 4.0  # several nodes a step, cut by the cost curve, not by the drafter


def test_eos_and_stop_strings(tiny: TinyTarget, reference: list[int]) -> None:
    eos_tok = reference[7]
    target = TinyTarget(tiny.model, tiny.tokenizer, tiny.name, tiny.device, (eos_tok,), tiny.max_context)
    engine = Engine(target)
    expect = reference[: reference.index(eos_tok)]
    for drafters in ([], [ScriptedDrafter(reference, right=None)]):
        done = run(engine, PROMPT, N, drafters, 8)
        assert done.token_ids == expect
        assert done.finish_reason == "stop"
    # stop string: the text of the 5th token; output text ends right before it
    stop = f"<{reference[4]}>"
    plain = Engine(tiny)
    ev = list(plain.generate(PROMPT, GenerationConfig(max_new_tokens=N, stop=(stop,))))
    last = ev[-1]
    assert isinstance(last, DoneEvent)
    done = last
    full = "".join(f"<{t}>" for t in reference)
    assert done.text == full[: full.index(stop)]
    assert done.finish_reason == "stop"
    assert "".join(e.text for e in ev if isinstance(e, TokenEvent)) == done.text


def test_prefix_cache_reuse_is_exact(tiny: TinyTarget, reference: list[int], tmp_path: object) -> None:
    cache = PrefixCache(byte_budget=1 << 30)
    engine = Engine(tiny, prefix_cache=cache)
    prompt = Prompt(PROMPT.prefix_ids, PROMPT.suffix_ids, prefix_key="doc-1")
    first = run(engine, prompt, N)
    second = run(engine, prompt, N, [ScriptedDrafter(reference, right=2)], 6)
    assert first.token_ids == second.token_ids == reference
    assert not first.stats.prefix_cache_hit and second.stats.prefix_cache_hit
    assert second.stats.prefill_tokens == len(PROMPT.suffix_ids)
    # another question on the same document prefix
    other = Prompt(PROMPT.prefix_ids, [7, 7, 1], prefix_key="doc-1")
    ref_other = naive_greedy(tiny.model, other.ids, 12)
    assert run(engine, other, 12).token_ids == ref_other


def segmented(segments: Sequence[Sequence[int]], suffix: Sequence[int]) -> Prompt:
    """A prompt whose prefix is ``segments`` one after the other, each a cacheable segment."""
    ids = [t for seg in segments for t in seg]
    ends = list(itertools.accumulate(len(seg) for seg in segments))
    return Prompt(prefix_ids=ids, suffix_ids=list(suffix), prefix_key="doc-1", segment_ends=ends)


def test_prefix_segments_reuse_the_longest_cached_run_exactly(tiny: TinyTarget) -> None:
    """A radix tree over segments: a shared leading run of segments is loaded, the rest prefilled; the answer
    is the same as without any cache (greedy, bit for bit)."""
    engine = Engine(tiny, prefix_cache=PrefixCache(byte_budget=1 << 30), config=EngineConfig(prefill_chunk=4))
    system, a, b, c, d = [5, 17, 3], [42, 8, 8, 23, 61], [5, 17, 3, 9], [77, 12, 40, 2, 2, 90], [33, 33, 1]
    question = [3, 42, 9]
    first = segmented([system, a, b, c], question)
    done = run(engine, first, 12)
    assert done.token_ids == naive_greedy(tiny.model, first.ids, 12)
    assert done.stats.prefix_reused_tokens == 0 and not done.stats.prefix_cache_hit
    assert run(engine, first, 12).stats.prefix_reused_tokens == len(first.prefix_ids)  # the same question
    for other, reused in (
        (segmented([system, a, b, d], question), len(system + a + b)),  # another last chunk
        (segmented([system, a, c], [3, 9]), len(system + a)),  # a chunk left out
        (segmented([system, b, a], question), len(system)),  # another order: only the system part
        (segmented([system, a, b, c], [1, 2]), len(first.prefix_ids)),  # another question
    ):
        got = run(engine, other, 12)
        assert got.stats.prefix_reused_tokens == reused
        assert got.stats.prefill_tokens == len(other.ids) - reused
        assert got.token_ids == naive_greedy(tiny.model, other.ids, 12)
    # the same tokens under another caller key (another document set) share nothing
    assert run(engine, replace(first, prefix_key="doc-2"), 12).stats.prefix_reused_tokens == 0


def test_prefill_reports_progress_and_stops_when_cancelled(tiny: TinyTarget) -> None:
    cache = PrefixCache(byte_budget=1 << 30)
    engine = Engine(tiny, prefix_cache=cache, config=EngineConfig(prefill_chunk=4))
    prompt = segmented([[5, 17, 3, 42, 8, 8], [23, 61, 5, 17, 3, 9, 1, 2], [7] * 9], [3, 42, 9])
    events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=4)))
    progress = [e for e in events if isinstance(e, PrefillEvent)]
    assert [e.done for e in progress] == [0, 4, 6, 10, 14, 18, 22, 23]  # chunks end at segment ends
    assert all(e.total == len(prompt.ids) and e.reused == 0 for e in progress)

    cancel = threading.Event()
    other = segmented([[5, 17, 3, 42, 8, 8], [1] * 8, [2] * 9], [3, 42, 9])
    gen = engine.generate(other, GenerationConfig(max_new_tokens=4), (), cancel)
    seen = [next(gen), next(gen), next(gen), next(gen)]  # the first segment came from the cache
    assert [e.done for e in seen if isinstance(e, PrefillEvent)] == [6, 10, 14, 18]
    cancel.set()
    rest = list(gen)
    assert len(rest) == 1 and isinstance(rest[0], DoneEvent) and rest[0].finish_reason == "cancelled"
    assert rest[0].token_ids == []
    # the segments finished before the cancel stay cached: a retry resumes after them
    again = run(engine, other, 4)
    assert again.stats.prefix_reused_tokens == 14
    assert again.token_ids == naive_greedy(tiny.model, other.ids, 4)


def test_warm_prefix_caches_every_segment(tiny: TinyTarget) -> None:
    engine = Engine(tiny, prefix_cache=PrefixCache(byte_budget=1 << 30), config=EngineConfig(prefill_chunk=4))
    prompt = segmented([[5, 17, 3], [42, 8, 8, 23, 61], [5, 17, 3, 9]], [3, 42, 9])
    cancel = threading.Event()
    cancel.set()
    assert engine.warm_prefix(replace(prompt, suffix_ids=[]), cancel)  # cancelled before its first chunk
    assert run(engine, prompt, 6).stats.prefix_reused_tokens == 0
    engine = Engine(tiny, prefix_cache=PrefixCache(byte_budget=1 << 30), config=EngineConfig(prefill_chunk=4))
    assert engine.warm_prefix(replace(prompt, suffix_ids=[]))
    assert not engine.warm_prefix(replace(prompt, suffix_ids=[]))  # all cached already
    done = run(engine, prompt, 6)
    assert done.stats.prefix_reused_tokens == len(prompt.prefix_ids)
    assert done.token_ids == naive_greedy(tiny.model, prompt.ids, 6)


def test_cancellation_between_steps(engine: Engine) -> None:
    import threading

    cancel = threading.Event()
    gen = engine.generate(PROMPT, GenerationConfig(max_new_tokens=N), (), cancel)
    first = next(e for e in gen if not isinstance(e, PrefillEvent))
    assert isinstance(first, TokenEvent)
    cancel.set()
    rest = list(gen)
    done = rest[-1]
    assert isinstance(done, DoneEvent)
    assert done.finish_reason == "cancelled"
    assert len(done.token_ids) <= 2


def test_engine_calibration_measures_every_size_at_two_cache_lengths(tiny: TinyTarget) -> None:
    engine = Engine(tiny, policy=BudgetPolicy(max_budget=16))
    costs = calibrate(engine, contexts=(32, 160), repeats=1)
    policy = engine.policy
    assert policy.cost_context == 160
    assert set(costs) == set(policy.buckets) == set(policy.cost_slope)
    by_size = [costs[b] for b in sorted(costs)]
    assert by_size == sorted(by_size)  # never cheaper with more tokens
    assert all(v > 0 for v in costs.values()) and all(v >= 0 for v in policy.cost_slope.values())
    assert policy.cost(8, 32) <= policy.cost(8, 160) <= policy.cost(8, 400)
    # a cache length beyond the model's window is clamped, not an error
    assert calibrate(Engine(tiny, policy=BudgetPolicy(max_budget=4)), contexts=(10_000,), repeats=1)
