"""Rope scaling at load (``load_model(rope_scaling=...)``, ``apply_rope_scaling``) and the window a service
may use (``with_context_window``), on tiny random Qwen2 / Llama models saved to tmp dirs and run on a CPU:
the scaling reaches transformers' model and the quantized runtime's rotary tables, the window is factor x
original, bad scalings and windows beyond the model's positions are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from decoding.errors import ModelLoadError
from decoding.runtime import kernels
from decoding.runtime.loader import LoadOptions, apply_rope_scaling, load_model, with_context_window
from decoding.runtime.rope import rotary_tables
from tests.decoding.conftest import default_kv_name, make_tokenizer, save_tiny_model

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="no CPU kernels: no quantized runtime")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def _qwen2_config(vocab: int, eos: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, use_sliding_window=False, eos_token_id=eos,
    )


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random 2-layer Qwen2 (q/k/v biases, the quantized runtime runs it) saved with a tokenizer."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(_qwen2_config(len(tokenizer), tokenizer.eos_token_id)).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _ids(loaded: Any) -> torch.Tensor:
    return torch.tensor([loaded.tokenizer("the quick brown dog jumps over the lazy fox " * 3).input_ids])


def _reference(path: Path, scaling: dict[str, Any] | None) -> Qwen2ForCausalLM:
    """transformers' own model from the same dir, the scaling written into its config by hand."""
    config = Qwen2Config.from_pretrained(path)
    if scaling is not None:
        config.rope_scaling = dict(scaling)
        config.max_position_embeddings = 1024
    return Qwen2ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                            attn_implementation="sdpa").eval()


def test_rope_scaling_reaches_the_torch_model(qwen_dir: Path) -> None:
    loaded = load_model(str(qwen_dir), LoadOptions(cpu_quant="none", cpu_kernels=False, rope_scaling=YARN))
    assert loaded.model.config.rope_scaling == YARN
    assert loaded.max_context == 4 * 256  # factor x original
    assert loaded.runtime == "torch+rope-yarnx4@256:float32"  # the engine keys prefix KV on it
    plain = load_model(str(qwen_dir), LoadOptions(cpu_quant="none", cpu_kernels=False))
    assert plain.max_context == 256 and plain.runtime == "torch:float32"
    ids = _ids(loaded)
    with torch.inference_mode():
        got = loaded.model.module(ids).logits  # the torch runtime's transformers model
        assert torch.equal(got, _reference(qwen_dir, YARN)(ids).logits)
        assert not torch.allclose(got, plain.model.module(ids).logits)  # the scaling changes the outputs here


