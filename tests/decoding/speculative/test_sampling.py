"""Lossless sampling: tree rejection sampling keeps the target distribution (seeded statistical tests)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from decoding.speculative.coupled import SeededNoise, verify_coupled
from decoding.speculative.drafter import BaseDrafter
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, SamplingParams
from decoding.speculative.tree import ROOT, DraftTree, merge_trees
from decoding.speculative.verify import one_step_output, target_probs, transfer, verify_sampling
from tests.decoding.conftest import TinyTarget, next_token_probs, sampling_target, tiny_target, tv

TV_TOLERANCE = 0.03  # with 20k draws the TV of an exact sampler stays well below this (expected ~0.01)


def test_verify_sampling_first_two_tokens_follow_target() -> None:
    """Root children: one q-sampled draft, two deterministic ones; a grandchild under the first."""
    gen = torch.Generator().manual_seed(1234)
    vocab = 6
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)  # rows: root, node 0, node 1..
    q = torch.softmax(torch.randn(vocab, generator=gen), dim=-1)
    trials = 20000
    first: Counter[object] = Counter()
    pairs: Counter[object] = Counter()
    for _ in range(trials):
        tree = DraftTree()
        x0 = int(torch.multinomial(q, 1, generator=gen))  # a real draft: sampled from q
        a = tree.add(ROOT, x0, "lm", q)
        tree.add(ROOT, (x0 + 1) % vocab, "ngram")  # deterministic siblings (point masses)
        tree.add(ROOT, (x0 + 2) % vocab, "ngram")
        tree.add(a, 3, "ngram")  # a deterministic grandchild below the sampled node
        n = len(tree)
        # target distributions: root row = p[0]; below node a = p[1]; everything else = p[2]
        rows = torch.stack([p[0], p[1], *[p[2]] * (n - 1)])
        verdict = verify_sampling(tree, rows, gen)
        toks = [tree.tokens[i] for i in verdict.accepted_nodes] + [verdict.bonus]
        first[toks[0]] += 1
        if len(toks) >= 2 and verdict.accepted_nodes and verdict.accepted_nodes[0] == a:
            pairs[toks[1]] += 1
    assert tv(first, {i: float(p[0, i]) for i in range(vocab)}, trials) < TV_TOLERANCE
    # given the sampled node was accepted, the next token follows p[1]
    total = sum(pairs.values())
    assert total > 1000
    assert tv(pairs, {i: float(p[1, i]) for i in range(vocab)}, total) < TV_TOLERANCE * 1.5


def test_target_probs_top_k_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    pk = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[0, 2:] == 0).all() and abs(float(pk.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)[0]
    pp = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (pp[0] > 0).sum() == 2  # the smallest set whose mass reaches top_p
    cold = target_probs(logits, SamplingParams(temperature=0.05))
    assert float(cold[0, 0]) > 0.999


class _QuietDrafter(BaseDrafter):
    """A drafter that learns nothing: only ``propose`` differs between the test drafters."""


class ChainDrafter(_QuietDrafter):
    """Deterministic chains from a fixed table: next = (tok * 5 + 1) % vocab."""

    name = "chain"

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, request: object) -> DraftTree:
        tree = DraftTree()
        tok = request.root  # type: ignore[attr-defined]
        parent = ROOT
        for _ in range(request.budget):  # type: ignore[attr-defined]
            tok = (tok * 5 + 1) % self.vocab
            parent = tree.add(parent, tok, self.name)
            if len(tree) < request.budget:  # type: ignore[attr-defined]
                tree.add(parent if parent == ROOT else tree.parents[parent], (tok + 2) % self.vocab, self.name)
        return tree



@pytest.mark.parametrize("seeded", [False, True], ids=["rejection_sampling", "seeded_coupled"])
def test_engine_sampling_matches_target_distribution(seeded: bool) -> None:
    """Two sampled tokens from the engine with a drafting tree vs. the exact two-token distribution.

    Unseeded requests verify by recursive rejection sampling; seeded ones by Gumbel coupling per position."""
    vocab = 6
    torch.set_num_threads(1)
    target: TinyTarget = sampling_target(seed=3, vocab=vocab, peaked=5.0)
    prompt = Prompt(prefix_ids=[1, 2, 3], suffix_ids=[4, 5])
    params = SamplingParams(temperature=1.0)
    p1, p2 = next_token_probs(target.model, prompt, params)  # [vocab], [vocab, vocab]
    exact = {(a, b): float(p1[a] * p2[a, b]) for a in range(vocab) for b in range(vocab)}
    engine = Engine(target)
    trials = 2000
    counts: Counter[object] = Counter()
    for seed in range(trials):
        sampling = SamplingParams(temperature=1.0, seed=seed if seeded else None)
        cfg = GenerationConfig(max_new_tokens=2, sampling=sampling, draft_budget=4)
        done = list(engine.generate(prompt, cfg, [ChainDrafter(vocab)]))[-1]  # type: ignore[list-item]
        assert isinstance(done, DoneEvent)
        counts[tuple(done.token_ids)] += 1
    # 36 outcomes, 2000 draws: an exact sampler's distance is sampling noise (about 0.03-0.05 here); a lossy
    # rule (accept any draft with p >= 0.15, "typical acceptance") was measured near 0.3 on this setup
    assert tv(counts, exact, trials) < 0.09


class RandomDrafter(_QuietDrafter):
    """Random small trees: what is drafted must not change a seeded answer."""

    name = "random"

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, request: object) -> DraftTree:
        tree = DraftTree()
        for _ in range(request.budget):  # type: ignore[attr-defined]
            parent = int(torch.randint(-1, len(tree), (1,), generator=self.gen)) if len(tree) else ROOT
            tree.add(parent, int(torch.randint(0, self.vocab, (1,), generator=self.gen)), self.name)
        return tree



def test_seeded_sampling_does_not_depend_on_drafting() -> None:
    """Same seed -> same answer: plain decoding, any drafter, any budget, the budget policy."""
    vocab = 12
    target = tiny_target(seed=5, vocab=vocab, peaked=2.0)
    engine = Engine(target)
    prompt = Prompt(prefix_ids=[1, 2, 3, 4], suffix_ids=[5, 6])
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=42)

    def answer(drafters: list[object], budget: int | None) -> list[int]:
        cfg = GenerationConfig(max_new_tokens=30, sampling=sampling, draft_budget=budget)
        done = list(engine.generate(prompt, cfg, drafters))[-1]  # type: ignore[arg-type]
        assert isinstance(done, DoneEvent)
        return list(done.token_ids)

    plain = answer([], None)
    assert len(set(plain)) > 3  # really sampled, not a constant
    for seed, budget in [(0, 1), (1, 4), (2, 16), (3, None)]:
        assert answer([RandomDrafter(vocab, seed), ChainDrafter(vocab)], budget) == plain
    other = SamplingParams(temperature=0.8, top_p=0.95, seed=43)
    cfg = GenerationConfig(max_new_tokens=30, sampling=other)
    assert list(engine.generate(prompt, cfg))[-1].token_ids != plain  # type: ignore[union-attr]


def test_seeded_noise_is_a_function_of_seed_and_position() -> None:
    a, b = SeededNoise(7, 50), SeededNoise(7, 50)
    assert torch.equal(a.at(3), b.at(3)) and not torch.equal(a.at(3), a.at(4))
    assert not torch.equal(a.at(3), SeededNoise(8, 50).at(3))
    assert torch.equal(b.at(100), SeededNoise(7, 50).at(100))  # order of use does not matter


def _first_tokens(make_tree: Any, p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> Counter[int]:
    gen = torch.Generator().manual_seed(seed)
    first: Counter[int] = Counter()
    for _ in range(trials):
        tree = make_tree(int(torch.multinomial(q, 1, generator=gen)))
        rows = torch.stack([p] * (len(tree) + 1))
        verdict = verify_sampling(tree, rows, gen)
        first[tree.tokens[verdict.accepted_nodes[0]] if verdict.accepted_nodes else verdict.bonus] += 1
    return first


def test_merged_sampled_node_equal_to_a_point_mass_stays_exact() -> None:
    """A point-mass draft y (RACER) merged before an LM node s ~ q at the same parent: ``merge_trees`` keeps s
    even when s == y, and the first token follows p. Folding s into y when they are equal (the rule for point
    masses) is measurably lossy: s would be tested only when it drew something else."""
    p = torch.tensor([0.05, 0.45, 0.2, 0.3])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    y, trials = 0, 20000
    target = {i: float(p[i]) for i in range(4)}

    def merged(s: int) -> DraftTree:
        point = DraftTree.chain([y], "racer")
        lm = DraftTree()
        lm.add(ROOT, s, "rapid", q)
        return merge_trees([point, lm], budget=8)

    def folded(s: int) -> DraftTree:  # the lossy rule: an equal sampled node folded into the point mass
        tree = DraftTree.chain([y], "racer")
        if s != y:
            tree.add(ROOT, s, "rapid", q)
        return tree

    assert len(merged(y)) == 2
    # expected TV: ~0.005 for an exact sampler at this many draws, ~0.03 for the folded rule
    assert tv(_first_tokens(merged, p, q, trials, 7), target, trials) < 0.012
    assert tv(_first_tokens(folded, p, q, trials, 7), target, trials) > 0.024


def test_eta_zero_is_plain_speculative_sampling() -> None:
    """Knowledge transfer off (eta = 0) is exactly the lossless verifier: same verdicts from the same draws."""
    vocab = 7
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        q = torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=-1)
        tree = DraftTree()
        a = tree.add(ROOT, int(torch.multinomial(q, 1, generator=gen)), "rapid", q)
        tree.add(a, int(torch.multinomial(q, 1, generator=gen)), "rapid", q)
        tree.add(ROOT, trial % vocab, "racer")
        probs = torch.softmax(torch.randn(len(tree) + 1, vocab, generator=gen) * 2, dim=-1)
        plain = verify_sampling(tree, probs, torch.Generator().manual_seed(trial))
        off = verify_sampling(tree, probs, torch.Generator().manual_seed(trial), eta=0.0)
        assert plain == off
    p = torch.softmax(torch.randn(vocab, generator=gen), dim=-1)
    assert torch.allclose(transfer(p, q, 0.0), p)


def test_eta_moves_the_output_towards_the_drafter() -> None:
    """eta > 0 is not lossless: one step's output distribution leaves p, more so as eta grows, and the
    engine-level rule (``verify_sampling``) matches the analytic one the eta benchmark reports."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    q = torch.tensor([[0.1, 0.2, 0.6, 0.1]])
    tvs = [0.5 * float((one_step_output(p, q, eta) - p).abs().sum()) for eta in (0.0, 5.0, 10.0, 20.0)]
    assert tvs[0] < 1e-6 and 0.1 < tvs[1] <= tvs[2] <= tvs[3] + 1e-6
    gen = torch.Generator().manual_seed(0)
    trials, counts = 20000, Counter[int]()
    for _ in range(trials):
        tree = DraftTree()
        tree.add(ROOT, int(torch.multinomial(q[0], 1, generator=gen)), "rapid", q[0])
        verdict = verify_sampling(tree, torch.stack([p[0], p[0]]), gen, eta=10.0)
        counts[tree.tokens[verdict.accepted_nodes[0]] if verdict.accepted_nodes else verdict.bonus] += 1
    out = one_step_output(p, q, 10.0)[0]
    assert tv(counts, {i: float(out[i]) for i in range(4)}, trials) < 0.012


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    """top_p = 1e-46 is 0 in float32: every token would be cut and NaN reach the sampler; the top one stays."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=1e-46))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    noise = SeededNoise(3, 4)
    assert verify_coupled(DraftTree(), probs, noise, 0).bonus == 1
