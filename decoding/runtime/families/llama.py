"""Llama (2, 3.x), Mistral and Mixtral: llama.cpp writes them as ``llama``, q / k rows permuted for its interleaved
rope. Llama 3.1's rope scaling comes as ``rope_freqs.weight`` (``gguf.meta.gguf_rope``); the 1B / 3B models tie the
output to the embedding (no ``output.weight``). Mistral's sliding window is not in its GGUF (llama.cpp does not
apply it either); from an HF dir transformers' ``sliding_window`` holds (``layer_windows``). Mixtral is a Llama whose
MLPs are mixtures of experts (``llama.expert_count``: its router's softmax, each token's top-k renormalized, the
experts stacked as Qwen3-MoE's are)."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, MixtralConfig, PretrainedConfig

from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import field, required


def _config(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    experts = field(reader, "llama.expert_count")
    if not experts:
        return LlamaConfig(**common)
    return MixtralConfig(**common, num_local_experts=int(experts), sliding_window=None,
                         num_experts_per_tok=int(required(reader, "llama.expert_used_count")))


FAMILIES = (Family("llama", "llama", _config, permuted_qk=True),)
