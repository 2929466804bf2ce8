"""A family's description (``Family``): the one thing every family module imports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig


@dataclass(frozen=True)
class Family:
    """One GGUF architecture: its config from the metadata and the layout of its tensors."""

    gguf_arch: str  # general.architecture
    model_type: str  # the transformers model_type its config gets
    config: Callable[[Any, dict[str, Any]], PretrainedConfig]  # (GGUF reader, common keywords) -> config
    permuted_qk: bool = False  # q / k rows permuted by llama.cpp's converter (its interleaved rope): put back
    qkv_bias: bool = False  # attn_q / attn_k / attn_v .bias
    qk_norm: bool = False  # attn_q_norm / attn_k_norm [D]
    qk_norm_all: bool = False  # ... across all heads at once instead: [H*D], [G*D] (OLMoE)
    post_norms: bool = False  # post_attention_norm, post_ffw_norm [E]
    fused: bool = False  # attn_qkv (q, k, v rows) and ffn_up (gate rows, then up rows): Phi-3
    norm_offset: float = 0.0  # transformers' RMSNorm multiplies by w + offset (Gemma: 1; a GGUF stores w + 1)
    # the config whose rope the layers of ``ForwardPlan.local_rope`` rotate with (Gemma 3's sliding layers); None: one
    local_rope: Callable[[PretrainedConfig], PretrainedConfig] | None = None
    biases: bool = False  # attn_output, ffn_gate_inp and the experts' ffn_{gate,up,down}_exps .bias (gpt-oss)
    sinks: bool = False  # attn_sinks [H]: a logit per query head in every row's softmax, with no value (gpt-oss)
    ffn_norm_tensor: str = "ffn_norm"  # the pre-MLP norm's tensor (gpt-oss: post_attention_norm)
    topk_softmax: bool = False  # the chosen experts weighted by a softmax over their logits alone (gpt-oss)
    clamped_swiglu: bool = False  # gpt-oss's experts: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, +-7) + 1)
