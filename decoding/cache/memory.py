"""Sizing the prefix cache's memory tiers from what the machine has (plain numbers in, bytes out).

The app measures (free device memory once the models are loaded, available RAM) and decides; these
functions only do the arithmetic, so it can be checked without the hardware it is meant for.
"""

from __future__ import annotations

from typing import Any

import torch

DEVICE_FRACTION = 0.9  # of the device memory left once the working set is set aside
DEVICE_MARGIN_BYTES = 2 << 30  # activations, logits of a prefill chunk, allocator fragmentation


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in every layer of a model with this (transformers-style)
    ``config``, stored as ``dtype``: layers x KV heads x head size x 2 (keys and values) x element size."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return layers * kv_heads * head_dim * 2 * dtype.itemsize


def device_kv_budget(
    free_bytes: int,
    kv_per_token: int,
    working_tokens: int,
    margin_bytes: int = DEVICE_MARGIN_BYTES,
    fraction: float = DEVICE_FRACTION,
) -> int:
    """Bytes the prefix cache may keep on a device with ``free_bytes`` free after the models are loaded.

    Set aside first: the working KV cache of one generation at ``working_tokens`` (the full window: a
    generation copies its cached prefix into a cache of its own, and the calibration runs at the window
    too) and ``margin_bytes`` for activations; the cache gets ``fraction`` of the rest, 0 if nothing is
    left (then entries go straight to the lower tiers).
    """
    spare = free_bytes - kv_per_token * working_tokens - margin_bytes
    return max(0, int(spare * fraction))


def largest_window(free_bytes: int, kv_per_token: int, margin_bytes: int = DEVICE_MARGIN_BYTES,
                   granule: int = 1024) -> int:
    """The longest window (tokens, a multiple of ``granule``) whose one generation's KV, ``kv_per_token``
    bytes a token, fits in ``free_bytes`` with ``margin_bytes`` to spare: what to tell a user whose window
    does not fit the device (0 if not even ``granule`` tokens do)."""
    tokens = max(0, free_bytes - margin_bytes) // kv_per_token
    return tokens // granule * granule


def host_kv_budget(available_bytes: int, kv_per_token: int, window_tokens: int, fraction: float) -> int:
    """Bytes of the host tier from ``available_bytes`` of RAM: ``fraction`` of what is left once one entry of
    the full window (``kv_per_token`` x ``window_tokens``) is set aside for the disk writer's host copy of
    it; 0 if nothing is left."""
    spare = available_bytes - kv_per_token * window_tokens
    return max(0, int(spare * fraction))
