"""The CUDA attention paths (decoding.runtime.attention_cuda), run on CPU tensors with the CUDA branch forced: each
path is exact attention (against float64 math over explicitly repeated heads), none repeats key/value heads,
and the CPU behaviour is unchanged when the branch is not forced."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import sdpa_mask
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from decoding.cache.slot import SlotCache
from decoding.runtime import attention_cuda
from decoding.runtime.attention import NAME, use_grouped_sdpa
from decoding.runtime.attention_cuda import attend, describe_tree_mask, grouped_mask
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.engine import Engine, EngineConfig
from decoding.speculative.tree import ROOT, DraftTree, tree_layout
from tests.decoding.conftest import TinyTarget, make_tiny_llama


class _Layer(torch.nn.Module):
    """What ``attend`` reads of an attention layer: ``is_causal``."""

    is_causal = True


CAUSAL = _Layer()


def _tree() -> DraftTree:
    tree = DraftTree()
    a = tree.add(ROOT, 20, "x")
    b = tree.add(ROOT, 21, "x")
    c = tree.add(a, 22, "x")
    tree.add(c, 23, "x")
    tree.add(b, 24, "x")
    tree.add(a, 25, "x")
    return tree


def _qkv(groups: int, n: int, length: int, dtype: torch.dtype, kv_heads: int = 2, d: int = 64, seed: int = 0,
         device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Laid out as a Llama layer hands them over: q a transposed view, k / v the live rows of a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    q = torch.randn(1, n, heads, d, generator=gen).to(device, dtype).transpose(1, 2)
    kbuf = torch.randn(1, kv_heads, length + 9, d, generator=gen).to(device, dtype)
    vbuf = torch.randn(1, kv_heads, length + 9, d, generator=gen).to(device, dtype)
    return q, kbuf[:, :, :length], vbuf[:, :, :length]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """float64 softmax attention with the key/value heads repeated explicitly: ``[b, n, H, d]``."""
    groups = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(groups, dim=1)
    vr = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    return (torch.softmax(scores, dim=-1) @ vr).transpose(1, 2)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (got.double() - want).abs().max().item()
    assert err < atol, err


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, *visible.shape)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Force the CUDA branch on CPU tensors; count the tree path's prefix attention and the fold calls."""
    monkeypatch.setattr(attention_cuda, "cuda_path", lambda device: True)
    counts = {"prefix": 0, "fold": 0}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(attention_cuda, "prefix_attention", counted("prefix", attention_cuda.prefix_attention))
    monkeypatch.setattr(attention_cuda, "fold", counted("fold", attention_cuda.fold))
    yield counts


def _flash(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Pretend flash can (or cannot) run: on CPU tensors the CPU flash operator stands in for CUDA's."""
    monkeypatch.setattr(attention_cuda, "flash_ok", lambda q, k, v: on)


PARAMS = pytest.mark.parametrize(
    "groups,dtype,flash",
    [(g, dt, f) for g in (4, 7) for dt in (torch.float32, torch.bfloat16) for f in (True, False)],
)


@PARAMS
def test_unmasked_paths_are_causal_aligned_to_the_last_key(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch, groups: int, dtype: torch.dtype, flash: bool
) -> None:
    _flash(monkeypatch, flash)
    for n, length in ((12, 12), (5, 40), (1, 33)):  # first chunk, a chunk after cached rows, a decode row
        q, k, v = _qkv(groups, n, length, dtype, seed=n)
        lower_right = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        _close(attend(CAUSAL, q, k, v, None), reference(q, k, v, lower_right), dtype)
    assert calls["fold"] == (0 if flash else 3)


@PARAMS
def test_described_tree_mask_matches_reference(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch, groups: int, dtype: torch.dtype, flash: bool
) -> None:
    _flash(monkeypatch, flash)
    past = 37
    layout = tree_layout(12, _tree(), past)
    n = layout.ancestor_mask.shape[0]
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), layout.ancestor_mask], dim=1)
    q, k, v = _qkv(groups, n, past + n, dtype, seed=groups)
    mask = describe_tree_mask(_additive(visible, dtype), past, layout.ancestor_mask)
    _close(attend(CAUSAL, q, k, v, mask), reference(q, k, v, visible), dtype)
    assert (calls["prefix"], calls["fold"]) == ((1, 0) if flash else (0, 1))