@needs_kernels
def test_rope_scaling_reaches_the_quantized_runtime(qwen_dir: Path) -> None:
    """An HF model quantized at load: the rotary tables are the scaled ones transformers computes, for the
    raised window, and the outputs follow transformers' scaled model."""
    loaded = load_model(str(qwen_dir), LoadOptions(cpu_quant="q8_0", rope_scaling=YARN))
    assert loaded.runtime == f"cpu-quantized+rope-yarnx4@256:quantized:q8_0/kv-{default_kv_name()}"
    assert loaded.max_context == 1024 and loaded.model.max_positions == 1024
    reference = _reference(qwen_dir, YARN)
    cos, sin = rotary_tables(reference.config, 1024)
    assert torch.equal(loaded.model.cos, cos) and torch.equal(loaded.model.sin, sin)
    unscaled_cos, _ = rotary_tables(Qwen2Config.from_pretrained(qwen_dir), 256)
    assert not torch.allclose(loaded.model.cos[:256], unscaled_cos)
    ids = _ids(loaded)
    with torch.inference_mode():
        got, want = loaded.model(ids).logits[0], reference(ids).logits[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.98


@needs_kernels
def test_rope_scaling_reaches_a_gguf_on_the_quantized_runtime(tmp_path: Path) -> None:
    """A GGUF's config is built from its metadata: the scaling is written into it before the tables."""
    from tests.decoding.conftest import write_gguf

    tokenizer = make_tokenizer()
    model = save_tiny_model(tmp_path / "hf", tokenizer)
    (tmp_path / "gguf").mkdir()
    write_gguf(tmp_path / "gguf" / "tiny.gguf", model)
    tokenizer.save_pretrained(tmp_path / "gguf")
    scaling = {"rope_type": "linear", "factor": 2.0}
    loaded = load_model(str(tmp_path / "gguf"), LoadOptions(rope_scaling=scaling))
    assert loaded.runtime.startswith("cpu-quantized+rope-linearx2@256:gguf:")
    assert loaded.model.config.rope_scaling == scaling and loaded.max_context == 512
    config = LlamaConfig(**{**model.config.to_dict(), "rope_scaling": scaling, "max_position_embeddings": 512})
    assert torch.equal(loaded.model.cos, rotary_tables(config, 512)[0])
    on_torch = load_model(str(tmp_path / "gguf"), LoadOptions(cpu_quant="none", rope_scaling=scaling))  # HF's GGUF
    assert on_torch.runtime == "torch+rope-linearx2@256:float32" and on_torch.max_context == 512
    assert on_torch.model.config.rope_scaling == scaling


def test_qwen_card_scaling_gives_128k_and_llama31_keeps_its_window() -> None:
    """Qwen2.5's card writes ``type`` (the old key); Llama-3.1 states more positions than factor x original."""
    qwen = Qwen2Config(max_position_embeddings=32768)
    tag = apply_rope_scaling(qwen, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert tag == "rope-yarnx4@32768" and qwen.max_position_embeddings == 131072
    assert qwen.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    llama = LlamaConfig(max_position_embeddings=131072, rope_scaling=dict(llama3))
    apply_rope_scaling(llama, llama3)
    assert llama.max_position_embeddings == 131072 and llama.rope_scaling == llama3


def test_yarn_without_an_original_keeps_its_frequencies() -> None:
    """Without ``original_max_position_embeddings`` yarn takes the window as the original: the config's own
    window is written into the dict, so raising the window does not move the frequency ramp."""
    bare, explicit = LlamaConfig(max_position_embeddings=256), LlamaConfig(max_position_embeddings=256)
    apply_rope_scaling(bare, {"rope_type": "yarn", "factor": 4.0})
    apply_rope_scaling(explicit, YARN)
    assert bare.rope_scaling == YARN and bare.max_position_embeddings == 1024
    assert torch.equal(rotary_tables(bare, 1024)[0], rotary_tables(explicit, 1024)[0])


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        ("yarn", "JSON object"),
        ({"rope_type": "dynamic", "factor": 2.0}, "not supported"),
        ({"rope_type": "longrope", "factor": 2.0}, "not supported"),
        ({"type": "yarn"}, "factor"),
        ({"rope_type": "linear", "factor": 0.5}, "factor"),
        ({"rope_type": "linear", "factor": "4"}, "factor"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -1}, "original"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),  # transformers' own check of the keys
    ],
)
def test_bad_rope_scalings_are_refused(scaling: Any, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        apply_rope_scaling(LlamaConfig(max_position_embeddings=256), scaling)


def test_a_bad_rope_scaling_stops_the_load(qwen_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(str(qwen_dir), LoadOptions(cpu_quant="none", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_context_window_up_to_the_supported_positions(qwen_dir: Path) -> None:
    plain = load_model(str(qwen_dir), LoadOptions(cpu_quant="none", cpu_kernels=False))
    assert with_context_window(plain, 200).max_context == 200
    assert with_context_window(plain, 256).max_context == 256
    with pytest.raises(ModelLoadError, match="beyond the 256 positions"):
        with_context_window(plain, 1024)
    scaled = load_model(str(qwen_dir), LoadOptions(cpu_quant="none", cpu_kernels=False, rope_scaling=YARN))
    assert with_context_window(scaled, 1024).max_context == 1024
    with pytest.raises(ModelLoadError, match="beyond the 1024 positions"):
        with_context_window(scaled, 1025)
