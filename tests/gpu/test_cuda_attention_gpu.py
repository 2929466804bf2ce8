"""decoding.runtime.attention_cuda on the device: flash takes grouped heads and returns the natural log-sum-exp the
tree path merges with, every path equals float64 attention over explicitly repeated heads in bf16 and fp32,
no SDPA call would make the math kernel repeat key/value heads, and a tiny Llama (4 query heads per KV head)
and Qwen2 (7) through the engine copy no heads and equal eager attention.

``RAGSPEC_TEST_DEVICE=cpu`` runs these with the CUDA branch forced on CPU tensors (the CPU flash operator
standing in, flash deemed runnable in half precision only, as on CUDA): that checks the tests' own logic.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import CausalBias

from decoding.runtime import attention_cuda
from decoding.runtime.attention_cuda import attend, describe_tree_mask, prefix_attention
from decoding.speculative.tree import tree_layout
from tests.decoding.runtime.test_cuda_attention import (
    CAUSAL,
    MODELS,
    _additive,
    _qkv,
    _tree,
    engine_matches_eager,
    reference,
)

pytestmark = pytest.mark.gpu  # tests/gpu/conftest.py skips them without CUDA

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _half_precision_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """On CPU tensors: flash where CUDA's would run (half precision, head sizes it has)."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


@pytest.fixture
def calls(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Counts of the tree path's flash calls and of folds, and every SDPA call's (grouped, mask kind, flash
    could run it); off CUDA the CUDA branch is forced."""
    if device.type != "cuda":
        monkeypatch.setattr(attention_cuda, "cuda_path", lambda d: True)
        monkeypatch.setattr(attention_cuda, "flash_ok", _half_precision_flash)
    counts: dict[str, Any] = {"prefix": 0, "fold": 0, "sdpa": []}
    real_prefix, real_fold = attention_cuda.prefix_attention, attention_cuda.fold
    real_sdpa = F.scaled_dot_product_attention
    depth = [0]

    def prefix(*args: Any, **kwargs: Any) -> Any:
        counts["prefix"] += 1
        return real_prefix(*args, **kwargs)

    def fold(*args: Any, **kwargs: Any) -> Any:
        counts["fold"] += 1
        return real_fold(*args, **kwargs)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attn_mask")
        grouped = bool(kwargs.get("enable_gqa"))
        # a nested call is torch materialising a CausalBias: never on CUDA when flash can run, always on CPU
        if not depth[0] or device.type == "cuda":
            kind = "none" if mask is None else "bias" if isinstance(mask, CausalBias) else "tensor"
            if device.type == "cuda":
                flash = bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, grouped)))
            else:
                flash = _half_precision_flash(q, k, v)
            counts["sdpa"].append((grouped, kind, flash))
        depth[0] += 1
        try:  # a spy in its place hides the real function from CausalBias's own dispatch: call it directly
            if isinstance(mask, CausalBias):
                return CausalBias._dispatch(q, k, v, **kwargs)
            return real_sdpa(q, k, v, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(attention_cuda, "prefix_attention", prefix)
    monkeypatch.setattr(attention_cuda, "fold", fold)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    yield counts


def _no_repeating_kernel(calls: dict[str, Any]) -> None:
    """Every grouped SDPA call runs on flash and carries no tensor mask: none reaches the math kernel, which
    would repeat the key/value heads."""
    assert calls["sdpa"], "the spy saw no SDPA call"
    grouped = [c for c in calls["sdpa"] if c[0]]
    assert all(kind != "tensor" and flash for _, kind, flash in grouped), calls["sdpa"]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err


def test_flash_takes_grouped_heads_and_returns_the_natural_log_sum_exp(device: torch.device) -> None:
    for groups in (4, 7):
        q, k, v = _qkv(groups, 9, 300, torch.bfloat16, d=128, seed=groups, device=device)
        if device.type == "cuda":
            assert attention_cuda.flash_ok(q, k, v)
            assert not attention_cuda.flash_ok(q.float(), k.float(), v.float())
        out, lse = prefix_attention(q, k, v, 1 / math.sqrt(128))
        assert lse.shape == (1, 2 * groups, 9) and lse.dtype == torch.float32
        kr = k.double().repeat_interleave(groups, dim=1)
        scores = q.double() @ kr.transpose(-1, -2) / math.sqrt(128)
        assert (lse.double() - torch.logsumexp(scores, dim=-1)).abs().max().item() < 1e-3
        _close(out.transpose(1, 2), reference(q, k, v, None), torch.bfloat16)


@DTYPES
@pytest.mark.parametrize("groups", [4, 7])
def test_every_path_is_exact_on_the_device(
    device: torch.device, calls: dict[str, Any], groups: int, dtype: torch.dtype
) -> None:
    half = dtype != torch.float32
    for n, length in ((64, 64), (16, 200), (1, 201)):  # first chunk, a chunk after cached rows, a decode row
        q, k, v = _qkv(groups, n, length, dtype, d=128, seed=n, device=device)
        lower_right = torch.ones(n, length, dtype=torch.bool, device=device).tril(length - n)
        _close(attend(CAUSAL, q, k, v, None), reference(q, k, v, lower_right), dtype)
    assert calls["fold"] == (0 if half else 3)

    past = 250
    layout = tree_layout(12, _tree(), past, device)
    n = layout.ancestor_mask.shape[0]
    prefix = torch.ones(n, past, dtype=torch.bool, device=device)
    visible = torch.cat([prefix, layout.ancestor_mask], dim=1)
    q, k, v = _qkv(groups, n, past + n, dtype, d=128, seed=groups, device=device)
    mask = describe_tree_mask(_additive(visible, dtype), past, layout.ancestor_mask)
    _close(attend(CAUSAL, q, k, v, mask), reference(q, k, v, visible), dtype)
    assert (calls["prefix"], calls["fold"]) == ((1, 0) if half else (0, 4))

    prefix[:, 40:90] = False  # rapid_kv: a subset of the prompt's rows
    visible = torch.cat([prefix, layout.ancestor_mask], dim=1)
    _close(attend(CAUSAL, q, k, v, _additive(visible, dtype)), reference(q, k, v, visible), dtype)
    assert calls["prefix"] == (1 if half else 0) and calls["fold"] == (1 if half else 5)
    _no_repeating_kernel(calls)


@DTYPES
@pytest.mark.parametrize("name", MODELS)
def test_engine_on_the_device_copies_no_heads_and_matches_eager(
    device: torch.device, calls: dict[str, Any], monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype
) -> None:
    half = dtype != torch.float32
    engine_matches_eager(name, monkeypatch, device, dtype, 3e-2 if half else 1e-3, head_dim=64)
    if half:  # flash everywhere: the verify's prefix in both layers, and no mask was ever materialised
        assert (calls["prefix"], calls["fold"]) == (2, 0)
    else:
        assert calls["prefix"] == 0 and calls["fold"] > 0
    _no_repeating_kernel(calls)
