"""Rotary embeddings: the quantized runtime's tables (``rotary_tables``, from a config as transformers computes
them), and the checks of a rope scaling (``load_model(rope_scaling=...)``, the app's ``RAGSPEC_ROPE_SCALING``) that
need no model: the app runs them when it reads its settings, so a bad value stops the start at once rather than
after the models have loaded; ``decoding.runtime.loader.apply_rope_scaling`` runs the same ones before writing the
scaling into a config (and transformers' own validation after)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from decoding.errors import ModelLoadError

# Rope scalings with frequencies fixed at load: transformers and the quantized runtime (rotary_tables) run them
# alike
ROPE_TYPES = ("linear", "yarn", "llama3")


def check_rope_scaling(rope_scaling: Any) -> tuple[str, float]:
    """(type, factor) of ``rope_scaling``, or ``ModelLoadError`` if no model could take it: not a dict, a type
    (``rope_type``, else the older ``type`` key) not in ``ROPE_TYPES``, a factor that is no number >= 1, or an
    ``original_max_position_embeddings`` given that is no positive integer (absent: the model's window)."""
    if not isinstance(rope_scaling, dict):
        raise ModelLoadError(f"rope_scaling must be a JSON object, not {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"rope_scaling type {rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
    factor = rope_scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise ModelLoadError(f"rope_scaling needs a numeric factor >= 1, not {factor!r}")
    if rope_scaling.get("original_max_position_embeddings"):  # 0 / null: the model's own window, as absent
        check_original_positions(rope_scaling["original_max_position_embeddings"])
    return str(rope_type), float(factor)


def check_original_positions(original: Any) -> int:
    """``original`` (the positions a scaling stretches) if it is a positive integer, else ``ModelLoadError``."""
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ModelLoadError(f"rope_scaling's original_max_position_embeddings must be a positive integer, "
                             f"not {original!r}")
    return original


def rotary_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[D/2]`` and attention scaling of a config's rotary embedding, as transformers
    computes them; a GGUF's ``config.rope_freqs`` (Llama-3.1's per-dimension divisors, see
    ``decoding.runtime.gguf.meta.gguf_rope``) divides the default ones, as llama.cpp does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    divisors = getattr(config, "rope_freqs", None)
    if rope_type == "default":
        d = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        base = float(getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
        scaling = 1.0
        if divisors is not None:
            if len(divisors) != inv_freq.numel():
                raise ModelLoadError(f"rope_freqs has {len(divisors)} values for {inv_freq.numel()} frequencies")
            inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32)
    elif divisors is not None:  # both would scale the frequencies twice: refused, never one silently dropped
        raise ModelLoadError(f"a config with rope_freqs and a {rope_type!r} rope scaling: at most one applies")
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rotary_tables(config: PretrainedConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[positions, D/2]`` as transformers computes them (fp32, attention scaling applied)."""
    inv_freq, scaling = rotary_frequencies(config)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
    return (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()
