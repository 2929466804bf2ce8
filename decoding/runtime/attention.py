"""Grouped-query SDPA that keeps key/value heads grouped even under an explicit attention mask.

transformers' ``sdpa`` attention repeats the key/value heads to the query-head count whenever a mask is
given (CUDA's fused kernels need that). Every verify pass of a draft tree carries a mask, so on a CPU each
step would copy the whole KV cache (3 -> 9 heads for SmolLM2) in every layer. torch's CPU SDPA handles
``enable_gqa`` with a mask directly, without the copy (docs/benchmarks.md, Decoding, has the measured difference).
``use_grouped_sdpa`` switches a model to it. On CUDA the same registered function runs
``decoding.runtime.attention_cuda`` instead (flash on the grouped heads, or the query heads folded onto their key/value
head), and the model's mask function leaves plain causal masks to it; on a CPU both behave as described here.

On a model switched to the CPU kernels (``decoding.runtime.kernels.use_cpu_kernels``), forwards over up to
``MAX_ROWS`` tokens run the batch-invariant attention kernel instead: each query attends to the fully visible
cached prefix plus its own visible rows among the new ones (its tree path, or the causal block), read from
the mask once per forward.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from decoding.runtime import attention_cuda, kernels
from decoding.runtime.interface import Visibility, visibility

NAME = "ragspec_grouped_sdpa"

_memo = threading.local()


def _visibility_cached(mask: torch.Tensor | None, n: int, length: int) -> Visibility | None:
    """``visibility``, computed once per forward: every layer gets the same mask object."""
    if mask is None:
        return visibility(None, n, length)
    memo = getattr(_memo, "entry", None)
    if memo is not None and memo[0]() is mask and memo[1] == (n, length):
        return memo[2]  # type: ignore[no-any-return]
    vis = visibility(mask, n, length)
    _memo.entry = (weakref.ref(mask), (n, length), vis)
    return vis


def _kernel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor | None:
    lib = kernels.loaded()
    if lib is None or not getattr(module, kernels.KERNEL_FLAG, False) or dropout or torch.is_grad_enabled():
        return None
    b, _, n, d = query.shape
    if b != 1 or n > kernels.MAX_ROWS or d % 8 or d > 256 or query.dtype != torch.float32:
        return None
    if key.dtype != torch.float32 or key.stride(-1) != 1 or value.stride() != key.stride():
        return None
    vis = _visibility_cached(attention_mask, n, key.shape[-2])
    if vis is None:
        return None
    past, path, off = vis
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    return kernels.attention(lib, query, key, value, past, path, off, scale)


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, q, d]
    key: torch.Tensor,  # [b, kv_heads, k, d]
    value: torch.Tensor,  # [b, kv_heads, k, d]
    attention_mask: torch.Tensor | None,  # [b, 1, q, >= k] additive or bool, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    if softcap:  # Gemma 2's soft-capped scores: neither SDPA nor the kernels cap them
        return _capped_attention(query, key, value, attention_mask, scaling, softcap), None
    if attention_cuda.cuda_path(query.device):
        return attention_cuda.attend(module, query, key, value, attention_mask, dropout, scaling, is_causal), None
    fast = _kernel_attention(module, query, key, value, attention_mask, dropout, scaling)
    if fast is not None:
        return fast, None
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:  # no mask and several queries only happens when q and k cover the same tokens
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(is_causal),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None  # [b, q, heads, d]


def _capped_attention(
    query: torch.Tensor,  # [b, heads, q, d]
    key: torch.Tensor,  # [b, kv_heads, k, d]
    value: torch.Tensor,  # [b, kv_heads, k, d]
    attention_mask: torch.Tensor | None,  # [b, 1, q, >= k] additive or bool, or None (causal)
    scaling: float | None,
    cap: float,
) -> torch.Tensor:
    """Attention with scores soft-capped at ``cap`` (cap * tanh(s / cap), before the mask), as transformers'
    eager Gemma 2 attention computes it: ``[b, q, heads, d]``."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(query, k.transpose(2, 3)) * scale / cap) * cap  # [b, heads, q, k]
    n, length = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(length - n)
    mask = attention_mask[..., :length]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def use_grouped_sdpa(model: Any) -> bool:
    """Switch ``model`` (currently using ``sdpa``, on any device) to grouped SDPA. Returns True if switched.

    Its mask function is transformers' ``sdpa_mask`` on a CPU; on CUDA it returns None for plain causal masks,
    which the attention applies aligned to the last key (``attention_cuda.grouped_mask``)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, grouped_sdpa_attention)
    AttentionMaskInterface.register(NAME, attention_cuda.grouped_mask)
    config._attn_implementation = NAME
    return True

