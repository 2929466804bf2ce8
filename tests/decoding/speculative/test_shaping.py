"""The request's logit shaping (penalties, logit bias, top-k, min-p) and log-probabilities inside speculation:
speculative output == plain decoding with the same parameters, on trees whose branches repeat tokens (so path
counts differ by branch); log-probabilities == a plain forward's log-softmax."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from decoding.speculative.drafter import BaseDrafter, DraftRequest
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, SamplingParams, TokenEvent
from decoding.speculative.shaping import LogitShaper, row_paths
from decoding.speculative.tree import ROOT, DraftTree
from decoding.speculative.verify import target_probs
from tests.decoding.conftest import PROMPT, VOCAB, TinyTarget, causal_lm, sampling_target, tv

N = 32
SHAPINGS = {
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=2.0),
    "negative_frequency": SamplingParams(frequency_penalty=-0.7),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "logit_bias": SamplingParams(logit_bias=((3, 4.0), (42, -100.0), (17, 2.5))),
    "all": SamplingParams(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.3,
                          logit_bias=((8, 1.5),)),
}


class RepeatingDrafter(BaseDrafter):
    """Trees mixing the expected answer with branches that repeat tokens: the root again, the last answer
    tokens, the same token twice in a row; so two rows of one tree see one token with different counts."""

    name = "repeating"

    def __init__(self, answer: Sequence[int], seed: int) -> None:
        self.answer, self.rng = list(answer), random.Random(seed)

    def propose(self, request: DraftRequest) -> DraftTree:
        pos, tree = len(request.generated), DraftTree()
        recent = [request.root, *request.generated[-4:]]
        frontier = [(ROOT, 0)]
        while frontier and len(tree) < request.budget:
            parent, depth = frontier.pop(0)
            good = self.answer[pos + depth] if pos + depth < len(self.answer) else 0
            options = [good, self.rng.choice(recent), tree.tokens[parent] if parent != ROOT else request.root]
            self.rng.shuffle(options)
            for tok in options[: self.rng.randint(1, 3)]:
                if len(tree) >= request.budget:
                    break
                frontier.append((tree.add(parent, tok, self.name), depth + 1))
        return tree


def generate(engine: Engine, config: GenerationConfig, drafters: Sequence[BaseDrafter] = (),
             prompt: Prompt = PROMPT) -> DoneEvent:
    """One generation; the events' log-probabilities, in order, are the done event's."""
    events = list(engine.generate(prompt, config, drafters))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    streamed = [lp for e in events if isinstance(e, TokenEvent) for lp in e.logprobs]
    if config.logprobs is None:
        assert done.logprobs is None and not streamed
    else:
        assert done.logprobs is not None and streamed == done.logprobs
        assert [lp.token for lp in done.logprobs] == done.token_ids
    return done


@pytest.fixture(scope="module")
def engine(tiny: TinyTarget) -> Engine:
    return Engine(tiny)


@pytest.mark.parametrize("name", list(SHAPINGS))
def test_greedy_speculation_equals_plain_decoding_with_the_same_shaping(engine: Engine, name: str) -> None:
    params = SHAPINGS[name]
    config = GenerationConfig(max_new_tokens=N, sampling=params)
    plain = generate(engine, config).token_ids
    raw = generate(engine, GenerationConfig(max_new_tokens=N)).token_ids
    assert plain != raw  # the shaping matters on this model
    for seed, budget in [(0, 4), (1, 12), (2, 40)]:
        drafters = [RepeatingDrafter(plain, seed)]
        done = generate(engine, replace(config, draft_budget=budget), drafters)
        assert done.token_ids == plain, (seed, budget)
        assert done.stats.accepted > 0


def test_tree_rows_get_their_own_paths_counts() -> None:
    """Shaping a tree's rows at once == shaping each row alone after answer + its path, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    tree = DraftTree()
    a = tree.add(ROOT, 5, "t")
    b = tree.add(a, 5, "t")  # 5 twice on one path
    tree.add(b, 7, "t")
    tree.add(ROOT, 7, "t")
    tree.add(a, 9, "t")
    answer = [5, 9, 9, 2]
    logits = torch.randn(len(tree) + 1, VOCAB, generator=gen) * 3
    shaper = LogitShaper(SHAPINGS["all"], [1, 2, 3, 5], VOCAB, torch.device("cpu"))
    paths = row_paths(tree)
    assert paths == [[], [5], [5, 5], [5, 5, 7], [7], [5, 9]]
    together = shaper.shape_(logits.clone(), answer, paths)
    for r, path in enumerate(paths):
        alone = shaper.shape_(logits[r : r + 1].clone(), [*answer, *path], [[]])
        assert torch.equal(together[r], alone[0])


