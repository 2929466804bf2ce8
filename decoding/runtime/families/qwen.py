"""Qwen 2 / 2.5 (q / k / v biases) and Qwen 3 (per-head q / k RMSNorm before the rope, no biases, its own head
size). Both rotate halves of a head (NEOX), so llama.cpp stores q / k rows as transformers does."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen2Config, Qwen3Config

from decoding.runtime.families.base import Family


def _qwen2(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen2Config(**common, use_sliding_window=False)


def _qwen3(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen3Config(**common, use_sliding_window=False, attention_bias=False)


FAMILIES = (
    Family("qwen2", "qwen2", _qwen2, qkv_bias=True),
    Family("qwen3", "qwen3", _qwen3, qk_norm=True),
)
