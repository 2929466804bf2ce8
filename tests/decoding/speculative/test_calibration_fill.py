"""Random key/value rows in place of a prefill (``decoding.cache.slot.fill_random``): the layout a prefill writes,
appended after the live rows; the calibration uses them off a CPU (here forced with ``fill=True``) and runs
no prefill then, while a CPU engine keeps prefilling random tokens as before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from decoding.cache.slot import SlotCache, fill_random
from decoding.speculative.budget import BudgetPolicy
from decoding.speculative.calibration import calibrate, verify_costs
from decoding.speculative.engine import Engine
from tests.decoding.conftest import tiny_target


@pytest.fixture(scope="module")
def engine() -> Engine:
    # head_dim 24, not hidden / heads (16): the rows must follow the config's head size
    return Engine(tiny_target(0, cpu_kernels=False, head_dim=24), policy=BudgetPolicy(max_budget=4))


def test_random_rows_have_a_prefills_layout_and_follow_the_live_rows(engine: Engine) -> None:
    config, dtype, device = engine.model.config, engine.model.dtype, engine.device
    prefilled = SlotCache(engine.num_layers, 8)
    with torch.inference_mode():
        engine.prefill([1, 2, 3, 4, 5], prefilled)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in prefilled.slot_layers]  # type: ignore[union-attr]
    fill_random(prefilled, config, 7, dtype, device, torch.Generator().manual_seed(1))  # grows past capacity 8
    assert prefilled.length == 12
    for layer, (keys, values) in zip(prefilled.slot_layers, before, strict=True):
        assert layer.length == 12 and layer.keys is not None and layer.values is not None
        assert torch.equal(layer.keys[:, :, :5], keys) and torch.equal(layer.values[:, :, :5], values)
        new = layer.keys[:, :, 5:]
        assert new.dtype == dtype and bool(new.isfinite().all()) and float(new.std()) > 0.5

    fresh = SlotCache(engine.num_layers, 4)
    fill_random(fresh, config, 5, dtype, device, torch.Generator().manual_seed(1))
    again = SlotCache(engine.num_layers, 4)
    fill_random(again, config, 5, dtype, device, torch.Generator().manual_seed(1))
    for layer, other, written in zip(fresh.slot_layers, again.slot_layers, prefilled.slot_layers, strict=True):
        assert layer.keys is not None and other.keys is not None and written.keys is not None
        assert layer.keys.shape == written.keys[:, :, :5].shape  # [1, kv heads, rows, head_dim] as a prefill
        assert layer.keys.device == device
        assert torch.equal(layer.keys, other.keys)  # the generator decides the rows: reproducible


def test_a_filled_calibration_runs_no_prefill(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_prefill(*_: Any, **__: Any) -> Any:
        raise AssertionError("a filled calibration ran a prefill")

    monkeypatch.setattr(engine, "prefill", no_prefill)
    monkeypatch.setattr(engine.reader, "read", no_prefill)
    state = torch.random.get_rng_state()
    costs = calibrate(engine, contexts=(40, 120), repeats=1, fill=True)
    assert engine.policy.calibrated_contexts() == [40, 120] and engine.policy.cost_context == 120
    assert set(costs) == set(engine.policy.buckets) and all(c > 0 for c in costs.values())
    assert torch.equal(torch.random.get_rng_state(), state)  # its own generators: sampling's state untouched
    base, times = verify_costs(engine, 100_000, (0, 2), repeats=1, fill=True)
    assert base == engine.max_context - 2 - 2 and set(times) == {0, 2}  # clamped to the window as before


def test_a_cpu_engine_still_prefills_random_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prefilled: list[int] = []
    real = engine.prefill

    def counted(ids: list[int], cache: SlotCache) -> Any:
        prefilled.append(len(ids))
        return real(ids, cache)

    monkeypatch.setattr(engine, "prefill", counted)
    base, _ = verify_costs(engine, 64, (0, 2), repeats=1)  # fill=None on a CPU: a prefill
    assert prefilled == [64] and base == 64
