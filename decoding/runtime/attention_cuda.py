"""Attention on CUDA for grouped-query models, without ever copying key/value heads.

transformers' ``sdpa`` attention repeats the key/value heads to the query-head count (``repeat_kv``) and
builds an explicit mask for every forward whose queries do not cover the same tokens as the keys. On a
long context that copies the whole KV cache of every layer (4x for Llama-3, 7x for Qwen2.5) and rules out
the flash kernel. Of torch's SDPA kernels only flash reads grouped heads as they are; the math kernel
repeats them internally when asked for ``enable_gqa``. So every forward here either runs flash on the
grouped heads or folds the query heads of each key/value head into rows (``fold``) and calls SDPA with
equal head counts: nothing ever repeats K/V.

Which path runs (``attend``):

- no mask, queries and keys cover the same tokens (the first prefill chunk): flash, causal.
- no mask, the queries are the last ``n`` of the keys (a prefill chunk after cached rows; one decode row):
  lower-right causal, which flash applies without a mask. ``grouped_mask`` (the model's mask function)
  returns None for exactly this plain causal case on CUDA, where transformers would build a mask; on a
  CPU it defers to transformers' ``sdpa_mask`` so CPU forwards never see it.
- an explicit mask described by ``describe_tree_mask`` (the engine's verify: the cached prefix all
  visible, then a tree block): flash over the prefix, which also returns each row's log-sum-exp, exact
  math over the small ``[n, n]`` tree block, the two merged by log-sum-exp.
- any other explicit mask (a drafter hiding part of the prompt, padding), or where flash cannot run
  (fp32, head sizes it lacks): ``fold``, one SDPA call with the mask's rows repeated per query group.

All of them are exact attention; they differ only in rounding. ``cuda_path`` and ``flash_ok`` are the two
decisions, and tests replace them to run these paths on CPU tensors (``prefix_attention`` then uses the CPU
flash operator, which returns the log-sum-exp too).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right
from transformers.masking_utils import causal_mask_function, sdpa_mask

FOLD_MASK_BYTES = 256 << 20  # bound on the mask a causal forward off flash materialises per SDPA call
TreeDescription = tuple[int, torch.Tensor]  # (past, tree block: bool [n, n], True = visible)
_described = threading.local()


def cuda_path(device: torch.device) -> bool:
    """Whether tensors on ``device`` take this module's paths (tests force it for CPU tensors)."""
    return device.type == "cuda"


def flash_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether torch's flash kernel runs these tensors as they are: it is the one SDPA kernel that reads
    grouped key/value heads without repeating them."""
    d = query.shape[-1]
    if query.device.type != "cuda" or d % 8 or d > 256:
        return False
    gqa = query.shape[1] != key.shape[1]
    return bool(can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, gqa)))


def describe_tree_mask(mask: torch.Tensor, past: int, tree_visible: torch.Tensor) -> torch.Tensor:
    """Record that ``mask`` (``[1, 1, n, past + n]``) shows every query all of the rows ``[0, past)`` and the
    new rows by ``tree_visible`` (bool ``[n, n]``), so that ``attend`` can split it without reading it (no
    device sync). Returns ``mask``. Only recorded where the CUDA paths apply; kept for the newest mask of
    the thread, which every layer of one forward shares."""
    if cuda_path(mask.device):
        _described.entry = (weakref.ref(mask), past, tree_visible)
    return mask


def _description(mask: torch.Tensor, n: int, length: int) -> TreeDescription | None:
    entry = getattr(_described, "entry", None)
    if entry is None or entry[0]() is not mask:
        return None
    past, visible = entry[1], entry[2]
    if past + n != length or tuple(visible.shape) != (n, n) or mask.shape[-2] != n:
        return None
    return past, visible


def grouped_mask(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The model's mask function: None on the CUDA paths when the mask would be plain causal with no
    padding (``attend`` then applies lower-right causal without a mask), else transformers' ``sdpa_mask``.

    With a cache (ours, or transformers' dynamic one) the queries are the last ``cache_position.shape[0]``
    of the ``kv_length`` keys; compileable caches, whose length is their capacity, disallow the skip.
    """
    plain = (
        cuda_path(cache_position.device)
        and allow_is_causal_skip
        and attention_mask is None
        and mask_function is causal_mask_function
        and local_size is None
        and kv_offset == 0
        and cache_position.shape[0] <= kv_length
    )
    if plain:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        cache_position=cache_position,
        kv_length=kv_length,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


