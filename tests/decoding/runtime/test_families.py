"""The families the quantized CPU runtime runs (``decoding.runtime.families``), each a tiny random model made from
transformers' own class (``make_tiny_family``): the forward on unquantized weights equals transformers' to fp32
rounding across the sliding windows (soft-caps, post-norms, q / k norms, local rope, biases, fused tensors all
exercised), greedy decoding gives transformers' tokens, and speculative decoding gives plain greedy's on every ISA
path this CPU has (each path the avx2 path's tokens). A config the runtime cannot run is refused saying why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, OlmoeConfig, Phi3Config

from decoding.cache.slot import SlotCache
from decoding.errors import ModelFileError
from decoding.runtime import kernels
from decoding.runtime.families import MODEL_TYPES, forward_plan, layer_windows
from decoding.runtime.quant import WeightType
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.weights import check_supported, weights_from_gguf, weights_from_hf
from decoding.speculative.generation import Prompt
from tests.decoding.conftest import (
    WINDOW,
    RandomTreeDrafter,
    TinyTarget,
    TinyTokenizer,
    gguf_writer,
    make_tiny_family,
    naive_greedy,
    needs_kernels,
    run,
)
from tests.decoding.gguf_families import write_family_gguf

ARCHS = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3moe", "olmoe", "gpt-oss", "gemma2", "gemma3",
         "phi3"]
HERE = [isa for isa in kernels.ISAS if isa in kernels.available_isas()]


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_the_forward_equals_transformers_across_the_windows(arch: str) -> None:
    """F32 weights and KV: only fp32 summation order differs from transformers (eager attention, its own masks),
    over 200 tokens (the windows of 72 crossed), a chunked prefill and decoding steps alike."""
    hf = make_tiny_family(arch, seed=1, layers=3)
    model = QuantizedModel(weights_from_hf(hf, WeightType.F32), torch.float32)
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = hf(ids).logits[0]
        got = model.forward(ids, SlotCache(model.num_layers, 200))
        cache = SlotCache(model.num_layers, 200)
        steps = [model.forward(ids[:, :130], cache)]
        steps += [model.forward(ids[:, t : t + 1], cache) for t in range(130, 200)]
    scale = float(want.abs().max())
    assert scale > 1.0  # logits spread, not all near 0
    assert float((got - want).abs().max()) < 1e-4 * scale, arch  # wide random weights amplify rounding
    assert torch.equal(torch.cat(steps), got)  # a row's logits do not depend on the rows beside it


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(arch: str) -> None:
    hf = make_tiny_family(arch, seed=4, layers=2)
    model = QuantizedModel(weights_from_hf(hf, WeightType.F32), torch.float32)
    prompt = torch.randint(0, 97, (1, 90), generator=torch.Generator().manual_seed(5)).tolist()[0]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert naive_greedy(model, prompt, 24) == want


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_plain_greedy_on_every_path(arch: str, threads: None) -> None:
    """Q8_0 weights, fp16 KV, a window crossed by the prompt and the answer: random draft trees give the plain greedy
    tokens on every path, and every path the avx2 path's tokens."""
    from decoding.speculative.engine import Engine

    torch.set_num_threads(2)
    weights = weights_from_hf(make_tiny_family(arch, seed=7, layers=3), WeightType.Q8_0)
    ids = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    long_prompt = Prompt(prefix_ids=ids[:190], suffix_ids=ids[190:], prefix_key=None)
    tokens = {}
    for isa in HERE:
        model = QuantizedModel(weights, torch.float16)
        model.lib = kernels.library(isa)  # type: ignore[assignment]
        engine = Engine(TinyTarget(model, TinyTokenizer(), f"tiny-{arch}-{isa}", torch.device("cpu"), (), 512))
        plain = run(engine, long_prompt, 40, [], None).token_ids
        assert len(set(plain)) > 10, (arch, plain)  # not a degenerate repetition
        assert run(engine, long_prompt, 40, [RandomTreeDrafter(plain, seed=1)], 16).token_ids == plain, (arch, isa)
        tokens[isa] = plain
    assert all(t == tokens["avx2"] for t in tokens.values()), arch


