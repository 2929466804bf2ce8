"""Gemma 2 and Gemma 3 (text): embeddings times sqrt(hidden), RMSNorms before and after the attention and the MLP
(transformers multiplies by 1 + w; llama.cpp's converter stores w + 1, used as stored), a GELU (tanh) gated MLP,
tied embeddings, rotate-half rope, sliding-window layers (Gemma 2: every other one from the first; Gemma 3: five
of six, the sixth global). Gemma 2 soft-caps scores (``attn_logit_softcapping``) and logits; Gemma 3 normalizes q
and k per head and rotates its local layers with base 10000, its global ones with the file's base and scaling.
Queries are scaled by 1 / sqrt(head size), or 1 / sqrt(hidden / heads) for the 27B models, as llama.cpp does (the
GGUF holds no query_pre_attn_scalar; llama.cpp tells the 27B models by their layer count)."""

from __future__ import annotations

import copy
from typing import Any

from transformers import Gemma2Config, Gemma3TextConfig, PretrainedConfig

from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import field

_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_BASE = 10000.0  # Gemma 3's sliding layers' rope base where the GGUF has no rope.freq_base_swa


def _shared(reader: Any, arch: str, common: dict[str, Any]) -> dict[str, Any]:
    hidden, heads, layers = common["hidden_size"], common["num_attention_heads"], common["num_hidden_layers"]
    scalar = hidden // heads if layers == _LAYERS_27B[arch] else common["head_dim"]
    window = field(reader, f"{arch}.attention.sliding_window")
    return dict(common, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                sliding_window=int(window) if window else None)


def _gemma2(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    return Gemma2Config(
        **_shared(reader, "gemma2", common),
        attn_logit_softcapping=field(reader, "gemma2.attn_logit_softcapping"),
        final_logit_softcapping=field(reader, "gemma2.final_logit_softcapping"),
    )


def _gemma3(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    shared = _shared(reader, "gemma3", common)
    pattern = field(reader, "gemma3.attention.sliding_window_pattern")
    if pattern is not None and not isinstance(pattern, list):
        types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                 for i in range(shared["num_hidden_layers"])]
        shared["layer_types"] = types
    elif isinstance(pattern, list):  # per layer: true where sliding
        shared["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    local = float(field(reader, "gemma3.rope.freq_base_swa", GEMMA3_LOCAL_BASE))
    return Gemma3TextConfig(**shared, rope_local_base_freq=local, attn_logit_softcapping=None,
                            final_logit_softcapping=None)


def _local_rope(config: PretrainedConfig) -> PretrainedConfig:
    """Gemma 3's sliding layers' rope: base ``rope_local_base_freq``, no scaling (transformers' rotary_emb_local)."""
    local = copy.deepcopy(config)
    local.rope_theta = float(config.rope_local_base_freq)
    local.rope_scaling = None
    if hasattr(local, "rope_freqs"):
        del local.rope_freqs
    return local


FAMILIES = (
    Family("gemma2", "gemma2", _gemma2, post_norms=True, norm_offset=1.0),
    Family("gemma3", "gemma3_text", _gemma3, post_norms=True, qk_norm=True, norm_offset=1.0, local_rope=_local_rope),
)
