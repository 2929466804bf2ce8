"""Budget policy: picks the node budget that maximises expected tokens per second, falls back to 0."""

from __future__ import annotations

from decoding.budget import BudgetPolicy, BudgetState

# CPU-like costs relative to one token (measured on the bundled model at 7K context: N=4 1.7x, 16 2.1x ...)
CPU = {0: 1.0, 2: 1.4, 4: 1.7, 8: 2.0, 16: 2.1, 32: 2.6, 64: 3.9}
GPU = {b: 1.0 + 0.001 * b for b in CPU}


def policy(costs: dict[int, float], explore_every: int = 1000) -> BudgetPolicy:
    p = BudgetPolicy(max_budget=64, explore_every=explore_every)
    p.calibrate(lambda n: costs[n])
    return p


def feed(state: BudgetState, accepted_for: dict[int, float], steps: int) -> None:
    for _ in range(steps):
        b = state.choose()
        state.observe(b, b, round(accepted_for.get(state.policy.bucket_of(b), 0.0)) if b else 0, 0.0)


def test_useless_drafts_fall_back_to_autoregressive() -> None:
    state = BudgetState(policy(CPU))
    feed(state, {}, 50)  # drafts never accepted
    assert state.choose() == 0


def test_good_drafts_on_cpu_pick_a_moderate_budget() -> None:
    state = BudgetState(policy(CPU))
    # acceptance saturates at ~3 tokens: 4-8 nodes pay off best on a CPU
    acc = {2: 2, 4: 3, 8: 3, 16: 3, 32: 3, 64: 3}
    feed(state, acc, 60)
    assert state.choose() in (4, 8)


def test_gpu_costs_allow_large_budgets() -> None:
    state = BudgetState(policy(GPU))
    acc = {2: 1, 4: 2, 8: 3, 16: 4, 32: 5, 64: 6}
    feed(state, acc, 80)
    assert state.choose() == 64


def test_measured_costs_refine_the_estimates() -> None:
    p = policy(CPU)
    p.observe_cost(3, 10.0)  # bucket 4 measured much slower than calibrated
    assert p.cost(4) > CPU[4]
    assert p.bucket_of(3) == 4 and p.bucket_of(100) == 64
    assert CPU[8] < p.cost(12) < CPU[16]  # interpolation between measured buckets


def test_exploration_probes_a_larger_bucket() -> None:
    state = BudgetState(policy(CPU, explore_every=4))
    feed(state, {}, 8)
    picks = [state.choose() for _ in range(8)]
    assert 0 in picks and any(b > 0 for b in picks)
