"""Llama (2, 3.x) and Mistral: llama.cpp writes both as ``llama``, q / k rows permuted for its interleaved rope.
Llama 3.1's rope scaling comes as ``rope_freqs.weight`` (``gguf.meta.gguf_rope``); the 1B / 3B models tie the
output to the embedding (no ``output.weight``). Mistral's sliding window is not in its GGUF (llama.cpp does not
apply it either); from an HF dir transformers' ``sliding_window`` holds (``layer_windows``)."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

from decoding.runtime.families.base import Family


def _config(reader: Any, common: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(**common)


FAMILIES = (Family("llama", "llama", _config, permuted_qk=True),)
