"""A mixture of experts on the quantized CPU runtime (Qwen3-MoE and gpt-oss, issue 54): the router (Qwen3-MoE: a
softmax, each token's top-k experts, their weights renormalized; gpt-oss: the top-k logits, a softmax over them, with
biases), the experts' MLPs read from their stacked tensors, each expert's weights read once for every row routed to
it. Checked on tiny random ``Qwen3MoeForCausalLM`` / ``GptOssForCausalLM`` models from transformers' own classes (and
the same models written to GGUF as llama.cpp's converter writes them, gpt-oss's experts MXFP4 as llama.cpp's
MXFP4_MOE mix stores them): logits against transformers on the same weights, every row of a forward what it is alone
(a batch, a draft tree), speculative decoding equal to plain greedy decoding on every ISA path this CPU has, every
path giving the avx2 path's bits."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from decoding.errors import ModelFileError
from decoding.runtime import kernels
from decoding.runtime.interface import BatchItem
from decoding.runtime.kernels import available_isas
from decoding.runtime.quant import WeightType
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.weights import check_supported, weights_from_gguf, weights_from_hf
from decoding.speculative.engine import Engine
from tests.decoding.conftest import (
    PROMPT,
    RandomTreeDrafter,
    TinyTarget,
    TinyTokenizer,
    fake_quantized_activations,
    load_dequantized,
    make_tiny_family,
    run,
)
from tests.decoding.gguf_families import write_family_gguf

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="CPU kernels unavailable on this machine")
HERE = [isa for isa in kernels.ISAS if isa in available_isas()]
EXPERTS, USED = 8, 2


def tiny_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    """A random Qwen3-MoE: 2 layers, 8 experts of 32, 2 a token; weights 4x transformers' init (a greedy path that
    wanders), the router's 8x (decided routes: a near-tie between two experts would flip on a last bit)."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=EXPERTS, num_experts_per_tok=USED, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
                            attn_implementation="sdpa")
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(8.0 if name.endswith("mlp.gate.weight") else 4.0)
    return model


