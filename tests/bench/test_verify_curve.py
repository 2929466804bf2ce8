"""bench.decode's verify-cost curve per CPU kernel path: every path this CPU runs, 2 .. 64 draft nodes each, on one
prefilled cache, and the model's own library put back afterwards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.decode_measure import VERIFY_NODES, verify_by_path
from decoding.runtime import kernels
from decoding.speculative.engine import Engine
from tests.decoding.conftest import VOCAB, TinyTarget, TinyTokenizer, quantized_tiny_llama


def test_the_curve_is_measured_on_every_path() -> None:
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    model = quantized_tiny_llama(3)
    own = model.lib
    engine = Engine(TinyTarget(model, TinyTokenizer(), "tiny", torch.device("cpu"), (), 512))
    bench = SimpleNamespace(engine=engine, target=SimpleNamespace(vocab_size=VOCAB))
    curves = verify_by_path(bench, 100, 1)  # type: ignore[arg-type]
    assert list(curves) == list(reversed(kernels.available_isas()))  # the baseline first
    for curve in curves.values():
        assert curve["step_ms"] > 0
        assert list(curve["ours_vs_step"]) == [str(n) for n in VERIFY_NODES if n]
        assert all(v > 0 for v in curve["ours_vs_step"].values())
    assert model.lib is own


def test_the_other_kv_twins_are_the_storages_the_target_does_not_use() -> None:
    """`autoregressive_kv_<name>` is offered for every KV storage but the target's own (bf16 is not fp16)."""
    from bench.decode_methods import all_methods

    for own, others in (("bfloat16", {"fp32", "fp16", "int8"}), ("float16", {"fp32", "bf16", "int8"})):
        target = SimpleNamespace(runtime=f"cpu-quantized:gguf:Q4_1+Q8_0/kv-{own}")
        methods = all_methods(target)  # type: ignore[arg-type]
        twins = {m.removeprefix("autoregressive_kv_") for m in methods if m.startswith("autoregressive_kv_")}
        assert twins == others