def test_the_penalties_literally() -> None:
    """OpenAI's frequency / presence (answer only), HF's repetition (prompt and answer), bias added first."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0, -2.0]])
    answer, prompt = [3, 3, 1], [4, 5]
    both = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = LogitShaper(both, prompt, 6, torch.device("cpu")).shape_(logits.clone(), answer, [[]])
    assert got.tolist() == [[2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.0 - 0.25, 1.0, -2.0]]
    rep = SamplingParams(repetition_penalty=2.0)
    got = LogitShaper(rep, prompt, 6, torch.device("cpu")).shape_(logits.clone(), answer, [[]])
    assert got.tolist() == [[2.0, -2.0, 0.5, 1.5, 0.5, -4.0]]
    bias = SamplingParams(logit_bias=((0, -3.0), (2, 1.0)), repetition_penalty=2.0)
    got = LogitShaper(bias, [], 6, torch.device("cpu")).shape_(logits.clone(), [0], [[2]])
    assert got.tolist() == [[-2.0, -1.0, 0.75, 3.0, 1.0, -2.0]]  # biased first, then penalised
    assert not LogitShaper.needed(SamplingParams(temperature=0.5, top_k=3, min_p=0.1))


def test_a_large_negative_bias_bans_a_token_and_a_positive_one_forces_it(engine: Engine) -> None:
    raw = generate(engine, GenerationConfig(max_new_tokens=N)).token_ids
    banned = Counter(raw).most_common(1)[0][0]
    ban = SamplingParams(logit_bias=((banned, -100.0),))
    assert banned not in generate(engine, GenerationConfig(max_new_tokens=N, sampling=ban)).token_ids
    force = SamplingParams(logit_bias=((11, 100.0),))
    assert set(generate(engine, GenerationConfig(max_new_tokens=8, sampling=force)).token_ids) == {11}


def test_penalties_turn_a_loop_down(engine: Engine) -> None:
    raw = generate(engine, GenerationConfig(max_new_tokens=N)).token_ids
    penalised = generate(engine, GenerationConfig(max_new_tokens=N, sampling=SHAPINGS["frequency"])).token_ids
    assert max(Counter(penalised).values()) < max(Counter(raw).values())


@pytest.mark.parametrize("name", ["frequency", "repetition", "all"])
def test_seeded_sampling_with_shaping_does_not_depend_on_drafting(tiny: TinyTarget, name: str) -> None:
    params = replace(SHAPINGS[name], temperature=0.9, top_k=40, min_p=0.02, seed=7)
    engine = Engine(tiny)
    config = GenerationConfig(max_new_tokens=N, sampling=params)
    plain = generate(engine, config).token_ids
    for seed, budget in [(0, 4), (1, 16)]:
        drafters = [RepeatingDrafter(plain, seed)]
        assert generate(engine, replace(config, draft_budget=budget), drafters).token_ids == plain


def test_logprobs_equal_a_plain_forwards_log_softmax(tiny: TinyTarget, request: pytest.FixtureRequest) -> None:
    """Every emitted token's log-probability (and the top 3) == log_softmax of one forward over prompt + answer,
    each position shaped with the answer before it: exactly on our CPU kernels, whose rows do not depend on what
    else is in the forward (torch's own kernels: within float rounding)."""
    exact = request.node.callspec.params["tiny"] != "torch_kernels"
    engine = Engine(tiny)
    params = SHAPINGS["all"]
    config = GenerationConfig(max_new_tokens=N, sampling=params, logprobs=3)
    plain = generate(engine, config)
    done = generate(engine, replace(config, draft_budget=12), [RepeatingDrafter(plain.token_ids, 3)])
    assert done.token_ids == plain.token_ids
    if exact:
        assert done.logprobs == plain.logprobs
    ids = [*PROMPT.ids, *done.token_ids]
    with torch.inference_mode():
        logits = causal_lm(tiny.model)(torch.tensor([ids])).logits[0, len(PROMPT.ids) - 1 : -1]
    shaper = LogitShaper(params, PROMPT.ids, VOCAB, torch.device("cpu"))
    answer = done.token_ids
    want = torch.stack([torch.log_softmax(shaper.shape_(logits[t : t + 1].clone(), answer[:t], [[]])[0], dim=-1)
                        for t in range(len(answer))])
    got = torch.tensor([lp.logprob for lp in done.logprobs or []])
    chosen = want.gather(1, torch.tensor(answer)[:, None])[:, 0]
    if exact:
        assert torch.equal(got, chosen)
    else:
        torch.testing.assert_close(got, chosen, rtol=0, atol=1e-4)
    for t, lp in enumerate(done.logprobs or []):
        assert len(lp.top) == 3 and lp.top[0][0] == answer[t]  # greedy: the emitted token is the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), want[t].topk(3).values,
                                   rtol=0, atol=0 if exact else 1e-4)


def test_min_p_keeps_the_tokens_near_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.tensor([0.625, 0.375]))


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "seeded_coupled"])
def test_sampling_with_penalties_follows_the_shaped_distribution(seeded: bool) -> None:
    """Two sampled tokens through drafted trees vs the exact two-token distribution of plain decoding with the
    penalties: the second token's distribution depends on the first (its count)."""
    vocab = 6
    torch.set_num_threads(1)
    target = sampling_target(seed=3, vocab=vocab, peaked=5.0)
    prompt = Prompt(prefix_ids=[1, 2, 3], suffix_ids=[4, 5])
    params = SamplingParams(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.4)
    shaper = LogitShaper(params, prompt.ids, vocab, torch.device("cpu"))
    with torch.inference_mode():
        lm = causal_lm(target.model)
        first = lm(torch.tensor([prompt.ids])).logits[0, -1:]
        p1 = target_probs(shaper.shape_(first, [], [[]]), params)[0]
        p2 = [target_probs(shaper.shape_(lm(torch.tensor([[*prompt.ids, a]])).logits[0, -1:], [a], [[]]),
                           params)[0] for a in range(vocab)]
    exact = {(a, b): float(p1[a] * p2[a][b]) for a in range(vocab) for b in range(vocab)}
    engine = Engine(target)
    trials = 1500
    counts: Counter[object] = Counter()
    for seed in range(trials):
        sampling = replace(params, seed=seed if seeded else None)
        cfg = GenerationConfig(max_new_tokens=2, sampling=sampling, draft_budget=4)
        done = generate(engine, cfg, [RepeatingDrafter([0, 0, 0], seed)], prompt)
        counts[tuple(done.token_ids)] += 1
    assert tv(counts, exact, trials) < 0.09
