"""OLMoE (AllenAI's mixture of experts, GGUF architecture ``olmoe``): a Llama-like decoder whose queries and keys
are RMS-normalized across all their heads at once (``attn_q_norm`` [heads x head size], ``attn_k_norm`` [key heads x
head size]) before the rope, and whose MLPs are mixtures of experts routed as Qwen3-MoE's (a softmax, each token's
top-k; their weights not renormalized, as OLMoE's config and llama.cpp have it). Halves of a head rotate (NEOX), so
llama.cpp stores q / k rows as transformers does."""

from __future__ import annotations

from typing import Any

from transformers import OlmoeConfig, PretrainedConfig

from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import required


def _olmoe(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    a = "olmoe."
    return OlmoeConfig(**common, num_experts=int(required(reader, a + "expert_count")),
                       num_experts_per_tok=int(required(reader, a + "expert_used_count")), norm_topk_prob=False,
                       clip_qkv=None)


FAMILIES = (Family("olmoe", "olmoe", _olmoe, qk_norm=True, qk_norm_all=True),)
