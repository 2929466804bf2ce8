"""Verify-cost calibration at the cache lengths requests are served at: the policy records them and asks for
a calibration point beyond the calibrated ones; a calibration there moves the cost curve; cancelling one."""

from __future__ import annotations

import threading

import pytest

from decoding.speculative.budget import DEFAULT_BUCKETS, BudgetPolicy
from decoding.speculative.calibration import calibrate, verify_costs
from decoding.speculative.engine import Engine
from tests.decoding.conftest import tiny_target


def linear(base: float, per_node: float) -> dict[int, float]:
    return {b: base + per_node * b for b in DEFAULT_BUCKETS}


def test_the_policy_records_served_lengths_and_asks_for_a_calibration_beyond_them() -> None:
    p = BudgetPolicy(max_budget=64)
    p.observe_cost(3, 0.01, 9000)
    assert p.served_context == 9000 and p.calibration_due() is None  # never calibrated: none asked for
    p.calibrate(linear(1.0, 0.02).__getitem__, context=256)
    p.calibrate(linear(2.0, 0.1).__getitem__, context=8192)
    assert p.calibrated_contexts() == [256, 8192]
    assert p.calibration_due() is None  # 9000 is within 1.5x of 8192
    p.observe_cost(5, 0.01, 12_000)  # not a bucket: its time teaches nothing, its length still counts
    assert p.served_context == 12_000 and p.calibration_due() is None
    p.observe_cost(0, 0.01, 12_289)
    assert p.calibration_due() == 12_289 and p.calibration_due(ratio=2.0) is None
    p.observe_cost(0, 0.01, 500)  # shorter requests do not hide a long one
    assert p.calibration_due() == 12_289
    p.calibrate(linear(3.0, 0.2).__getitem__, context=12_289)
    assert p.calibration_due() is None and p.cost_context == 12_289


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_target(0, cpu_kernels=False), policy=BudgetPolicy(max_budget=8))


def test_a_calibration_at_a_served_length_moves_the_cost_curve_there(engine: Engine) -> None:
    policy = engine.policy
    calibrate(engine, contexts=(16, 48), repeats=1)
    assert policy.calibrated_contexts() == [16, 48] and policy.cost_context == 48
    engine.policy.observe_cost(0, 0.001, 300)  # a request ran on a 300-token cache
    length = policy.calibration_due()
    assert length == 300
    extrapolated = policy.costs(8, 300)
    costs = calibrate(engine, contexts=(length,), repeats=1)
    assert policy.calibrated_contexts() == [16, 48, 300] and policy.cost_context == 300
    assert {b: policy.cost(b, 300) for b in costs} == costs  # the measured costs at 300 tokens
    assert policy.costs(8, 300) != extrapolated  # measured now, not read off the short caches' line
    assert policy.calibration_due() is None


def test_a_cancelled_calibration_teaches_the_policy_nothing(engine: Engine) -> None:
    before = engine.policy.calibrated_contexts()
    cancel = threading.Event()
    cancel.set()
    assert calibrate(engine, contexts=(200, 64), repeats=1, cancel=cancel) == {}
    assert engine.policy.calibrated_contexts() == before
    assert calibrate(engine, contexts=(64,), repeats=1, cancel=threading.Event())  # not set: runs
    assert 64 in engine.policy.calibrated_contexts()


def test_each_size_forwards_once_untimed_before_its_timed_rounds(engine: Engine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A size's first forward is cold (its cache rows and scratch memory touched for the first time): it is run
    once before the rounds that are timed, so a cold first round cannot make a size look dear."""
    calls: list[int] = []
    verify = engine.verify

    def counted(root, tree, cache, metadata):  # type: ignore[no-untyped-def]
        calls.append(len(tree))
        return verify(root, tree, cache, metadata)

    monkeypatch.setattr(engine, "verify", counted)
    sizes = (0, 2, 4)
    _, costs = verify_costs(engine, 24, sizes, repeats=2)
    assert set(costs) == set(sizes) and all(v > 0 for v in costs.values())
    assert calls == [*sizes, *sizes, *sizes]  # an untimed round, then two timed ones, round-robin
