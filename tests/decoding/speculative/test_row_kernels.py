"""The row kernels' choice at calibration (``choose_row_kernels``): two kernels that give the same bits (pairs of weight
groups on 512-bit vectors, one group at a time), the faster kept per count of a forward's rows, on the library the
quantized runtime runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from decoding.runtime import kernels
from decoding.runtime.quantized import QuantizedModel
from decoding.speculative import calibration
from decoding.speculative.budget import BudgetPolicy
from decoding.speculative.calibration import calibrate, choose_row_kernels
from decoding.speculative.engine import Engine
from tests.decoding.conftest import needs_kernels, tiny_target

pytestmark = needs_kernels


@pytest.fixture
def engine() -> Iterator[Engine]:
    """A quantized tiny target; the library's pair table is put back as it was afterwards."""
    eng = Engine(tiny_target(0, quantized=True), policy=BudgetPolicy(max_budget=8))
    assert isinstance(eng.model, QuantizedModel)
    start = eng.model.row_kernels()
    yield eng
    eng.model.row_kernels(start or None)


def _needs_pairs(engine: Engine) -> int:
    assert isinstance(engine.model, QuantizedModel)
    n = len(engine.model.row_kernels())
    if not n:
        pytest.skip("this CPU's kernel path has no pairs of weight groups: nothing to choose")
    return n


def test_the_faster_kernel_is_kept_for_each_row_count(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings that make pairs faster from 7 rows on (and at 3): the choice is exactly that, in the library."""
    n = _needs_pairs(engine)
    model = engine.model
    assert isinstance(model, QuantizedModel)

    def timed(eng, cache, root, sizes, repeats, gen, cancel=None):  # type: ignore[no-untyped-def]
        pairs = model.row_kernels()[1]  # every entry alike while one kernel is timed
        return {s: (1.0 if (s + 1 >= 7 or s + 1 == 3) else 3.0) if pairs else 2.0 for s in sizes}

    monkeypatch.setattr(calibration, "time_verifies", timed)
    choice = choose_row_kernels(engine, repeats=3)
    want = [m >= 7 or m == 3 for m in range(n)]
    assert choice is not None and choice[1:] == want[1:]
    assert model.row_kernels()[1:] == want[1:]


def test_a_cancelled_choice_leaves_the_kernels_as_they_were(engine: Engine) -> None:
    _needs_pairs(engine)
    model = engine.model
    assert isinstance(model, QuantizedModel)
    before = model.row_kernels([m % 2 == 1 for m in range(len(model.row_kernels()))])
    cancel = threading.Event()
    cancel.set()
    assert choose_row_kernels(engine, repeats=1, cancel=cancel) is None
    assert model.row_kernels() == before


def test_the_first_calibration_chooses_and_the_choice_keeps_the_bits(engine: Engine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured for real on the tiny model: the first calibration of an engine chooses (a later one does not), and
    a verify gives the same logits under either kernel for every row count."""
    n = _needs_pairs(engine)
    chosen: list[Sequence[bool] | None] = []
    choose = calibration.choose_row_kernels

    def counted(*args, **kw):  # type: ignore[no-untyped-def]
        chosen.append(choose(*args, **kw))
        return chosen[-1]

    monkeypatch.setattr(calibration, "choose_row_kernels", counted)
    calibrate(engine, contexts=(16,), repeats=1)
    calibrate(engine, contexts=(48,), repeats=1)
    assert len(chosen) == 1 and chosen[0] is not None and len(chosen[0]) == n
    model = engine.model
    assert isinstance(model, QuantizedModel) and model.row_kernels() == list(chosen[0])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.vocab_size, (1, 40), generator=g)
    for rows in (1, 2, 5, 9, 17, 24):
        outs = []
        for pairs in (False, True):
            model.row_kernels([pairs] * n)
            cache = model.new_cache(64)
            model.forward(ids[:, :16], cache)
            outs.append(model.forward(ids[:, 16 : 16 + rows], cache))
        assert torch.equal(outs[0], outs[1]), rows
    assert kernels.pair_table(kernels.library("avx2")) == []  # the baseline path has one kernel only


def test_a_small_window_times_its_widest_verify_inside_it() -> None:
    """The cache the kernels are timed on shrinks to leave the widest verify room in the window."""
    eng = Engine(tiny_target(0, quantized=True, max_context=48), policy=BudgetPolicy(max_budget=8))
    assert isinstance(eng.model, QuantizedModel)
    start = eng.model.row_kernels()
    if not start:
        pytest.skip("this CPU's kernel path has no pairs of weight groups: nothing to choose")
    lengths: list[int] = []
    timed = calibration.time_verifies

    def seen(engine, cache, *args, **kw):  # type: ignore[no-untyped-def]
        lengths.append(cache.length)
        return timed(engine, cache, *args, **kw)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(calibration, "time_verifies", seen)
            choice = choose_row_kernels(eng, repeats=1)
        assert choice is not None and len(choice) == len(start)
        assert lengths and all(n + 17 <= 48 for n in lengths)  # the widest: 16 nodes + the root after the cache
    finally:
        eng.model.row_kernels(start)


def test_a_table_of_the_wrong_length_is_refused_and_changes_nothing(engine: Engine) -> None:
    n = _needs_pairs(engine)
    model = engine.model
    assert isinstance(model, QuantizedModel)
    before = model.row_kernels()
    with pytest.raises(ValueError, match=f"{n} entries, not 3"):
        model.row_kernels([True, True, True])
    assert model.row_kernels() == before
