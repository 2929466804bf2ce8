"""A GGUF's rope scaling reaches the quantized CPU runtime: ``gguf_config`` maps llama.cpp's linear / yarn
metadata and Llama-3.1's ``rope_freqs.weight`` into the config, ``rotary_tables`` honours them, and what the
runtime could not reproduce is refused. Tiny GGUF files are written here with the ``gguf`` package."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from decoding.errors import ModelLoadError
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.rope import rotary_frequencies, rotary_tables
from decoding.runtime.weights import gguf_config, weights_from_gguf
from tests.decoding.conftest import make_tokenizer, needs_kernels

ROPE = gguf.Keys.Rope
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN = 4, 2, 16, 64, 64
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _write(path: Path, meta: dict[str, Any] | None = None, rope_freqs: np.ndarray | None = None,
           context: int = 256, theta: float = 10000.0, vocab: int = 64) -> Path:
    """A one-layer Llama GGUF (random F32 weights) whose metadata adds ``meta``: gguf ``Keys.Rope`` templates
    (``{arch}`` unfilled) to a str / int / float value; ``rope_freqs`` as ``rope_freqs.weight``."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_eos_token_id(2)
    for template, value in (meta or {}).items():
        key = template.format(arch="llama")
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    rng = np.random.default_rng(0)

    def put(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05 + (1.0 if len(shape) == 1 else 0.0)).astype(np.float32))

    put("token_embd.weight", vocab, HIDDEN)
    put("blk.0.attn_norm.weight", HIDDEN)
    put("blk.0.ffn_norm.weight", HIDDEN)
    put("blk.0.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
    put("blk.0.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
    put("blk.0.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
    put("blk.0.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
    put("blk.0.ffn_gate.weight", FFN, HIDDEN)
    put("blk.0.ffn_up.weight", FFN, HIDDEN)
    put("blk.0.ffn_down.weight", HIDDEN, FFN)
    put("output_norm.weight", HIDDEN)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config(path: Path) -> LlamaConfig:
    return gguf_config(gguf.GGUFReader(str(path)))


def _default_inv_freq(theta: float, d: int) -> torch.Tensor:
    """RoPE's unscaled inverse frequencies, theta^(-2i/d), from the definition (float64)."""
    return theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def _llama3_rope_freqs(theta: float, d: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_position_embeddings: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama-3.1's scaling, from its definition: a rotary dimension whose
    wavelength is below original / high_freq_factor keeps its frequency (divisor 1), one above
    original / low_freq_factor is slowed by ``factor``, one between mixes the two, weighted by
    smooth = (original / wavelength - low) / (high - low); the divisor is old / new frequency."""
    out = []
    for inv in _default_inv_freq(theta, d).tolist():
        wavelength = 2 * math.pi / inv
        if wavelength < original_max_position_embeddings / high_freq_factor:
            out.append(1.0)
        elif wavelength > original_max_position_embeddings / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)  # stored as F32, as the converter writes it


def test_no_scaling_leaves_the_config_as_before(tmp_path: Path) -> None:
    for name, meta in (("plain", None), ("none", {ROPE.SCALING_TYPE: "none"}), ("one", {ROPE.SCALING_FACTOR: 1.0})):
        config = _config(_write(tmp_path / f"{name}.gguf", meta))
        assert config.rope_scaling is None and getattr(config, "rope_freqs", None) is None, name
        assert config.max_position_embeddings == 256
        inv, scale = rotary_frequencies(config)
        assert scale == 1.0 and torch.allclose(inv.double(), _default_inv_freq(10000.0, HEAD_DIM), rtol=1e-6)


def test_linear_scaling_divides_every_frequency(tmp_path: Path) -> None:
    for name, meta in (("typed", {ROPE.SCALING_TYPE: "linear", ROPE.SCALING_FACTOR: 2.5}),
                       ("untyped", {ROPE.SCALING_FACTOR: 2.5})):  # llama.cpp's default type is linear
        config = _config(_write(tmp_path / f"{name}.gguf", meta, context=640))
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.5}, name
        assert config.max_position_embeddings == 640  # the GGUF's context length, not raised again
        inv, scale = rotary_frequencies(config)
        assert scale == 1.0 and torch.allclose(inv.double(), _default_inv_freq(10000.0, HEAD_DIM) / 2.5, rtol=1e-6)


def test_yarn_scaling_keeps_its_original_window(tmp_path: Path) -> None:
    meta = {ROPE.SCALING_TYPE: "yarn", ROPE.SCALING_FACTOR: 4.0, ROPE.SCALING_ORIG_CTX_LEN: 256,
            ROPE.SCALING_YARN_BETA_FAST: 16.0, ROPE.SCALING_ATTN_FACTOR: 1.0}  # neutral attn_factor: accepted
    config = _config(_write(tmp_path / "yarn.gguf", meta, context=1024, theta=500000.0))
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                   "beta_fast": 16.0}
    assert config.max_position_embeddings == 1024
    inv, scale = rotary_frequencies(config)
    base = _default_inv_freq(500000.0, HEAD_DIM)
    # yarn: the fastest dimension extrapolates (unchanged), the slowest interpolates (/ factor), and the
    # attention scaling is 0.1 ln(factor) + 1
    assert math.isclose(scale, 0.1 * math.log(4.0) + 1.0, rel_tol=1e-6)
    assert math.isclose(float(inv[0]), float(base[0]), rel_tol=1e-6)
    assert math.isclose(float(inv[-1]), float(base[-1]) / 4.0, rel_tol=1e-6)
    cos, _ = rotary_tables(config, 8)
    assert torch.allclose(cos[0], torch.full((HEAD_DIM // 2,), scale))
    default = _config(_write(tmp_path / "orig.gguf", {ROPE.SCALING_TYPE: "yarn", ROPE.SCALING_FACTOR: 4.0}))
    assert default.rope_scaling["original_max_position_embeddings"] == 256  # none stated: the context length


def test_llama3_rope_freqs_equal_transformers_llama3_tables() -> None:
    """The per-dimension divisors give Llama-3.1's own rotary tables (its real shapes: theta 5e5, head dim 128)."""
    dims = {"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128, "rope_theta": 500000.0,
            "max_position_embeddings": 131072}
    freqs = _llama3_rope_freqs(500000.0, 128, **LLAMA3)  # type: ignore[arg-type]
    assert freqs[0] == 1.0 and freqs[-1] == 8.0 and ((freqs > 1) & (freqs < 8)).any()  # all three bands
    ours = LlamaConfig(**dims, rope_freqs=freqs.tolist())
    theirs = LlamaConfig(**dims, rope_scaling={"rope_type": "llama3", **LLAMA3})
    (inv, scale), (want, want_scale) = rotary_frequencies(ours), rotary_frequencies(theirs)
    assert scale == want_scale == 1.0
    assert torch.allclose(inv, want, rtol=1e-6, atol=0)
    for got, ref in zip(rotary_tables(ours, 8192), rotary_tables(theirs, 8192), strict=True):
        assert (got - ref).abs().max() < 2e-3  # float32 angles of up to 8191 radians
    assert (rotary_tables(ours, 8192)[0] - rotary_tables(LlamaConfig(**dims), 8192)[0]).abs().max() > 0.5


@needs_kernels
def test_rope_freqs_tensor_reaches_the_runtime(tmp_path: Path) -> None:
    llama3 = {**LLAMA3, "original_max_position_embeddings": 64}
    freqs = _llama3_rope_freqs(500000.0, HEAD_DIM, **llama3)  # type: ignore[arg-type]
    assert freqs[0] == 1.0 and freqs[-1] == 8.0 and ((freqs > 1) & (freqs < 8)).any()
    weights = weights_from_gguf(_write(tmp_path / "l31.gguf", rope_freqs=freqs, context=512, theta=500000.0))
    config = weights.config
    assert config.rope_scaling is None and config.rope_freqs == freqs.tolist()
    assert config.max_position_embeddings == 512
    theirs = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, rope_theta=500000.0,
                         max_position_embeddings=512, rope_scaling={"rope_type": "llama3", **llama3})
    assert torch.allclose(rotary_frequencies(config)[0], rotary_frequencies(theirs)[0], rtol=1e-6, atol=0)
    model = QuantizedModel(weights, torch.float32)
    assert torch.equal(model.cos, rotary_tables(config, 512)[0])
    assert (model.cos - rotary_tables(theirs, 512)[0]).abs().max() < 1e-4
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9]])).logits).all()