def test_each_family_plans_its_forward() -> None:
    """What each config asks beyond a Llama, as transformers applies it."""
    plans = {arch: forward_plan(make_tiny_family(arch, layers=4).config) for arch in ARCHS}
    w = WINDOW
    assert plans["llama"].windows == plans["qwen2"].windows == plans["qwen3"].windows == (0, 0, 0, 0)
    assert plans["mistral"].windows == plans["phi3"].windows == (w, w, w, w)
    assert plans["gemma2"].windows == (w, 0, w, 0)  # the first layer slides, then every other one
    assert plans["gemma3"].windows == (w, 0, w, w) and plans["gemma3"].local_rope == (True, False, True, True)
    assert plans["gemma2"].activation == plans["gemma3"].activation == 1 and plans["qwen3"].activation == 0
    assert (plans["gemma2"].attn_softcap, plans["gemma2"].final_softcap) == (20.0, 10.0)
    assert plans["gemma3"].attn_softcap == 0.0 and plans["gemma3"].embed_scale == 8.0
    assert plans["llama"].embed_scale == 1.0 and plans["llama"].query_scale == pytest.approx(32**-0.5)
    assert layer_windows(LlamaConfig(sliding_window=None)) == (0,) * 32
    assert plans["mixtral"].experts == plans["qwen3moe"].experts == (8, 2, 32)
    assert plans["mixtral"].norm_topk and not plans["mixtral"].topk_softmax and plans["llama"].experts == (0, 0, 0)
    assert plans["olmoe"].qk_norm_all and not plans["olmoe"].norm_topk and not plans["qwen3"].qk_norm_all
    oss = plans["gpt-oss"]
    assert oss.windows == (w, 0, w, 0) and oss.activation == 2 and oss.sinks and oss.topk_softmax


def test_what_the_runtime_cannot_run_is_refused_saying_why() -> None:
    falcon = LlamaConfig()
    falcon.model_type = "falcon"
    with pytest.raises(ModelFileError, match=f"runs {', '.join(sorted(MODEL_TYPES))} models, not 'falcon'"):
        check_supported(falcon)
    with pytest.raises(ModelFileError, match="SiLU or GELU"):
        check_supported(LlamaConfig(hidden_act="relu"))
    with pytest.raises(ModelFileError, match="partial_rotary_factor"):
        check_supported(Phi3Config(partial_rotary_factor=0.5))
    with pytest.raises(ModelFileError, match="biases only"):
        check_supported(LlamaConfig(attention_bias=True))
    with pytest.raises(ModelFileError, match="clip_qkv"):
        check_supported(OlmoeConfig(clip_qkv=8.0))


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_a_gguf_as_llama_cpp_writes_it_runs_the_model(arch: str, tmp_path: Path) -> None:
    """Each family's GGUF (llama.cpp's names, permutations, Gemma's norms + 1, fused Phi-3 tensors, metadata;
    F32 so nothing rounds) gives the transformers model's forward: the logits of its weights read from the HF model,
    bit for bit, with the windows and pattern the file states (Gemma 3's own 5 : 1, so 7 layers). Mistral's GGUF
    holds no window (llama.cpp applies none): its model is made without one."""
    layers = 7 if arch == "gemma3" else 3
    hf = make_tiny_family(arch, seed=2, layers=layers, window=None if arch == "mistral" else WINDOW)
    path = write_family_gguf(tmp_path / f"{arch}.gguf", hf, gguf.GGMLQuantizationType.F32)
    weights = weights_from_gguf(path)
    model = QuantizedModel(weights, torch.float32)
    assert weights.source == "gguf:F32" and model.plan == forward_plan(hf.config)
    reference = QuantizedModel(weights_from_hf(hf, WeightType.F32), torch.float32)
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got = model.forward(ids, SlotCache(model.num_layers, 200))
        assert torch.equal(got, reference.forward(ids, SlotCache(model.num_layers, 200)))
        want = hf(ids).logits[0]
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


