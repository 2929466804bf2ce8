"""Tiny random-weight Llama targets for fast, exact decoding tests, and the helpers several test modules
share: a greedy reference, an engine run, a tiny trained tokenizer, total variation distance, a tiny model saved
as an HF dir or written as a GGUF file, a drafter of random trees around a known answer.

A tiny target's ``model`` is a ``TargetRuntime``: the quantized CPU runtime, or a transformers model in a
``TorchRuntime``. The references (``naive_greedy``, ``next_token_probs``) call the transformers causal-LM call
itself, with no cache of the engine's (``causal_lm``)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decoding.runtime import kernels
from decoding.runtime.attention import use_grouped_sdpa
from decoding.runtime.kernels import use_cpu_kernels
from decoding.runtime.quant import WeightType
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.torch_runtime import TorchRuntime
from decoding.runtime.weights import weights_from_hf
from decoding.speculative.budget import BudgetPolicy
from decoding.speculative.drafter import BaseDrafter, DraftRequest
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt, TokenEvent
from decoding.speculative.tree import ROOT, DraftTree

if TYPE_CHECKING:  # the fixtures of modules that never run an engine need not import it
    from decoding.speculative.engine import Engine

VOCAB = 97
PROMPT = Prompt(prefix_ids=[5, 17, 3, 42, 8, 8, 23, 61, 5, 17], suffix_ids=[3, 42, 9], prefix_key=None)


@dataclass
class TinyTokenizer:
    """Maps token id i to a short string; enough for detokenization in engine tests."""

    vocab: int = VOCAB

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class TinyTarget:
    model: Any  # a TargetRuntime
    tokenizer: Any
    name: str
    device: torch.device
    eos_token_ids: tuple[int, ...]
    max_context: int


def make_tiny_llama(
    seed: int = 0, vocab: int = VOCAB, layers: int = 2, peaked: float = 1.0, cpu_kernels: bool = True,
    heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
) -> LlamaForCausalLM:
    """A random-weight Llama; ``cpu_kernels`` switches it to decoding.runtime.kernels (when this machine has them)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
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


WINDOW = 72  # the tiny windowed families' sliding window: crossed by the tests' 300-token prompts, not block-aligned


