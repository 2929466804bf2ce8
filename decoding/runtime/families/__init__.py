"""The architectures the quantized CPU runtime runs, one module per family (``llama``, ``qwen``, ``gemma``, ``phi3``,
``gpt_oss``, ``olmoe``): how a family's GGUF metadata becomes a transformers config, which tensors its layers hold
and how the file stores them (``Family``), and what its forward does beyond a Llama's (``ForwardPlan``, read from a
config, so a model loaded from an HF dir runs the same forward as its GGUF).

Every family is a pre-norm decoder with RMSNorm, grouped-query attention with rotary embeddings and a gated MLP;
what differs is a table of options: q / k / v biases (Qwen2), per-head q / k RMSNorm (Qwen3, Gemma 3), norms after
the attention and the MLP (Gemma), GELU for SiLU (Gemma), soft-capped scores and logits (Gemma 2), sliding-window
layers (Gemma 2 / 3, Phi-3, Mistral from an HF dir), a second rope base on the local layers (Gemma 3), scaled
embeddings (Gemma), fused tensors (Phi-3), q / k rows permuted by llama.cpp's converter (Llama, Mistral), and a
mixture of experts for the MLP (Qwen3-MoE, Mixtral, OLMoE with q / k norms across all heads; gpt-oss with its
biases, attention sinks and clamped SwiGLU).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PretrainedConfig

from decoding.errors import ModelFileError
from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import field, gguf_rope, required


@dataclass(frozen=True)
class ForwardPlan:
    """What a forward does beyond a Llama's, per model (from its config)."""

    activation: int  # the gated MLP's: 0 SiLU, 1 GELU (tanh form), 2 gpt-oss's clamped SwiGLU
    query_scale: float  # scores = q . k * query_scale
    attn_softcap: float  # scores soft-capped: cap * tanh(s / cap) (0: none)
    final_softcap: float  # logits likewise (0: none)
    embed_scale: float  # embeddings times this (1: none)
    windows: tuple[int, ...]  # per layer: keys a query sees (0: all)
    local_rope: tuple[bool, ...]  # per layer: the local rope base (Gemma 3's sliding layers)
    experts: tuple[int, int, int] = (0, 0, 0)  # a mixture of experts: (experts, chosen a row, an expert's MLP size)
    norm_topk: bool = False  # the chosen experts' softmax weights renormalized to sum 1
    topk_softmax: bool = False  # the chosen experts' weights a softmax over their logits alone (gpt-oss)
    sinks: bool = False  # an attention sink logit per query head (gpt-oss)
    qk_norm_all: bool = False  # q / k RMSNorm across all heads at once (OLMoE), not per head


def common_config(reader: Any, arch: str) -> dict[str, Any]:
    """The transformers config keywords every family reads the same way from ``<arch>.*`` metadata."""
    a = f"{arch}."
    heads = int(required(reader, a + "attention.head_count"))
    hidden = int(required(reader, a + "embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    head_dim = int(field(reader, a + "attention.key_length", hidden // heads))
    context = int(required(reader, a + "context_length"))
    return dict(
        vocab_size=int(field(reader, a + "vocab_size", len(tokens.data) if tokens is not None else 0)),
        hidden_size=hidden,
        intermediate_size=int(required(reader, a + "feed_forward_length")),
        num_hidden_layers=int(required(reader, a + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(reader, a + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, a + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id"),
        **gguf_rope(reader, arch, head_dim, context),
    )


def _families() -> dict[str, Family]:
    """Every module of this package but ``base`` declares its ``FAMILIES`` (each imports base, not this module): a
    new family is a new module, no list to edit."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name != "base":
            for family in importlib.import_module(f"{__name__}.{info.name}").FAMILIES:
                found[family.gguf_arch] = family
    return found


FAMILIES: dict[str, Family] = {}  # by GGUF architecture (filled below, once the modules can import this one)
GGUF_ARCHITECTURES: tuple[str, ...] = ()


def gguf_family(reader: Any) -> Family:
    """The family of a GGUF file; another architecture raises ``ModelFileError`` naming it and the ones read."""
    arch = field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise ModelFileError(f"GGUF architecture {arch!r} is not supported by the quantized CPU runtime (supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)})")
    return FAMILIES[arch]


def family_of(config: PretrainedConfig) -> Family:
    """The family running a transformers config (Mistral's runs as Llama's), or ``ModelFileError``."""
    kind = getattr(config, "model_type", "")
    kind = "llama" if kind in ("mistral", "mixtral") else kind
    for family in FAMILIES.values():
        if family.model_type == kind:
            return family
    raise ModelFileError(f"the quantized CPU runtime runs {', '.join(sorted(MODEL_TYPES))} models, not {kind!r}")


def _activation(config: PretrainedConfig) -> int:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act == "silu":
        return 0
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return 1
    raise ModelFileError(f"the quantized CPU runtime's MLP runs SiLU or GELU (tanh), not {act!r}")


def layer_windows(config: PretrainedConfig) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers applies the config's."""
    n = int(config.num_hidden_layers)
    window = int(getattr(config, "sliding_window", None) or 0)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (0,) * n
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral, Phi-3: every layer
        return (window,) * n
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def forward_plan(config: PretrainedConfig) -> ForwardPlan:
    family = family_of(config)
    e, h, d = int(config.hidden_size), int(config.num_attention_heads), int(getattr(config, "head_dim", None) or 0)
    d = d or e // h
    scalar = getattr(config, "query_pre_attn_scalar", None)
    windows = layer_windows(config)
    local = family.local_rope is not None
    return ForwardPlan(
        activation=2 if family.clamped_swiglu else _activation(config),
        query_scale=1.0 / math.sqrt(float(scalar) if scalar else d),
        attn_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        embed_scale=float(np.float32(e**0.5)) if family.norm_offset else 1.0,
        windows=windows,
        local_rope=tuple(local and w > 0 for w in windows),
        experts=_experts(config) if has_experts(config) else (0, 0, 0),
        norm_topk=bool(getattr(config, "norm_topk_prob", True)),  # Mixtral's config has no switch: it renormalizes
        topk_softmax=family.topk_softmax,
        sinks=family.sinks,
        qk_norm_all=family.qk_norm_all,
    )


def has_experts(config: PretrainedConfig) -> bool:
    """Whether a config's MLPs are mixtures of experts (Qwen3-MoE's ``num_experts``, Mixtral's and gpt-oss's
    ``num_local_experts``)."""
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def _experts(config: PretrainedConfig) -> tuple[int, int, int]:
    """A mixture-of-experts config's (experts, experts a token, an expert's MLP size), or ``ModelFileError`` for one
    the runtime cannot run: dense layers among the sparse ones, an expert's MLP not a whole number of row groups."""
    n = int(getattr(config, "num_experts", None) or config.num_local_experts)  # gpt-oss: num_local_experts
    k = int(config.num_experts_per_tok)
    size = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)  # gpt-oss: the latter
    if getattr(config, "mlp_only_layers", None) or int(getattr(config, "decoder_sparse_step", 1)) != 1:
        raise ModelFileError("the quantized CPU runtime runs a mixture of experts on every layer (no mlp_only_layers, "
                             "decoder_sparse_step 1)")
    if size % 32 or not 0 < k <= n:
        raise ModelFileError(f"an expert MLP of {size} rows (a multiple of 32 is needed) with {k} of {n} experts a "
                             "token is not supported")
    return n, k, size


FAMILIES.update(_families())
GGUF_ARCHITECTURES = tuple(FAMILIES)
MODEL_TYPES = {f.model_type for f in FAMILIES.values()} | {"mistral", "mixtral"}
