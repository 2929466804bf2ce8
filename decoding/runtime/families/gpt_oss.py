"""gpt-oss (OpenAI's open-weight mixture of experts, GGUF architecture ``gpt-oss``): every layer a mixture of
``expert_count`` experts (``expert_used_count`` a token) whose router picks the largest logits and weights them by a
softmax over those alone; the experts' SwiGLU clamped (gate at 7, up to [-7, 7], ``sigmoid(1.702 g)``, up + 1);
biases on q / k / v, the output projection, the router and every expert; one learned attention sink per query head
(a logit in the softmax with no value); sliding-window attention on alternate layers from the first; YaRN rope (NEOX
halves). llama.cpp's converter stores the pre-MLP norm as ``post_attention_norm`` and the router in F32.

The YaRN rope is transformers' (and OpenAI's reference implementation's): its correction range is not rounded to
whole dimensions (``truncate`` false); llama.cpp rounds it outward (``ggml_rope_yarn_corr_dims``), which moves a few
of the middle frequencies slightly.
"""

from __future__ import annotations

from typing import Any

from transformers import GptOssConfig, PretrainedConfig

from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import field, required


def _layer_types(reader: Any, layers: int) -> list[str]:
    """Sliding layers from ``attention.sliding_window_pattern`` (per layer, or one period; llama.cpp's default for
    gpt-oss: 2, so every even layer slides)."""
    pattern = field(reader, "gpt-oss.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    period = int(pattern)
    return ["full_attention" if period and (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def _gpt_oss(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    a = "gpt-oss."
    rope = common.pop("rope_scaling", None)
    if rope is not None and rope.get("rope_type") == "yarn":
        rope = {**rope, "truncate": False}
    return GptOssConfig(
        **{**common, "intermediate_size": int(required(reader, a + "expert_feed_forward_length"))},
        num_local_experts=int(required(reader, a + "expert_count")),
        num_experts_per_tok=int(required(reader, a + "expert_used_count")),
        sliding_window=int(required(reader, a + "attention.sliding_window")),
        layer_types=_layer_types(reader, common["num_hidden_layers"]),
        rope_scaling=rope,
        attention_bias=True,
    )


FAMILIES = (
    Family("gpt-oss", "gpt_oss", _gpt_oss, qkv_bias=True, biases=True, sinks=True,
           ffn_norm_tensor="post_attention_norm", topk_softmax=True, clamped_swiglu=True),
)