def tiny_oss_gguf(path: Path, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    """A random gpt-oss (2 layers, 8 experts of 32, 2 a token, YaRN, sinks, every bias) and its GGUF as the converter
    and llama.cpp's MXFP4_MOE quantization leave it: the experts MXFP4, the attention and embeddings Q8_0, the
    router, norms, biases and sinks F32."""
    hf = make_tiny_family("gpt-oss", seed, layers=2)
    return hf, write_family_gguf(path, hf, experts=gguf.GGMLQuantizationType.MXFP4)


def _against_transformers(ours: QuantizedModel, hf: torch.nn.Module, runs: int = 8) -> torch.Tensor:
    """Per position: max |ours - transformers| / std of transformers' logits, every linear layer's input quantized as
    the kernels quantize it (but the router's: fp32, as stored)."""
    def quantized_input(name: str, m: torch.nn.Module) -> bool:  # gpt-oss's experts: one module, not Linear layers
        fp32 = name.endswith(("mlp.gate", "mlp.router"))
        experts = name.endswith("mlp.experts") and hasattr(m, "down_proj")
        return experts or (isinstance(m, torch.nn.Linear) and not fp32)

    hooks = [m.register_forward_pre_hook(lambda _m, args: (fake_quantized_activations(args[0]), *args[1:]))
             for name, m in hf.named_modules() if quantized_input(name, m)]
    g = torch.Generator().manual_seed(4)
    per = []
    try:
        with torch.inference_mode():
            for _ in range(runs):
                ids = torch.randint(0, 97, (1, 16), generator=g)
                want = hf(ids).logits[0]
                per.append((ours(ids).logits[0] - want).abs().amax(-1) / want.std())
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(per)


@pytest.mark.parametrize("kind", [WeightType.Q8_0, WeightType.Q4_1])
def test_the_experts_match_transformers_on_the_same_weights(kind: WeightType) -> None:
    hf = tiny_moe(1)
    weights = weights_from_hf(hf, kind)
    assert weights.layers[0].gate_up is None and weights.layers[0].experts_down.rows == EXPERTS * 64
    ours = QuantizedModel(weights, torch.float32)
    assert ours.experts == (EXPERTS, USED, 32)
    load_dequantized(hf, weights)
    per = _against_transformers(ours, hf)
    assert float(per.median()) < 1e-5  # fp32 summation order (a rare near-tie of two experts or an int8 step aside)
    assert float(per.max()) < 0.2


def test_a_gguf_as_llama_cpp_writes_it_serves_the_same_model(tmp_path: Path) -> None:
    hf = tiny_moe(2)
    path = write_family_gguf(tmp_path / "tiny-qwen3moe.gguf", hf)
    weights = weights_from_gguf(path)
    assert weights.config.model_type == "qwen3_moe" and weights.config.num_experts == EXPERTS
    assert weights.source == "gguf:F32+Q8_0"  # the router as the converter keeps it, the rest Q8_0
    ours = QuantizedModel(weights, torch.float32)
    load_dequantized(hf, weights)
    assert float(_against_transformers(ours, hf).median()) < 1e-5


def test_a_gpt_oss_gguf_with_mxfp4_experts_serves_the_model(tmp_path: Path) -> None:
    """The experts read as stored in MXFP4, the rest Q8_0: against transformers on the same (dequantized) weights,
    every layer's input quantized as the kernels quantize it but the experts' down projection's (inside transformers'
    expert loop, out of a hook's reach): the logits agree to that int8 rounding (measured: median 0.046 std, max
    0.15). Exactness itself is the F32 file's (test_families) and the MXFP4 kernel's (test_formats)."""
    hf, path = tiny_oss_gguf(tmp_path / "tiny-gpt-oss.gguf", seed=1)
    weights = weights_from_gguf(path)
    assert weights.config.model_type == "gpt_oss" and weights.source == "gguf:F32+MXFP4+Q8_0"
    assert weights.layers[0].experts_gate.kinds == {WeightType.MXFP4} and weights.layers[0].sinks is not None
    ours = QuantizedModel(weights, torch.float32)
    assert ours.experts == (EXPERTS, USED, 32) and ours.plan.topk_softmax and ours.plan.activation == 2
    load_dequantized(hf, weights)
    per = _against_transformers(ours, hf)
    assert float(per.median()) < 0.08 and float(per.max()) < 0.4


def _batched_weights(arch: str, tmp_path: Path) -> object:
    if arch == "gpt-oss":
        return weights_from_gguf(tiny_oss_gguf(tmp_path / "oss.gguf", seed=3)[1])
    return weights_from_hf(tiny_moe(3), WeightType.Q4_1)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_a_row_is_what_it_is_alone_in_a_batch(arch: str, tmp_path: Path) -> None:
    """Rows routed to different experts, batched: each item's logits equal its own forward's, bit for bit."""
    model = QuantizedModel(_batched_weights(arch, tmp_path))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (1, n), generator=g) for n in (7, 1, 12, 3)]
    alone = []
    for ids in prompts:
        cache = model.new_cache(64)
        alone.append(model.forward(ids, cache))
    caches = [model.new_cache(64) for _ in prompts]
    batched = model.forward_batch([BatchItem(ids, cache) for ids, cache in zip(prompts, caches, strict=True)])
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_speculative_greedy_equals_plain_greedy_on_every_path(arch: str, tmp_path: Path) -> None:
    weights = (weights_from_gguf(tiny_oss_gguf(tmp_path / "oss.gguf", seed=6)[1]) if arch == "gpt-oss"
               else weights_from_hf(tiny_moe(6), WeightType.Q4_1))
    before = torch.get_num_threads()
    tokens, logits = {}, {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in HERE:
                model = QuantizedModel(weights, torch.float16)
                model.lib = kernels.library(isa)
                engine = Engine(TinyTarget(model, TinyTokenizer(), f"tiny-moe-{isa}", torch.device("cpu"), (), 512))
                plain = run(engine, PROMPT, 40, [], None).token_ids
                assert len(set(plain)) > 10  # not a degenerate repetition
                assert run(engine, PROMPT, 40, [RandomTreeDrafter(plain, seed=1)], 16).token_ids == plain, isa
                tokens[isa, threads] = plain
                with torch.inference_mode():
                    logits[isa, threads] = model(torch.tensor([PROMPT.ids])).logits
    finally:
        torch.set_num_threads(before)
    for key in tokens:
        assert tokens[key] == tokens["avx2", 1] and torch.equal(logits[key], logits["avx2", 1]), key


def test_a_mixture_of_experts_the_runtime_cannot_run_is_refused_saying_why() -> None:
    config = tiny_moe(0).config
    dense_first = Qwen3MoeConfig(**{**config.to_dict(), "mlp_only_layers": [0]})
    with pytest.raises(ModelFileError, match="a mixture of experts on every layer"):
        check_supported(dense_first)
    odd = Qwen3MoeConfig(**{**config.to_dict(), "moe_intermediate_size": 40})
    with pytest.raises(ModelFileError, match="an expert MLP of 40 rows"):
        check_supported(odd)
