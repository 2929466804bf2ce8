"""Tiny random-weight Llama targets for fast, exact decoding tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decoding import kernels
from decoding.attention import use_grouped_sdpa
from decoding.cpu_llama import CpuLlama, weights_from_hf
from decoding.kernels import use_cpu_kernels
from decoding.quant import WeightType

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


def quantized_tiny_llama(
    seed: int = 0, kind: WeightType = WeightType.Q4_1, kv_dtype: torch.dtype = torch.float16, **kw: Any
) -> CpuLlama:
    """The same random Llama on the quantized CPU runtime (linear layers ``kind``, embedding / head Q8_0)."""
    return CpuLlama(weights_from_hf(make_tiny_llama(seed, cpu_kernels=False, **kw), kind), kv_dtype)


def tiny_target(
    seed: int = 0, eos: tuple[int, ...] = (), max_context: int = 512, quantized: bool = False, **kw: Any
) -> TinyTarget:
    return TinyTarget(
        model=quantized_tiny_llama(seed, **kw) if quantized else make_tiny_llama(seed, **kw),
        tokenizer=TinyTokenizer(),
        name=f"tiny-llama-{seed}",
        device=torch.device("cpu"),
        eos_token_ids=eos,
        max_context=max_context,
    )


needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="CPU kernels unavailable on this machine")


@pytest.fixture(scope="module", params=["quantized", "cpu_kernels", "torch_kernels"])
def tiny(request: pytest.FixtureRequest) -> TinyTarget:
    """The tiny target on the quantized CPU runtime, on decoding.kernels (fp32) and on torch's kernels:
    everything must hold on all three."""
    torch.set_num_threads(1)
    if request.param == "quantized":
        if kernels.load() is None:
            pytest.skip("CPU kernels unavailable: no quantized runtime")
        return tiny_target(0, quantized=True)
    return tiny_target(0, cpu_kernels=request.param == "cpu_kernels")