@pytest.mark.parametrize(("meta", "freqs", "message"), [
    ({ROPE.SCALING_TYPE: "longrope", ROPE.SCALING_FACTOR: 4.0}, None, "type 'longrope'"),
    ({ROPE.SCALING_TYPE: "ntk-by-parts", ROPE.SCALING_FACTOR: 4.0}, None, "type 'ntk-by-parts'"),
    ({ROPE.SCALING_TYPE: "none", ROPE.SCALING_FACTOR: 4.0}, None, "'none' with a factor"),
    ({ROPE.SCALING_TYPE: "yarn", ROPE.SCALING_FACTOR: 4.0, ROPE.SCALING_ATTN_FACTOR: 0.5}, None, "attn_factor"),
    ({ROPE.SCALING_TYPE: "linear", ROPE.SCALING_FACTOR: 2.0}, np.full(HEAD_DIM // 2, 2.0), "both rope_freqs"),
    ({ROPE.SCALING_FACTOR: 2.0}, np.full(HEAD_DIM // 2, 2.0), "both rope_freqs"),
    (None, np.ones(HEAD_DIM), "needs 8 positive values"),
    (None, np.zeros(HEAD_DIM // 2), "needs 8 positive values"),
])  # fmt: skip
def test_what_the_runtime_cannot_reproduce_is_refused(tmp_path: Path, meta: dict[str, Any] | None,
                                                      freqs: np.ndarray | None, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        _config(_write(tmp_path / "bad.gguf", meta, rope_freqs=freqs))


def test_rope_freqs_with_a_rope_scaling_in_one_config_is_refused() -> None:
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                         rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_freqs=[2.0] * (HEAD_DIM // 2))
    with pytest.raises(ModelLoadError, match="rope_freqs and a 'linear'"):
        rotary_tables(config, 4)


@needs_kernels
def test_a_user_rope_scaling_replaces_the_ggufs_own(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """load_model(rope_scaling=...) wins over a GGUF's own scaling or rope_freqs, as over an HF config's, and
    says so; the two are never stacked."""
    from decoding.runtime.loader import LoadOptions, load_model

    tokenizer = make_tokenizer()
    scaling = {"rope_type": "linear", "factor": 2.0}
    for name, meta, freqs in (("l31", None, np.full(HEAD_DIM // 2, 3.0)),
                              ("yarn", {ROPE.SCALING_TYPE: "yarn", ROPE.SCALING_FACTOR: 4.0}, None)):
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "m.gguf", meta, rope_freqs=freqs, vocab=len(tokenizer))
        tokenizer.save_pretrained(tmp_path / name)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="decoding.runtime.loader"):
            loaded = load_model(str(tmp_path / name), LoadOptions(rope_scaling=scaling))
        assert "replaces the model's own rope scaling" in caplog.text, name
        config = loaded.model.config
        assert config.rope_scaling == scaling and getattr(config, "rope_freqs", None) is None
        assert loaded.runtime.startswith("cpu-quantized+rope-linearx2@256:") and loaded.max_context == 512
        want = _default_inv_freq(10000.0, HEAD_DIM) / 2.0
        assert torch.allclose(rotary_frequencies(config)[0].double(), want, rtol=1e-6)
        assert torch.equal(loaded.model.cos, rotary_tables(config, 512)[0])


@pytest.mark.real_model
def test_bundled_smollm2_gguf_config_is_unchanged(bundled_gguf_dir: Path) -> None:
    """SmolLM2's GGUF has no rope scaling: its config and rotary tables are the plain ones, as before."""
    (path,) = bundled_gguf_dir.glob("*.gguf")
    config = _config(path)
    assert config.rope_scaling is None and getattr(config, "rope_freqs", None) is None
    assert "rope_freqs" not in config.to_dict()
    assert (config.max_position_embeddings, config.rope_theta, config.head_dim) == (8192, 100000.0, 64)
    inv, scale = rotary_frequencies(config)
    assert scale == 1.0
    assert torch.equal(inv, 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).to(torch.float) / 64)))


def test_the_torch_runtime_gets_a_ggufs_rope_scaling_or_refuses_it(tmp_path: Path) -> None:
    """transformers' GGUF reader drops the rope scaling: the torch runtime (GPU, or cpu_quant none) gets the
    GGUF's linear / yarn scaling written into its config, and a rope_freqs GGUF is refused, never run unscaled."""
    from decoding.runtime.loader import LoadOptions, load_model

    tokenizer = make_tokenizer()
    cases = (("plain", None, None), ("linear", {ROPE.SCALING_TYPE: "linear", ROPE.SCALING_FACTOR: 2.0}, None),
             ("yarn", {ROPE.SCALING_TYPE: "yarn", ROPE.SCALING_FACTOR: 4.0}, None),
             ("l31", None, np.full(HEAD_DIM // 2, 3.0)))
    for name, meta, freqs in cases:
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "m.gguf", meta, rope_freqs=freqs, vocab=len(tokenizer))
        tokenizer.save_pretrained(tmp_path / name)
    assert load_model(str(tmp_path / "plain"), LoadOptions(cpu_quant="none")).model.config.rope_scaling is None
    linear = load_model(str(tmp_path / "linear"), LoadOptions(cpu_quant="none")).model.module  # the HF model
    assert linear.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    want = _default_inv_freq(10000.0, HEAD_DIM) / 2.0
    assert torch.allclose(linear.model.rotary_emb.inv_freq.double(), want, rtol=1e-6)  # what the model runs
    yarn = load_model(str(tmp_path / "yarn"), LoadOptions(cpu_quant="none")).model.config.rope_scaling
    assert yarn["rope_type"] == "yarn" and yarn["factor"] == 4.0
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_model(str(tmp_path / "l31"), LoadOptions(cpu_quant="none"))
