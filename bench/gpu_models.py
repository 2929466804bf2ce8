"""Random-weight long-context model shapes for the GPU check, built directly on the device, and the random KV
rows that stand in for a prefill (``bench.gpu_check``, ``bench.gpu_correctness``).

Nothing is downloaded: a shape is a ``LlamaConfig``; the weights' values do not change what a step costs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.cache.slot import SlotCache
from decoding.cache.slot import fill_random as fill_random_rows
from decoding.runtime.attention import use_grouped_sdpa
from decoding.runtime.interface import TargetRuntime
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.speculative.tree import ROOT, DraftTree

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=1024)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, rope_scaling=LLAMA3_ROPE),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_scaling={**LLAMA3_ROPE, "factor": 32.0}),
    "smoke": dict(_SMALL, num_hidden_layers=2),
    "smoke-1layer": dict(_SMALL, num_hidden_layers=1),
    # the correctness section's model: small enough for many generations, on any device
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
}  # fmt: skip



class IdTokenizer:
    """Token ids as text: what the engine's detokenizer needs of a tokenizer (no vocabulary file)."""

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass(frozen=True)
class RandomTarget:
    """A random-weight model as the engine's ``TargetModel``."""

    model: TargetRuntime
    tokenizer: Any
    name: str
    device: torch.device
    eos_token_ids: tuple[int, ...]
    max_context: int


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A random Llama of ``SHAPES[shape]`` made on ``device`` in ``dtype`` (parameters never exist elsewhere),
    switched to the engine's attention like ``decoding.runtime.loader`` does."""
    config = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    use_grouped_sdpa(model)
    return model


def target_of(model: Any, device: torch.device, name: str) -> RandomTarget:
    """A transformers model on the torch runtime as the engine's target, its whole window."""
    runtime = TorchRuntime(model)
    return RandomTarget(runtime, IdTokenizer(), name, device, (), runtime.max_positions)


def fill_random(cache: SlotCache, model: TargetRuntime, rows: int) -> None:
    """Make ``rows`` random key/value rows live in every layer of ``cache`` (on the model's device and dtype):
    ``decoding.cache.slot.fill_random``, which the GPU calibration uses too."""
    fill_random_rows(cache, model.config, rows, model.dtype, model.device)


def branchy_tree(branches: int, depth: int, vocab: int, rng: random.Random) -> DraftTree:
    tree = DraftTree()
    for _ in range(branches):
        parent = ROOT
        for _ in range(depth):
            parent = tree.add(parent, rng.randrange(vocab), "gpu_check")
    return tree
