"""Phi-3 (mini / medium): q, k and v rows in one ``attn_qkv`` tensor, gate and up rows in one ``ffn_up``, rotate-half
rope, a sliding window on every layer when the file names one. LongRoPE (the 128K models' ``rope_factors_long`` /
``_short``: factors chosen by the sequence's length) is refused: the runtime's rotary tables are fixed at load."""

from __future__ import annotations

from typing import Any

from transformers import Phi3Config, PretrainedConfig

from decoding.errors import ModelFileError
from decoding.runtime.families.base import Family
from decoding.runtime.gguf.meta import field


def _phi3(reader: Any, common: dict[str, Any]) -> PretrainedConfig:
    names = {t.name for t in reader.tensors}
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise ModelFileError("Phi-3 with LongRoPE factors (the 128K models): the quantized CPU runtime's rotary "
                             "tables are fixed at load; use a 4K-window Phi-3")
    window = field(reader, "phi3.attention.sliding_window")
    dims = field(reader, "phi3.rope.dimension_count")
    if dims is not None and int(dims) != common["head_dim"]:
        raise ModelFileError(f"Phi-3 rotating {dims} of {common['head_dim']} head dims: partial rope is not supported")
    return Phi3Config(**common, sliding_window=int(window) if window else None)


FAMILIES = (Family("phi3", "phi3", _phi3, fused=True),)