def prefix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention of ``query`` ``[b, H, n, d]`` over all of ``key`` / ``value`` ``[b, kv_heads, L, d]``
    (grouped as they are): the output ``[b, H, n, d]`` and each row's log-sum-exp ``[b, H, n]`` (float32)."""
    ops = torch.ops.aten
    if query.device.type == "cuda":
        out, lse = ops._scaled_dot_product_flash_attention(query, key, value, 0.0, False, False, scale=scale)[:2]
    else:
        out, lse = ops._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False, scale=scale)
    return out, lse


def tree_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of the ``n`` new rows over ``[0, past)`` (all visible) and the new rows by ``visible``
    (bool ``[n, n]``): flash over the prefix, math over the block, merged by log-sum-exp. ``[b, H, n, d]``."""
    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(b, kv_heads, groups * n, d).float()  # row g * n + i: query head kv * groups + g, row i
    block_k = key[:, :, past:].float()
    block_v = value[:, :, past:].float()
    scores = torch.matmul(q, block_k.transpose(-1, -2)).mul_(scale)  # [b, kv_heads, groups * n, n]
    scores.masked_fill_(~visible.repeat(groups, 1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # finite: every row sees itself
    out = torch.matmul(torch.exp(scores - lse), block_v).view(b, heads, n, d)
    if past:
        pout, plse = prefix_attention(query, key[:, :, :past], value[:, :, :past], scale)
        lse = lse.view(b, heads, n, 1)
        plse = plse[..., :n].reshape(b, heads, n, 1).float()  # some kernels pad the rows of their log-sum-exp
        total = torch.logaddexp(lse, plse)
        out = out * torch.exp(lse - total) + pout.float() * torch.exp(plse - total)
    return out.to(query.dtype)


def fold(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout: float,
    scale: float,
) -> torch.Tensor:
    """One SDPA call with equal head counts: each key/value head's query heads stacked as rows, the mask's
    rows repeated once per query head of the group. ``mask``: ``[n, L]`` or ``[b, 1 or H, n, L]``, bool or
    additive, or None (all visible). ``[b, H, n, d]``."""
    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(b, kv_heads, groups * n, d)
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.view(1, 1, *mask.shape)
        if mask.shape[1] == 1 and groups > 1:
            mask = mask.repeat(1, 1, groups, 1)  # row g * n + i is row i
        elif mask.shape[1] == heads:
            mask = mask.reshape(mask.shape[0], kv_heads, groups * n, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.reshape(b, heads, n, d)  # CUDA's kernels return a transposed layout: no view merges its heads


def _unmasked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, dropout: float, scale: float,
    flash: bool,
) -> torch.Tensor:
    """No mask: causal aligned to the last key (the queries are the last ``n`` keys), or all visible."""
    n, length = query.shape[2], key.shape[2]
    if flash:
        gqa = query.shape[1] != key.shape[1]
        if causal and n < length:
            bias = causal_lower_right(n, length)  # flash applies it without materialising a mask
            return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    if not causal:
        return fold(query, key, value, None, dropout, scale)
    # The mask is materialised here (and made additive per query head by the kernel): blocks of query rows keep
    # it under FOLD_MASK_BYTES, each over the keys its last row sees.
    groups = query.shape[1] // key.shape[1]
    rows = max(1, FOLD_MASK_BYTES // (4 * groups * length))
    outs = []
    for i in range(0, n, rows):
        j = min(n, i + rows)
        end = length - n + j  # the keys row j - 1 sees
        visible = torch.ones(j - i, end, dtype=torch.bool, device=query.device).tril(end - (j - i))
        outs.append(fold(query[:, :, i:j], key[:, :, :end], value[:, :, :end], visible, dropout, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, n, d]
    key: torch.Tensor,  # [b, kv_heads, L, d]
    value: torch.Tensor,  # [b, kv_heads, L, d]
    attention_mask: torch.Tensor | None,  # [b, 1, n, >= L] additive or bool, or None (see ``grouped_mask``)
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
) -> torch.Tensor:
    """The attention output ``[b, n, heads, d]`` on the path the module docstring lists."""
    n, d = query.shape[2], query.shape[3]
    length = key.shape[2]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    flash = flash_ok(query, key, value)
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and n > 1
        out = _unmasked(query, key, value, causal, dropout, scale, flash)
    else:
        tree = _description(attention_mask, n, length)
        if tree is not None and flash and not dropout:
            out = tree_attention(query, key, value, tree[0], tree[1], scale)
        else:
            mask = attention_mask[..., :length] if attention_mask.ndim == 4 else attention_mask
            out = fold(query, key, value, mask, dropout, scale)
    return out.transpose(1, 2).contiguous()
