"""Qwen 2 / 2.5 (q / k / v biases), Qwen 3 (per-head q / k RMSNorm before the rope, no biases, its own head size) and
Qwen3-MoE (Qwen 3's attention, a mixture of experts in place of every MLP: a router over ``expert_count`` experts,
the ``expert_used_count`` most likely a token, their softmax weights renormalized, as llama.cpp runs it). All rotate
halves of a head (NEOX), so llama.cpp stores q / k rows as transformers does."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import required


def _qwen2(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen2Config(**common, use_sliding_window=False)


def _qwen3(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    return Qwen3Config(**common, use_sliding_window=False, attention_bias=False)


def _qwen3moe(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    a = "qwen3moe."
    return Qwen3MoeConfig(**common, use_sliding_window=False, attention_bias=False,
                          num_experts=int(required(reader, a + "expert_count")),
                          num_experts_per_tok=int(required(reader, a + "expert_used_count")),
                          moe_intermediate_size=int(required(reader, a + "expert_feed_forward_length")),
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


FAMILIES = (
    Family("qwen2", "qwen2", _qwen2, qkv_bias=True),
    Family("qwen3", "qwen3", _qwen3, qk_norm=True),
    Family("qwen3moe", "qwen3_moe", _qwen3moe, qk_norm=True),
)