@PARAMS
def test_masks_hiding_part_of_the_prefix_take_the_fold_path(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch, groups: int, dtype: torch.dtype, flash: bool
) -> None:
    """rapid_kv's mask (one row seeing a subset of the prompt) and a tree over a partly hidden prefix."""
    _flash(monkeypatch, flash)
    length = 50
    seen = torch.rand(length, generator=torch.Generator().manual_seed(1)) < 0.5
    seen[-1] = True
    q, k, v = _qkv(groups, 1, length, dtype, seed=3)
    _close(attend(CAUSAL, q, k, v, _additive(seen.view(1, -1), dtype)), reference(q, k, v, seen.view(1, -1)), dtype)

    past = 30
    layout = tree_layout(12, _tree(), past)
    n = layout.ancestor_mask.shape[0]
    visible = torch.cat([seen[:past].expand(n, past), layout.ancestor_mask], dim=1)
    q, k, v = _qkv(groups, n, past + n, dtype, seed=4)
    _close(attend(CAUSAL, q, k, v, visible.view(1, 1, n, -1)), reference(q, k, v, visible), dtype)  # bool mask
    assert (calls["prefix"], calls["fold"]) == (0, 2)


def test_fold_takes_cudas_transposed_sdpa_output(calls: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's SDPA kernels hand back ``[b, heads, rows, d]`` as a transposed view (CPU's is contiguous): the fold
    must not assume a layout that merges its heads (a ``view`` raised there)."""
    _flash(monkeypatch, False)
    sdpa = F.scaled_dot_product_attention

    def cuda_layout(*args: Any, **kwargs: Any) -> torch.Tensor:
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    for n, length in ((12, 12), (5, 40), (1, 33)):
        q, k, v = _qkv(4, n, length, torch.float32, seed=n)
        lower_right = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        _close(attend(CAUSAL, q, k, v, None), reference(q, k, v, lower_right), torch.float32)
    visible = torch.rand(3, 20, generator=torch.Generator().manual_seed(5)) < 0.6
    visible[:, -1] = True
    q, k, v = _qkv(4, 3, 20, torch.float32, seed=6)
    _close(attend(CAUSAL, q, k, v, _additive(visible, torch.float32)), reference(q, k, v, visible), torch.float32)
    assert calls["fold"] == 4


def test_tree_merge_reads_only_the_rows_of_a_padded_log_sum_exp(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some attention kernels pad their log-sum-exp's rows (to a multiple of 32): only the first n are real."""
    _flash(monkeypatch, True)
    prefix = attention_cuda.prefix_attention

    def padded(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = prefix(*args, **kwargs)
        return out, torch.nn.functional.pad(lse, (0, 32 - lse.shape[-1]), value=123.0)

    monkeypatch.setattr(attention_cuda, "prefix_attention", padded)
    past = 37
    layout = tree_layout(12, _tree(), past)
    n = layout.ancestor_mask.shape[0]
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), layout.ancestor_mask], dim=1)
    q, k, v = _qkv(4, n, past + n, torch.float32, seed=9)
    mask = describe_tree_mask(_additive(visible, torch.float32), past, layout.ancestor_mask)
    _close(attend(CAUSAL, q, k, v, mask), reference(q, k, v, visible), torch.float32)


