"""Tiny random-weight Llama targets for fast, exact decoding tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.attention import use_grouped_sdpa
from decoding.kernels import use_cpu_kernels

VOCAB = 97


@dataclass
class TinyTokenizer:
    """Maps token id i to a short string; enough for detokenization in engine tests."""

    vocab: int = VOCAB

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class TinyTarget:
    model: Any
    tokenizer: Any
    name: str
    device: torch.device
    eos_token_ids: tuple[int, ...]
    max_context: int


def make_tiny_llama(
    seed: int = 0, vocab: int = VOCAB, layers: int = 2, peaked: float = 1.0, cpu_kernels: bool = True
) -> LlamaForCausalLM:
    """A random-weight Llama; ``cpu_kernels`` switches it to decoding.kernels (when this machine has them)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    use_grouped_sdpa(model)
    if cpu_kernels:
        use_cpu_kernels(model)
    if peaked != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(peaked)
    return model


def tiny_target(seed: int = 0, eos: tuple[int, ...] = (), max_context: int = 512, **kw: Any) -> TinyTarget:
    return TinyTarget(
        model=make_tiny_llama(seed, **kw),
        tokenizer=TinyTokenizer(),
        name=f"tiny-llama-{seed}",
        device=torch.device("cpu"),
        eos_token_ids=eos,
        max_context=max_context,
    )


@pytest.fixture(scope="module", params=["cpu_kernels", "torch_kernels"])
def tiny(request: pytest.FixtureRequest) -> TinyTarget:
    """The tiny target, once on decoding.kernels and once on torch's kernels (everything must hold on both)."""
    torch.set_num_threads(1)
    return tiny_target(0, cpu_kernels=request.param == "cpu_kernels")