@needs_kernels
def test_rotary_tables_grow_as_positions_reach_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-window model starts with tables for 4096 positions (not its 128K's hundreds of MB), doubled when a
    forward reaches past them: the logits are those of tables made whole at load, bit for bit, on both of Gemma
    3's rope bases."""
    import decoding.runtime.quantized as quantized

    weights = weights_from_hf(make_tiny_family("gemma3", seed=5, layers=2, max_position_embeddings=20000),
                              WeightType.Q8_0)
    lazy = QuantizedModel(weights, torch.float16)
    assert lazy.rope_rows == 4096 and lazy.cos.shape[0] == 4096
    monkeypatch.setattr(quantized, "ROPE_ROWS", 20000)
    whole = QuantizedModel(weights, torch.float16)
    ids, pos = torch.tensor([[5, 9, 33, 2]]), torch.tensor([[9000, 9001, 9002, 9003]])
    with torch.inference_mode():
        got = lazy.forward(ids, SlotCache(lazy.num_layers, 8), position_ids=pos)
        want = whole.forward(ids, SlotCache(whole.num_layers, 8), position_ids=pos)
    assert lazy.rope_rows == 9004 and torch.equal(got, want)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt-oss"])  # no SDPA there: transformers' eager runs it
def test_the_torch_path_attention_equals_transformers_eager(arch: str) -> None:
    """The transformers path (a GPU, ``RAGSPEC_CPU_QUANT=none``) on ragspec's grouped attention: every family's
    logits are eager transformers', Gemma 2's soft-capped scores included (SDPA would drop the caps)."""
    from decoding.runtime.attention import use_grouped_sdpa

    eager = make_tiny_family(arch, seed=1, layers=3)
    ours = type(eager)(eager.config.__class__(**{**eager.config.to_dict(), "attn_implementation": "sdpa"})).eval()
    ours.load_state_dict(eager.state_dict())
    assert use_grouped_sdpa(ours)
    if kernels.load() is not None:
        kernels.use_cpu_kernels(ours)
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want, got = eager(ids).logits, ours(ids).logits
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max()), arch


def test_the_torch_path_runs_gpt_oss_in_transformers_eager_attention(tmp_path: Path) -> None:
    """gpt-oss has no SDPA in transformers (its sinks): an HF dir of it on the torch path (a GPU, cpu_quant none)
    loads with transformers' eager attention, and a chunked prefill then decoding steps on ragspec's cache give the
    model's logits across its sliding windows."""
    from decoding.runtime.loader import LoadOptions, load_model
    from tests.decoding.conftest import make_tokenizer

    tokenizer = make_tokenizer()
    hf = make_tiny_family("gpt-oss", seed=3, layers=2, vocab=len(tokenizer))
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), LoadOptions(cpu_quant="none", dtype="float32"))
    runtime = loaded.model
    assert runtime.config._attn_implementation == "eager"
    ids = torch.randint(0, len(tokenizer), (1, 160), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = hf(ids).logits[0]
        cache = runtime.new_cache(160)
        got = torch.cat([runtime.forward(ids[:, :100], cache)]
                        + [runtime.forward(ids[:, t : t + 1], cache) for t in range(100, 160)])
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


def test_a_phi3_gguf_with_longrope_factors_is_refused_in_one_line(tmp_path: Path) -> None:
    """The 128K Phi-3's LongRoPE factors pick tables by the sequence's length: refused naming why, not run wrong."""
    path = tmp_path / "phi3-128k.gguf"
    w = gguf_writer(path, make_tiny_family("phi3", layers=1).config, "phi3")
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"^Phi-3 with LongRoPE factors .*use a 4K-window Phi-3$"):
        weights_from_gguf(path)