def test_causal_forward_off_flash_bounds_its_mask_by_row_blocks(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off flash a causal forward materialises its mask: rows are taken in blocks so the mask stays under
    ``FOLD_MASK_BYTES`` (a 4096-row chunk at a long context would otherwise need gigabytes), same result."""
    _flash(monkeypatch, False)
    groups, n, length = 4, 23, 61
    monkeypatch.setattr(attention_cuda, "FOLD_MASK_BYTES", 4 * groups * length * 5)  # 5 rows per block
    q, k, v = _qkv(groups, n, length, torch.float32, seed=8)
    lower_right = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    _close(attend(CAUSAL, q, k, v, None), reference(q, k, v, lower_right), torch.float32)
    assert calls["fold"] == 5  # ceil(23 / 5)


def test_a_description_belongs_to_one_mask_object_and_shape(calls: dict[str, int]) -> None:
    past, n = 8, 3
    block = torch.ones(n, n, dtype=torch.bool).tril()
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool), block], dim=1)
    mask = describe_tree_mask(_additive(visible, torch.float32), past, block)
    assert attention_cuda._description(mask, n, past + n) is not None
    assert attention_cuda._description(mask.clone(), n, past + n) is None  # equal values, another object
    assert attention_cuda._description(mask, n, past + n + 1) is None  # does not fit these keys


def test_describing_a_mask_records_nothing_off_the_cuda_path() -> None:
    block = torch.ones(2, 2, dtype=torch.bool).tril()
    mask = describe_tree_mask(torch.zeros(1, 1, 2, 6), 4, block)
    assert attention_cuda._description(mask, 2, 6) is None


def test_mask_function_skips_only_plain_causal_masks_on_the_cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    args: dict[str, Any] = {"batch_size": 1, "cache_position": torch.arange(6, 10), "kv_length": 10}
    want, got = sdpa_mask(**args), grouped_mask(**args)
    assert want is not None and got is not None  # transformers materialises a chunk after cached rows
    assert torch.equal(got, want)  # a CPU model: exactly transformers' mask
    monkeypatch.setattr(attention_cuda, "cuda_path", lambda device: True)
    assert grouped_mask(**args) is None
    padded = torch.ones(1, 10, dtype=torch.bool)
    padded[0, 0] = False
    want, got = sdpa_mask(**args, attention_mask=padded), grouped_mask(**args, attention_mask=padded)
    assert want is not None and got is not None and torch.equal(got, want)
    assert grouped_mask(**args, allow_is_causal_skip=False) is not None  # a compileable cache


def test_no_sdpa_call_would_repeat_heads(calls: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA's math kernel repeats K/V under ``enable_gqa``, and only flash (which takes no tensor mask) reads
    grouped heads: so grouped calls carry no tensor mask, and none at all are grouped where flash cannot run.
    ``causal_lower_right`` is handed to SDPA only where flash runs; on CPU torch then materialises it, and
    the nested call that makes is not ours."""
    seen: list[tuple[bool, str]] = []
    real = F.scaled_dot_product_attention
    depth = [0]

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attn_mask")
        if not depth[0]:
            kind = "none" if mask is None else "bias" if isinstance(mask, CausalBias) else "tensor"
            seen.append((bool(kwargs.get("enable_gqa")), kind))
        depth[0] += 1
        try:  # what torch does for a CausalBias, which no longer sees itself called through the real function
            return CausalBias._dispatch(*args, **kwargs) if isinstance(mask, CausalBias) else real(*args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for flash in (True, False):
        _flash(monkeypatch, flash)
        seen.clear()
        for n, length in ((12, 12), (5, 40), (1, 33)):
            q, k, v = _qkv(4, n, length, torch.float32)
            attend(CAUSAL, q, k, v, None)
        past = 20
        layout = tree_layout(12, _tree(), past)
        n = layout.ancestor_mask.shape[0]
        visible = torch.cat([torch.ones(n, past, dtype=torch.bool), layout.ancestor_mask], dim=1)
        q, k, v = _qkv(4, n, past + n, torch.float32)
        attend(CAUSAL, q, k, v, describe_tree_mask(_additive(visible, torch.float32), past, layout.ancestor_mask))
        attend(CAUSAL, q, k, v, _additive(visible, torch.float32))  # undescribed
        assert seen, "the spy saw no call"
        assert not [s for s in seen if s == (True, "tensor")], seen
        if not flash:
            assert not [s for s in seen if s[0]], seen


def _no_head_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> torch.Tensor:
        raise AssertionError("key/value heads repeated")

    for module in (modeling_llama, modeling_qwen2):
        monkeypatch.setattr(module, "repeat_kv", refuse)
    monkeypatch.setattr("transformers.integrations.sdpa_attention.repeat_kv", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)


def tiny_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               head_dim: int | None = None) -> Any:
    """``llama-g4``: 4 query heads per key/value head; ``qwen2-g7``: 7 (the shapes of Llama-3 and Qwen2.5)."""
    model: Any
    if name == "llama-g4":
        model = make_tiny_llama(seed=3, cpu_kernels=False, heads=8, kv_heads=2, head_dim=head_dim)
    else:
        torch.manual_seed(4)
        config = Qwen2Config(vocab_size=97, hidden_size=56, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=7, num_key_value_heads=1, max_position_embeddings=256,
                             attn_implementation="sdpa", head_dim=head_dim or 8)  # fmt: skip
        model = Qwen2ForCausalLM(config).eval()
    return model.to(device, dtype)


PREFIX = [7, 8, 9, 10, 11, 30, 31, 32, 33, 34]
PATHS = {0: [12], 1: [12, 20], 2: [12, 21], 3: [12, 20, 22], 4: [12, 20, 22, 23], 5: [12, 21, 24], 6: [12, 20, 25]}


def engine_matches_eager(
    name: str, monkeypatch: pytest.MonkeyPatch, device: torch.device, dtype: torch.dtype, atol: float,
    head_dim: int | None = None,
) -> None:
    """A prefill in chunks of 4 (the first without cached rows, then after them) and a tree verify through
    the engine, with no key/value head copy allowed: the prompt's last logits and every tree row's equal
    eager attention (which repeats heads) over the same tokens."""
    model = tiny_model(name, device, dtype, head_dim)
    eager = tiny_model(name, device, dtype, head_dim)
    eager.config._attn_implementation = "eager"
    with torch.inference_mode():
        want_last = eager(torch.tensor([PREFIX], device=device)).logits[0, -1]
        want_rows = {row: eager(torch.tensor([[*PREFIX, *p]], device=device)).logits[0, -1] for row, p in PATHS.items()}
        use_grouped_sdpa(model)  # make_tiny_llama has already switched its model
        assert model.config._attn_implementation == NAME
        _no_head_copies(monkeypatch)
        engine = Engine(TinyTarget(TorchRuntime(model), None, name, device, (), 256),
                        config=EngineConfig(prefill_chunk=4))
        cache = SlotCache(engine.num_layers, 32)
        last, _ = engine.prefill(PREFIX, cache)
        layout = tree_layout(12, _tree(), cache.length, device)
        mask = engine._mask(layout.ancestor_mask, len(PREFIX))
        got = engine._forward(layout.input_ids, cache, layout.position_ids, mask)
    assert (last.float() - want_last.float()).abs().max().item() < atol
    for row, want in want_rows.items():
        assert (got[row].float() - want.float()).abs().max().item() < atol, row


MODELS = ("llama-g4", "qwen2-g7")


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_engine_on_the_cuda_paths_repeats_no_heads_and_matches_eager(
    calls: dict[str, int], monkeypatch: pytest.MonkeyPatch, name: str, flash: bool
) -> None:
    _flash(monkeypatch, flash)
    engine_matches_eager(name, monkeypatch, torch.device("cpu"), torch.float32, 1e-4)
    assert calls["prefix"] == (2 if flash else 0)  # the verify took the tree path in both layers
