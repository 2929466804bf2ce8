"""Budget policy: verify the nodes worth their measured cost, learned per node kind; fall back to none."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from decoding.speculative.budget import (
    DRAFTER_WARMUP,
    OBSERVED_MIN,
    OBSERVED_WINDOW,
    WARMUP,
    AcceptanceModel,
    BudgetPolicy,
    TreeSelector,
    _interpolate,
    _slope,
)
from decoding.speculative.tree import ROOT, DraftTree

# Costs relative to one token: a CPU (measured on the bundled model with the CPU kernels) and a GPU.
CPU = {0: 1.0, 1: 1.04, 2: 1.07, 3: 1.15, 4: 1.25, 6: 1.35, 8: 1.44, 12: 1.7, 16: 2.0, 24: 2.5, 32: 3.0, 48: 4.2,
       64: 5.4}  # fmt: skip
GPU = {b: 1.0 + 0.001 * b for b in CPU}


def policy(costs: dict[int, float], explore_every: int = 1000) -> BudgetPolicy:
    p = BudgetPolicy(max_budget=64, explore_every=explore_every)
    p.calibrate(lambda n: costs[n])
    return p


def chain(n: int, kind: str) -> DraftTree:
    tree = DraftTree()
    parent = ROOT
    for i in range(n):
        parent = tree.add(parent, 100 + i, "test", kind=kind)
    return tree


def teach(selector: TreeSelector, kind: str, rate: float, times: int = 200, depths: Sequence[int] = (1, 2, 3)) -> None:
    """Verify outcomes where a ``kind`` node at each depth, its ancestors accepted, is accepted ``rate`` of the time."""
    for t in range(times):
        hit = int((t + 1) * rate + 1e-9) > int(t * rate + 1e-9)
        for d in depths:
            tree = chain(d - 1, "_path")
            tree.add(ROOT if d == 1 else d - 2, 999, "test", kind=kind)
            selector.observe(tree, list(range(d - 1)) + ([d - 1] if hit else []))


def test_useless_drafts_fall_back_to_autoregressive() -> None:
    sel = TreeSelector(policy(CPU))
    teach(sel, "bad", 0.0)
    assert len(sel.select(chain(16, "bad"))) == 0


def test_good_drafts_on_cpu_verify_a_moderate_prefix() -> None:
    sel = TreeSelector(policy(CPU))
    teach(sel, "good", 0.8)
    kept = sel.select(chain(64, "good"))
    assert 3 <= len(kept) <= 12, len(kept)  # 0.8^n shrinks: beyond ~8 nodes a CPU verify costs more than it gains
    assert kept.tokens == list(range(100, 100 + len(kept)))  # a prefix of the chain


def test_gpu_costs_verify_much_more() -> None:
    sel = TreeSelector(policy(GPU))
    teach(sel, "good", 0.8)
    assert len(sel.select(chain(64, "good"))) >= 16


def test_in_a_batch_speculation_shrinks_as_the_batch_grows() -> None:
    """Beside others, a node's row delays every sequence of the batch: fewer nodes pay, down to none, and a batch
    of one (or no batch time) chooses what a generation alone chooses."""
    sel = TreeSelector(policy(CPU))
    teach(sel, "good", 0.8)
    alone = len(sel.select(chain(64, "good")))
    assert len(sel.select(chain(64, "good"), batch=1, batch_s=9.0)) == alone
    # b sequences' rows in one forward cost what b - 1 extra rows cost beside one
    kept = [len(sel.select(chain(64, "good"), batch=b, batch_s=sel.policy.cost(b - 1))) for b in (2, 4, 8, 16)]
    assert alone >= kept[0] and kept == sorted(kept, reverse=True) and kept[-1] < alone, (alone, kept)
    teach(sel, "sure", 1.0)
    assert len(sel.select(chain(8, "sure"), batch=16, batch_s=sel.policy.cost(15))) > 0  # certain tokens still pay


def test_in_a_batch_a_generation_drafts_only_while_its_drafts_pay_for_the_batch() -> None:
    """Drafting's host time and rows delay every sequence of a batch: a generation drafts while its accepted tokens
    per step beat the batch's rate for that spend, stops when they do not (probing every ``explore_every`` steps),
    and alone or before it has measured WARMUP drafting steps always drafts."""
    sel = TreeSelector(policy(CPU, explore_every=8))  # costs relative to a step: a row 0.04
    assert sel.worth_drafting(None, 1, None) and sel.worth_drafting(None, 8, 8.0)  # nothing measured yet
    for _ in range(WARMUP):
        sel.observe_drafting(host_s=0.05, rows=2, accepted=1)  # 1 token for 0.13 of a step
    assert sel.worth_drafting(None, 2, CPU[1]) and not sel.worth_drafting(None, 16, 1.9)  # pays beside 1, not 15
    for _ in range(30):
        sel.observe_drafting(host_s=0.3, rows=2, accepted=0)  # its drafts stop landing
    decisions = [sel.worth_drafting(None, 4, 1.15) for _ in range(16)]
    probes = [i for i, d in enumerate(decisions) if d]
    assert len(probes) == 2 and probes[1] - probes[0] == 8, decisions
    assert sel.worth_drafting(None, 1, None)  # alone: the selector sizes the tree


def test_tree_keeps_likely_nodes_with_their_ancestors() -> None:
    sel = TreeSelector(policy(CPU))
    teach(sel, "good", 0.9)
    teach(sel, "bad", 0.02)
    tree = DraftTree()
    a = tree.add(ROOT, 1, "s", kind="bad")  # an unlikely first child...
    b = tree.add(ROOT, 2, "s", kind="good")  # ...and a likely one, whose chain continues
    tree.add(a, 3, "s", kind="good")  # likely only if its unlikely parent is accepted
    c = tree.add(b, 4, "s", kind="good")
    tree.add(c, 5, "s", kind="good")
    kept = sel.select(tree)
    assert kept.tokens == [2, 4, 5] and kept.parents == [ROOT, 0, 1] and kept.kinds == ["good"] * 3


def test_what_earlier_requests_learned_starts_the_next_one() -> None:
    shared = policy(CPU)
    first = TreeSelector(shared)
    teach(first, "good", 0.9)
    second = TreeSelector(shared)  # a new request: no local counts yet
    assert second.probability("good@1") == pytest.approx(0.9, abs=0.05)
    assert len(second.select(chain(16, "good"))) >= 4
    assert TreeSelector(policy(CPU)).probability("good@1") == AcceptanceModel().prior  # another engine: the prior


def test_request_counts_take_over_from_the_engine_wide_rate() -> None:
    shared = policy(CPU)
    teach(TreeSelector(shared), "k", 0.9)
    sel = TreeSelector(shared)
    teach(sel, "k", 0.0, times=200)  # in this request the kind fails every time
    assert sel.probability("k@1") < 0.25
    assert len(sel.select(chain(8, "k"))) == 0


def test_only_tested_nodes_teach() -> None:
    """A node whose parent was rejected was never tested: it must not count as a failure."""
    sel = TreeSelector(policy(CPU))
    tree = DraftTree()
    a = tree.add(ROOT, 1, "s", kind="first")
    tree.add(a, 2, "s", kind="second")
    for _ in range(30):
        sel.observe(tree, [])  # the first node rejected every time
    assert sel.probability("second@2") == AcceptanceModel().prior
    assert sel.probability("first@1") < 0.1


def test_exploration_verifies_two_nodes_now_and_then() -> None:
    sel = TreeSelector(policy(CPU, explore_every=4))
    teach(sel, "bad", 0.0)
    sizes = [len(sel.select(chain(8, "bad"))) for _ in range(8)]
    assert sizes.count(0) == 6 and sizes.count(2) == 2


def test_costs_follow_the_cache_length() -> None:
    p = BudgetPolicy(max_budget=64, explore_every=1000)
    short = {b: 1.0 + 0.02 * b for b in CPU}  # seconds on a 256-token cache
    long = {b: 2.0 + 0.1 * b for b in CPU}  # on a 2048-token cache
    p.calibrate(short.__getitem__, context=256)
    assert p.cost(8, 2048) == pytest.approx(short[8])  # one length only: no growth known yet
    p.calibrate(long.__getitem__, context=2048)
    assert p.cost_context == 2048
    assert p.cost(8) == pytest.approx(long[8]) == p.cost(8, 2048)
    assert p.cost(8, 256) == pytest.approx(short[8])
    assert p.cost(8, 1152) == pytest.approx((short[8] + long[8]) / 2)
    assert p.cost(8, 4096) > long[8]  # beyond: linear growth
    assert p.cost(6, 1152) == pytest.approx((short[6] + long[6]) / 2)
    assert p.cost(5, 2048) == pytest.approx((long[4] + long[6]) / 2)  # between buckets: interpolated
    # a verify costs relatively more on a long cache: fewer nodes pay there
    sel = TreeSelector(p)
    teach(sel, "ok", 0.5)
    assert len(sel.select(chain(16, "ok"), 256)) > len(sel.select(chain(16, "ok"), 8000)) >= 1
    # steps timed on a long cache refine the costs of caches within a factor of two of it, not the others'
    before, at_6000, eight_at_6000 = p.cost(4), p.cost(4, 6000), p.cost(8, 6000)
    for _ in range(OBSERVED_MIN):
        p.observe_cost(4, 2 * at_6000, context=6000)  # slower than calibrated there
    assert p.cost(4, 6000) == pytest.approx(2 * at_6000) == p.cost(4, 4500)  # 4096-8191: one band
    assert p.cost(8, 6000) == pytest.approx(2 * eight_at_6000)  # unobserved there: moved by the observed ratio
    assert p.cost(4) == pytest.approx(before) and p.cost(4, 256) == pytest.approx(short[4])
    assert p.cost(3, 6000) <= p.cost(4, 6000) <= p.cost(6, 6000)


def test_costs_refine_and_interpolate() -> None:
    p = policy(CPU)
    for _ in range(OBSERVED_MIN - 1):  # too few timings: the calibrated cost stays
        p.observe_cost(4, 1.1 * CPU[4])
    assert p.cost(4) == CPU[4]
    p.observe_cost(4, 1.1 * CPU[4])
    assert p.cost(4) == pytest.approx(1.1 * CPU[4])  # then their median
    for _ in range(OBSERVED_WINDOW // 2 - OBSERVED_MIN):  # a burst of slow steps (load elsewhere) short of half
        p.observe_cost(4, 10.0)
    assert p.cost(4) == pytest.approx(1.1 * CPU[4])
    for _ in range(OBSERVED_WINDOW):  # a lasting change is followed
        p.observe_cost(4, 2 * CPU[4])
    assert p.cost(4) == pytest.approx(2 * CPU[4])
    before = [p.cost(n) for n in range(65)]
    p.observe_cost(5, 10.0)  # not a bucket: sizes between buckets interpolate, they do not skew a bucket
    assert [p.cost(n) for n in range(65)] == before
    assert p.cost(6) < p.cost(7) < p.cost(8)
    for _ in range(OBSERVED_WINDOW):  # no size costs more than an observed larger one
        p.observe_cost(2, 5 * CPU[4])
    assert p.cost(2) == p.cost(3) == p.cost(4) == pytest.approx(2 * CPU[4])
    assert p.cost(100) > p.cost(64)  # beyond the measured range: linear growth
    assert BudgetPolicy(max_budget=8).buckets == (0, 1, 2, 3, 4, 6, 8)


def test_subset_requires_ancestors() -> None:
    tree = chain(3, "k")
    with pytest.raises(ValueError, match="without its parent"):
        tree.subset([0, 2])
    assert tree.subset([0, 1]).tokens == [100, 101]


# ---- drafting time is charged: per-drafter ledgers, priors, an LM drafter's pending setup ---------------------------


def test_a_drafter_whose_time_its_hits_do_not_repay_stops_and_is_probed() -> None:
    """Alone (batch 1): a drafter that took 2 ms a proposal and landed one token in twenty, against 1 ms steps, is
    on for its first DRAFTER_WARMUP proposals, then off except one probe every explore_every steps; one that landed
    half a token a proposal stays on."""
    pol = policy({b: 1e-3 * c for b, c in CPU.items()}, explore_every=8)
    sel = TreeSelector(pol)
    for i in range(DRAFTER_WARMUP):
        assert sel.drafter_on("slow", None) and sel.drafter_on("cheap", None)
        sel.charge("slow", 2e-3, accepted=int(i % 20 == 0))
        sel.charge("cheap", 5e-5, accepted=i % 2)
    calls = [sel.drafter_on("slow", None) for _ in range(32)]
    assert calls.count(True) == 32 // 8 and not calls[0]
    assert all(sel.drafter_on("cheap", None) for _ in range(32))


def test_a_drafter_that_starts_paying_again_is_switched_back_on() -> None:
    pol = policy({b: 1e-3 * c for b, c in CPU.items()}, explore_every=4)
    sel = TreeSelector(pol)
    for _ in range(DRAFTER_WARMUP):
        sel.charge("d", 1e-3, accepted=0)
    assert not sel.drafter_on("d", None)
    sel.charge("d", 1e-3, accepted=DRAFTER_WARMUP + 8)  # a probe that landed a long copied span
    assert sel.drafter_on("d", None)


def test_a_drafters_priors_start_its_kinds_and_the_first_verdicts_move_them_gently() -> None:
    model = AcceptanceModel()
    model.seed({"long@1": 0.9})
    assert model.rate("long@1") == (0.9, 0) and model.rate("other@1") == (model.prior, 0)
    model.update("long@1", False)
    rate, n = model.rate("long@1")
    assert n == 1 and 0.55 < rate < 0.65  # the prior counts as prior_weight observations: (2 * 0.9 + 0) / 3
    model.seed({"long@1": 0.1})  # a learned kind keeps what it learned
    assert model.rate("long@1") == (rate, 1)


def test_an_lm_drafter_with_a_costly_setup_drafts_only_where_it_pays_back() -> None:
    """plan_depth with a pending setup (an LM drafter's own prefill): a good drafter with most of a long answer left
    is granted its depth; the same drafter near the end of the answer, or with a setup dearer than what it could
    save, is not, and is neither probed nor tried as an untested kind."""
    pol = policy(CPU)
    sel = TreeSelector(pol)
    teach(sel, "lm", 0.9)
    assert sel.plan_depth("lm", 0.2, 8, setup_s=5.0, remaining=500) > 0
    assert sel.plan_depth("lm", 0.2, 8, setup_s=5.0, remaining=5) == 0
    assert sel.plan_depth("lm", 0.2, 8, setup_s=5000.0, remaining=500) == 0
    fresh = TreeSelector(policy(CPU))
    assert fresh.plan_depth("new", 1.0, 8) == 3  # untested, no setup: a short chain to measure it
    assert fresh.plan_depth("new", 1.0, 8, setup_s=50.0, remaining=100) == 0


def test_interpolation_matches_the_nearest_known_sizes_on_random_tables() -> None:
    """``_interpolate`` (bisecting the sorted sizes ``costs`` passes once a call) against the definition: linear
    between the nearest measured sizes at or below and at or above, the nearest end's value (plus the end slope
    when extrapolating) outside them, a neutral prior on an empty table."""
    rng = random.Random(5)
    for _ in range(300):
        table = {k: rng.random() for k in rng.sample(range(80), rng.randint(0, 8))}
        known = sorted(table)
        for n in range(-3, 90):
            for extrapolate in (True, False):
                if n in table:
                    want = table[n]
                elif not known:
                    want = 1.0 + 0.03 * n if extrapolate else 0.0
                else:
                    lo = max((k for k in known if k <= n), default=known[0])
                    hi = min((k for k in known if k >= n), default=known[-1])
                    if lo == hi:
                        want = table[lo] + (_slope(table, known) * (n - lo) if extrapolate else 0.0)
                    else:
                        want = table[lo] + (n - lo) / (hi - lo) * (table[hi] - table[lo])
                assert _interpolate(table, n, extrapolate) == want
                assert _interpolate(table, n, extrapolate, known) == want


def test_a_size_measured_in_a_burst_of_load_does_not_raise_the_larger_ones() -> None:
    """A size timed above a larger one met noise (it could be padded to the larger one): it is lowered to it, and
    no size is raised (a running maximum had made one burst on 2 nodes the cost of 2 to 8 nodes: 1.8 steps)."""
    spiked = {**CPU, 2: 1.8}
    p = policy(spiked)
    assert p.cost_s[2] == CPU[3]  # lowered to the next size's
    assert all(p.cost_s[b] == CPU[b] for b in CPU if b != 2)
    costs = [p.cost_s[b] for b in sorted(p.cost_s)]
    assert costs == sorted(costs)