def make_tiny_family(arch: str, seed: int = 0, vocab: int = VOCAB, layers: int = 3, window: int = WINDOW,
                     **kw: Any) -> torch.nn.Module:
    """A random-weight model of a family the runtime runs (``decoding.runtime.families``), from transformers' own
    class, as small as ``make_tiny_llama``'s: ``gemma2`` (soft-capped at 20 / 10 so the caps bend, alternate sliding
    layers), ``gemma3`` (q / k norms, sliding layers with their own rope base, a linear-scaled global one),
    ``qwen2``, ``qwen3``, ``qwen3moe``, ``mixtral`` and ``olmoe`` (8 experts, 2 a token), ``gpt-oss`` (8 experts, 2
    a token, alternate sliding layers, YaRN x32 from 4096 positions, sinks and every bias moved off zero), ``phi3``
    (every layer sliding), ``mistral`` (every layer sliding, from an HF config);
    norms and biases moved off their initial values so a misplaced one shows, weights wide enough that greedy
    decoding does not fall into a one-token loop."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                 attn_implementation="eager", initializer_range=0.3)  # wide: greedy output varies, logits spread
    shape.update(kw)
    short = ["sliding_attention", "full_attention"] + ["sliding_attention"] * max(0, layers - 2)  # a global one
    made: dict[str, Any] = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**shape)),
        "mistral": lambda: MistralForCausalLM(MistralConfig(**shape, sliding_window=window)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**shape)),
        "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**shape)),
        "qwen3moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
        "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
            **shape, sliding_window=window, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
            final_logit_softcapping=10.0)),
        "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
            **shape, sliding_window=window, query_pre_attn_scalar=32, rope_scaling={"rope_type": "linear",
            "factor": 4.0}, layer_types=None if layers >= 6 else short[:layers])),  # 6+: the model's own 5 : 1
        "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
            **{**shape, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
        "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(  # all heads keyed, as OLMoE (and llama.cpp's loader) has it
            **{**shape, "intermediate_size": 32, "head_dim": None,
               "num_key_value_heads": shape["num_attention_heads"]}, num_experts=8, num_experts_per_tok=2)),
        "gpt-oss": lambda: GptOssForCausalLM(GptOssConfig(
            **{**shape, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2, sliding_window=window,
            layer_types=[short[0], short[1]] * (layers // 2) + short[:layers % 2], rope_theta=150000.0,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                          "original_max_position_embeddings": 4096})),
        "phi3": lambda: Phi3ForCausalLM(Phi3Config(**{k: v for k, v in shape.items() if k != "head_dim"},
                                                   sliding_window=window, pad_token_id=0)),
    }
    model = made[arch]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(torch.randn_like(p) * 0.3)
        if model.config.tie_word_embeddings:  # Gemma: embeddings times sqrt(hidden) would drown the layers' work
            model.get_output_embeddings().weight.mul_(1 / 8)
    return model


def quantized_tiny_llama(
    seed: int = 0, kind: WeightType = WeightType.Q4_1, kv_dtype: torch.dtype = torch.float16, arch: str = "llama",
    **kw: Any,
) -> QuantizedModel:
    """The same random Llama (or a model of another family, ``make_tiny_family``) on the quantized CPU runtime
    (linear layers ``kind``, embedding / head Q8_0)."""
    if arch != "llama":
        return QuantizedModel(weights_from_hf(make_tiny_family(arch, seed, **kw), kind), kv_dtype)
    return QuantizedModel(weights_from_hf(make_tiny_llama(seed, cpu_kernels=False, **kw), kind), kv_dtype)


def fake_quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernels' activation quantization (per row, per 32-block, q = round(x * (127 / amax))), dequantized."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def load_dequantized(hf: torch.nn.Module, weights: Any) -> None:
    """Copy the runtime's weights, dequantized, into transformers' Llama (q / k / v and gate / up split again)."""
    inner = hf.model
    with torch.no_grad():
        inner.embed_tokens.weight.copy_(weights.embed.dequantize())
        hf.lm_head.weight.copy_(weights.head.dequantize())
        for layer, lw in zip(inner.layers, weights.layers, strict=True):
            at, mlp = layer.self_attn, layer.mlp
            qkv, q, k = lw.qkv.dequantize(), at.q_proj.out_features, at.k_proj.out_features
            at.q_proj.weight.copy_(qkv[:q])
            at.k_proj.weight.copy_(qkv[q : q + k])
            at.v_proj.weight.copy_(qkv[q + k :])
            at.o_proj.weight.copy_(lw.o.dequantize())
            if hasattr(mlp, "router"):  # gpt-oss: the router, the experts' 3-D parameters (gate / up interleaved)
                mlp.router.weight.copy_(lw.router.dequantize())
                ex, (n, e, j2) = mlp.experts, mlp.experts.gate_up_proj.shape
                ex.gate_up_proj[..., ::2] = lw.experts_gate.dequantize().reshape(n, j2 // 2, e).transpose(1, 2)
                ex.gate_up_proj[..., 1::2] = lw.experts_up.dequantize().reshape(n, j2 // 2, e).transpose(1, 2)
                ex.down_proj.copy_(lw.experts_down.dequantize().reshape(n, e, j2 // 2).transpose(1, 2))
                continue
            if lw.router is not None:  # a mixture of experts (Qwen3-MoE): the router, each expert's slice of the stacks
                mlp.gate.weight.copy_(lw.router.dequantize())
                n = len(mlp.experts)
                stacks = (m.dequantize().chunk(n) for m in (lw.experts_gate, lw.experts_up, lw.experts_down))
                for x, g, u, d in zip(mlp.experts, *stacks, strict=True):
                    x.gate_proj.weight.copy_(g)
                    x.up_proj.weight.copy_(u)
                    x.down_proj.weight.copy_(d)
                continue
            gu, i = lw.gate_up.dequantize(), mlp.gate_proj.out_features
            mlp.gate_proj.weight.copy_(gu[:i])
            mlp.up_proj.weight.copy_(gu[i:])
            mlp.down_proj.weight.copy_(lw.down.dequantize())


def quantized_reference(kind: WeightType, seed: int = 3) -> tuple[torch.nn.Module, QuantizedModel]:
    """transformers' Llama on the dequantized weights, with every linear layer's input quantized as the
    kernels quantize it: what QuantizedModel computes, up to fp32 summation order."""
    hf = make_tiny_llama(seed, cpu_kernels=False, layers=3)
    weights = weights_from_hf(hf, kind)
    ours = QuantizedModel(weights, torch.float32)
    load_dequantized(hf, weights)
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _m, args: (fake_quantized_activations(args[0]),))
    return hf, ours


def tiny_target(
    seed: int = 0, eos: tuple[int, ...] = (), max_context: int = 512, quantized: bool = False, **kw: Any
) -> TinyTarget:
    return TinyTarget(
        model=quantized_tiny_llama(seed, **kw) if quantized else TorchRuntime(make_tiny_llama(seed, **kw)),
        tokenizer=TinyTokenizer(),
        name=f"tiny-llama-{seed}",
        device=torch.device("cpu"),
        eos_token_ids=eos,
        max_context=max_context,
    )


needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="CPU kernels unavailable on this machine")


def default_kv_name() -> str:
    """The KV storage a quantized model gets by default on this machine's kernel path (its runtime tag's name)."""
    lib = kernels.load()
    assert lib is not None
    return str(kernels.default_kv_dtype(lib)).removeprefix("torch.")


def sampling_target(seed: int, vocab: int, peaked: float) -> TinyTarget:
    """A tiny target for the statistical tests, which run thousands of generations: on the quantized runtime
    where the kernels load (one C call a layer: several times faster than transformers' modules), else on
    transformers. What they test (the verifier, the drafters' q) is the same on every runtime."""
    return tiny_target(seed=seed, vocab=vocab, peaked=peaked, quantized=kernels.load() is not None)


def causal_lm(model: Any) -> Any:
    """What answers transformers' causal-LM call (``model(ids).logits``, no cache given: a fresh one) for a
    target: a torch runtime's transformers model, the quantized runtime itself (its ``__call__`` is that call), a
    transformers model as it is."""
    return model.module if isinstance(model, TorchRuntime) else model


def next_token_probs(model: Any, prompt: Prompt, params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's sampling distributions after ``prompt`` ([vocab]) and after ``prompt`` + each token
    ([vocab, vocab]), one forward each (the quantized runtime takes one sequence at a time)."""
    from decoding.speculative.verify import target_probs

    model = causal_lm(model)
    vocab = int(model.config.vocab_size)
    with torch.inference_mode():
        first = target_probs(model(torch.tensor([prompt.ids])).logits[0, -1], params)
        second = torch.stack([target_probs(model(torch.tensor([[*prompt.ids, t]])).logits[0, -1], params)
                              for t in range(vocab)])
    return first, second


@pytest.fixture(scope="module", params=["quantized", "cpu_kernels", "torch_kernels"])
def tiny(request: pytest.FixtureRequest) -> TinyTarget:
    """The tiny target on the quantized CPU runtime, on decoding.runtime.kernels (fp32) and on torch's kernels:
    everything must hold on all three."""
    torch.set_num_threads(1)
    if request.param == "quantized":
        if kernels.load() is None:
            pytest.skip("CPU kernels unavailable: no quantized runtime")
        return tiny_target(0, quantized=True)
    return tiny_target(0, cpu_kernels=request.param == "cpu_kernels")


def naive_greedy(model: Any, ids: Sequence[int], n: int, eos: tuple[int, ...] = ()) -> list[int]:
    """Reference: full recomputation without any cache, one token at a time (``causal_lm``'s call)."""
    model = causal_lm(model)
    seq = list(ids)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            tok = int(logits.argmax())
            if tok in eos:
                break
            out.append(tok)
            seq.append(tok)
    return out


# Verify costs in plain steps by nodes, as a 2-core CPU measures them: ``fixed_cost_policy``'s
CPU_COSTS = {0: 1.0, 1: 1.04, 2: 1.07, 3: 1.15, 4: 1.25, 6: 1.35, 8: 1.44, 12: 1.7, 16: 2.0, 24: 2.5, 32: 3.0,
             48: 4.2, 64: 5.4}  # fmt: skip


def fixed_cost_policy(explore_every: int = 16) -> BudgetPolicy:
    """A budget policy whose verify costs are ``CPU_COSTS`` and stay so (no timing refines them): what a test
    asserts about how many steps or tokens a drafter saves does not depend on this box's load."""
    policy = BudgetPolicy(max_budget=64, explore_every=explore_every)
    policy.calibrate(lambda n: CPU_COSTS[n])
    policy.observe_cost = lambda nodes, seconds, context=None: None  # type: ignore[method-assign]  # fixed costs
    return policy


def run(
    engine: Engine, prompt: Prompt, n: int, drafters: Sequence[object] = (), budget: int | None = None
) -> DoneEvent:
    """Generate ``n`` tokens; the streamed text must be the final text."""
    events = list(engine.generate(prompt, GenerationConfig(max_new_tokens=n, draft_budget=budget), drafters))  # type: ignore[arg-type]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert streamed == done.text
    return done


def tv(counts: Counter[Any], probs: Mapping[Any, float], n: int) -> float:
    """Total variation distance between ``n`` draws' ``counts`` and the distribution ``probs``."""
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Licenses grant permission to copy, modify and distribute the software.",
    "Question: what does the document say? Answer: it says many things.",
] * 4


def make_tokenizer(corpus: list[str] = CORPUS, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with ChatML specials, trained in milliseconds."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML,
        clean_up_tokenization_spaces=False,
    )


def save_tiny_model(
    path: Path, tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0, vocab: int | None = None
) -> LlamaForCausalLM:
    """A seeded 2-layer random Llama + tokenizer saved as an HF dir at ``path``."""
    tokenizer = tokenizer or make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def gguf_writer(path: Path, c: Any, arch: str = "llama", eos: int | None = 2, bos: int | None = None) -> Any:
    """A ``gguf.GGUFWriter`` at ``path`` holding the metadata every architecture shares, from transformers config
    ``c``, as llama.cpp's converter writes it under ``arch``; the caller adds the rest and writes the file."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if eos is not None:
        w.add_eos_token_id(eos)
    if bos is not None:
        w.add_bos_token_id(bos)
    return w


def permute(t: torch.Tensor, heads: int) -> np.ndarray:
    """q / k rows in llama.cpp's order (its converter permutes them for its RoPE)."""
    a = t.detach().numpy()
    return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def write_gguf(path: Path, hf: torch.nn.Module, metadata: Callable[[Any], None] | None = None) -> None:
    """The tiny Llama as llama.cpp's converter writes it: q / k rows permuted, Q8_0 / Q4_1 / F32 tensors;
    ``metadata`` may add keys (a tokenizer) to the ``gguf.GGUFWriter`` first."""
    import gguf

    c = hf.config
    w = gguf_writer(path, c)
    if metadata is not None:
        metadata(w)

    def put(name: str, a: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    q8, q41, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32)
    put("token_embd.weight", hf.model.embed_tokens.weight.detach().numpy(), q8)
    for i, layer in enumerate(hf.model.layers):
        at, mlp = layer.self_attn, layer.mlp
        put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight.detach().numpy(), f32)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight.detach().numpy(), f32)
        put(f"blk.{i}.attn_q.weight", permute(at.q_proj.weight, c.num_attention_heads), q41)
        put(f"blk.{i}.attn_k.weight", permute(at.k_proj.weight, c.num_key_value_heads), q41)
        put(f"blk.{i}.attn_v.weight", at.v_proj.weight.detach().numpy(), q41)
        put(f"blk.{i}.attn_output.weight", at.o_proj.weight.detach().numpy(), q41)
        put(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight.detach().numpy(), q41)
        put(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight.detach().numpy(), gguf.GGMLQuantizationType.F16)
        put(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight.detach().numpy(), q41)
    put("output_norm.weight", hf.model.norm.weight.detach().numpy(), f32)
    put("output.weight", hf.lm_head.weight.detach().numpy(), q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class RandomTreeDrafter(BaseDrafter):
    """Random trees mixing right and wrong tokens at random depths and widths."""

    name = "random"

    def __init__(self, answer: Sequence[int], seed: int, vocab: int = VOCAB) -> None:
        self.answer = list(answer)
        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, request: DraftRequest) -> DraftTree:
        pos = len(request.generated)
        tree = DraftTree()
        frontier = [(ROOT, 0)]
        while frontier and len(tree) < request.budget:
            parent, depth = frontier.pop(0)
            for _ in range(self.rng.randint(1, 3)):
                if len(tree) >= request.budget:
                    break
                good = self.answer[pos + depth] if pos + depth < len(self.answer) else 0
                tok = good if self.rng.random() < 0.6 else self.rng.randrange(self.vocab)
                frontier.append((tree.add(parent, tok, self.name), depth + 1))
        return tree


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length when one continues the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))  # fmt: skip
