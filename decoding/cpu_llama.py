"""The CPU target runtime: a lean Llama forward on quantized weights, over ragspec's batch-invariant kernels.

gpt-fast style: the model is a list of layer weights and one short forward,

    embed (dequantized rows) -> [rs_layer: norm, fused qkv, rope + KV store, attention, o, norm, fused
    gate/up, silu * up, down] x layers -> rs_head: final norm + LM head

where each ``rs_layer`` is one call into ``decoding/kernels/quant_kernels.c`` running one OpenMP parallel
region: no per-op Python, no transformers module tree on the hot path. Weights stay in their GGUF block
formats (``decoding.quant``): a GGUF file is used as stored, a safetensors model is quantized at load.

It answers the same call as a transformers causal LM (``input_ids``, ``position_ids``, an additive tree mask,
a ``SlotCache`` as ``past_key_values``, ``logits_to_keep``), so the engine drives it like any target. Every
output element is computed by the same operations whatever the number of rows in the forward (see the C
file), so a draft-tree node's logits equal its logits decoded alone, bit for bit, at any thread count.
Supported: Llama-family decoders (Llama, Mistral without a sliding window, Qwen2 with its q/k/v biases),
SiLU MLP, RMSNorm, rotary embeddings whose frequencies do not depend on the sequence length.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig

from decoding import kernels
from decoding.attention import _visibility
from decoding.errors import ModelLoadError
from decoding.kv_cache import SlotCache
from decoding.quant import QuantMatrix, WeightType, quantize, stack_rows

logger = logging.getLogger(__name__)

CHUNK_ROWS = 128  # rows per kernel forward: longer causal inputs (prefill) run in chunks of this size


@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_norm: torch.Tensor  # fp32 [E]
    ffn_norm: torch.Tensor  # fp32 [E]
    qkv: QuantMatrix  # [(H + 2G) * D, E]: q heads, then k heads, then v heads (HF rotate-half layout)
    o: QuantMatrix  # [E, H * D]
    gate_up: QuantMatrix  # [2I, E]: gate rows, then up rows
    down: QuantMatrix  # [E, I]
    qkv_bias: torch.Tensor | None = None  # fp32 [(H + 2G) * D] (Qwen2)


@dataclass(frozen=True, eq=False)
class LlamaWeights:
    config: PretrainedConfig  # a transformers config (LlamaConfig from a GGUF file)
    embed: QuantMatrix  # [V, E]
    layers: list[LayerWeights]
    norm: torch.Tensor  # fp32 [E]
    head: QuantMatrix  # [V, E] (the embedding itself when tied)
    source: str  # e.g. "gguf:Q4_1" or "quantized:q8_0"

    @property
    def nbytes(self) -> int:
        mats = [self.embed, *(m for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down))]
        if self.head is not self.embed:
            mats.append(self.head)
        return sum(m.nbytes for m in mats) + 4 * self.norm.numel() * (2 * len(self.layers) + 1)


# ---- shapes the kernels accept ------------------------------------------------------------------------


def _dims(config: PretrainedConfig) -> tuple[int, int, int, int, int]:
    e = int(config.hidden_size)
    h = int(config.num_attention_heads)
    g = int(getattr(config, "num_key_value_heads", None) or h)
    d = int(getattr(config, "head_dim", None) or e // h)
    return e, h, g, d, int(config.intermediate_size)


def check_supported(config: PretrainedConfig) -> None:
    """Raise ``ModelLoadError`` (saying why) unless the quantized CPU runtime can run this architecture."""
    kind = getattr(config, "model_type", "")
    if kind not in ("llama", "mistral", "qwen2"):
        raise ModelLoadError(f"the quantized CPU runtime runs Llama-family models, not {kind!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"the quantized CPU runtime needs a SiLU MLP, not {config.hidden_act!r}")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise ModelLoadError("the quantized CPU runtime has no sliding-window attention")
    if getattr(config, "mlp_bias", False) or (kind != "qwen2" and getattr(config, "attention_bias", False)):
        raise ModelLoadError("the quantized CPU runtime supports q/k/v biases only (Qwen2)")
    rope = getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        raise ModelLoadError("the quantized CPU runtime needs rotary frequencies fixed at load (no dynamic RoPE)")
    e, h, g, d, i = _dims(config)
    if e % 32 or i % 32 or (h * d) % 32 or d % 8 or d > 256 or h % g:
        raise ModelLoadError(f"shapes not supported by the quantized kernels (hidden {e}, head dim {d}, ffn {i})")


def rotary_tables(config: PretrainedConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[positions, D/2]`` as transformers computes them (fp32, attention scaling applied)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        _, _, _, d, _ = _dims(config)
        base = float(getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float) / d))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]  # [P, D/2]
    return (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()


# ---- ctypes mirrors of the C structs -------------------------------------------------------------------

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _p), ("ffn_norm", _p), ("wqkv", _p), ("wo", _p), ("wgu", _p), ("wdown", _p),
        ("t_qkv", _i), ("t_o", _i), ("t_gu", _i), ("t_down", _i),
        ("ld_qkv", _l), ("ld_o", _l), ("ld_gu", _l), ("ld_down", _l), ("b_qkv", _p),
    ]  # fmt: skip


class _Shape(ctypes.Structure):
    _fields_ = [("E", _i), ("H", _i), ("G", _i), ("D", _i), ("I", _i), ("eps", _f), ("scale", _f)]


class _Scratch(ctypes.Structure):
    _fields_ = [
        ("h", _p), ("qkv", _p), ("q", _p), ("att", _p), ("gu", _p), ("act", _p), ("xd", _p), ("xs", _p),
        ("work", _p), ("xq", _p),
    ]  # fmt: skip


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


def _layer_struct(lw: LayerWeights) -> _Layer:
    return _Layer(
        _addr(lw.attn_norm), _addr(lw.ffn_norm),
        _addr(lw.qkv.data), _addr(lw.o.data), _addr(lw.gate_up.data), _addr(lw.down.data),
        int(lw.qkv.kind), int(lw.o.kind), int(lw.gate_up.kind), int(lw.down.kind),
        lw.qkv.group_bytes, lw.o.group_bytes, lw.gate_up.group_bytes, lw.down.group_bytes, _addr(lw.qkv_bias),
    )  # fmt: skip


class _Buffers:
    """Per-thread scratch for forwards of up to ``rows`` rows; grown on demand."""

    def __init__(self) -> None:
        self.rows = 0
        self.work_floats = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.struct = _Scratch()

    def ensure(self, rows: int, work_floats: int, e: int, qkv: int, hd: int, inter: int) -> _Scratch:
        if rows <= self.rows and work_floats <= self.work_floats:
            return self.struct
        self.rows, self.work_floats = max(rows, self.rows), max(work_floats, self.work_floats)
        r, widest = self.rows, max(e, hd, inter)
        f32 = torch.float32
        t = {
            "h": torch.empty(r * e, dtype=f32), "qkv": torch.empty(r * qkv, dtype=f32),
            "q": torch.empty(r * hd, dtype=f32), "att": torch.empty(r * hd, dtype=f32),
            "gu": torch.empty(r * 2 * inter, dtype=f32), "act": torch.empty(r * inter, dtype=f32),
            "xd": torch.empty(r * widest // 32, dtype=f32), "xs": torch.empty(r * widest // 32, dtype=f32),
            "work": torch.empty(self.work_floats, dtype=f32), "xq": torch.empty(r * widest, dtype=torch.int8),
        }  # fmt: skip
        self.tensors = t
        self.struct = _Scratch(*(_addr(t[field[0]]) for field in _Scratch._fields_))
        return self.struct


class CpuLlama:
    """The target's forward on quantized weights (batch 1, CPU, fp32 activations, fp32 / fp16 KV)."""

    dtype = torch.float32  # activations and logits
    device = torch.device("cpu")

    def __init__(self, weights: LlamaWeights, kv_dtype: torch.dtype = torch.float16) -> None:
        lib = kernels.load()
        if lib is None:
            raise ModelLoadError(f"the quantized CPU runtime needs the CPU kernels: {kernels.unavailable_reason()}")
        if kv_dtype not in (torch.float32, torch.float16):
            raise ModelLoadError(f"KV cache dtype must be float32 or float16, not {kv_dtype}")
        self.lib = lib
        self.weights = weights
        self.config = weights.config
        check_supported(self.config)
        self.kv_dtype = kv_dtype
        self.runtime_tag = f"{weights.source}/kv-{str(kv_dtype).removeprefix('torch.')}"
        e, h, g, d, inter = _dims(self.config)
        self.dims = (e, h, g, d, inter)
        self.vocab = weights.head.rows
        self.max_positions = int(self.config.max_position_embeddings)
        self.cos, self.sin = rotary_tables(self.config, self.max_positions)
        eps = float(getattr(self.config, "rms_norm_eps", 1e-6))
        self.eps = eps
        self.shape = _Shape(e, h, g, d, inter, eps, 1.0 / math.sqrt(d))
        self.layer_structs = [_layer_struct(lw) for lw in weights.layers]
        self._local = threading.local()

    @property
    def num_layers(self) -> int:
        return len(self.weights.layers)

    def _buffers(self) -> _Buffers:
        buf: _Buffers | None = getattr(self._local, "buffers", None)
        if buf is None:
            buf = self._local.buffers = _Buffers()
        return buf

    def __call__(
        self,
        input_ids: torch.Tensor,  # [1, n]
        position_ids: torch.Tensor | None = None,  # [1, n]
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, L + n] additive (a tree) or None (causal)
        past_key_values: SlotCache | None = None,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> SimpleNamespace:
        ids = input_ids.reshape(-1)
        n = ids.numel()
        cache = past_key_values if past_key_values is not None else SlotCache(self.num_layers, n)  # one-off
        start = cache.length
        pos = (position_ids.reshape(-1) if position_ids is not None else torch.arange(start, start + n))
        pos = pos.to(torch.int64).contiguous()
        if int(pos.max()) >= self.max_positions:
            raise ValueError(f"position {int(pos.max())} beyond the model's {self.max_positions}")
        keep = n if not logits_to_keep else min(int(logits_to_keep), n)
        if n == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.weights.embed.rows:
            raise ValueError(f"token ids must be in [0, {self.weights.embed.rows}), got {n} ids")
        x = kernels.dequant_rows(self.lib, self.weights.embed, ids)  # [n, E]
        self._reserve(cache, start + n)
        if attention_mask is not None:
            if n > kernels.MAX_ROWS:
                raise ValueError(f"a tree forward takes at most {kernels.MAX_ROWS} rows, got {n}")
            vis = _visibility(attention_mask, n, start + n)
            if vis is None:
                raise ValueError("CpuLlama takes a causal forward or a 0 / -inf visibility mask, not a bias")
            self._layers(x, pos, cache, start, vis)
        else:
            for c0 in range(0, n, CHUNK_ROWS):
                c1 = min(n, c0 + CHUNK_ROWS)
                vis = _visibility(None, c1 - c0, start + c1)
                assert vis is not None
                self._layers(x[c0:c1], pos[c0:c1], cache, start + c0, vis)
        return SimpleNamespace(logits=self._head(x, keep).unsqueeze(0))

    def _reserve(self, cache: SlotCache, rows: int) -> None:
        _, _, g, d, _ = self.dims
        for layer in cache.slot_layers:
            layer.reserve(g, d, self.kv_dtype, rows)

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, cache: SlotCache, start: int, vis: Any) -> None:
        """Run rows ``x`` [m, E] (positions ``pos``) through every layer, storing their KV at ``start``.."""
        past, path, off = vis
        m = x.shape[0]
        e, h, g, d, inter = self.dims
        max_path = int((off[1:] - off[:-1]).max())
        work = kernels.attention_work_floats(h, m, d, past + max_path)
        scratch = self._buffers().ensure(m, work, e, (h + 2 * g) * d, h * d, inter)
        threads = torch.get_num_threads()
        half = int(self.kv_dtype == torch.float16)
        assert x.is_contiguous(), "rows are updated in place"
        xp, pp, cp, sp = _addr(x), _addr(pos), _addr(self.cos), _addr(self.sin)
        path_p, off_p = _addr(path), _addr(off)
        for layer, lw in zip(cache.slot_layers, self.layer_structs, strict=True):
            kbuf, vbuf = layer.buffers()
            self.lib.rs_layer(
                ctypes.byref(lw), ctypes.byref(self.shape), xp, m, pp, cp, sp,
                _addr(kbuf), _addr(vbuf), kbuf.stride(1), kbuf.stride(2), start, half,
                past, path_p, off_p, ctypes.byref(scratch), threads,
            )  # fmt: skip
            layer.advance(m)

    def _head(self, x: torch.Tensor, keep: int) -> torch.Tensor:
        """Final norm and LM head of the last ``keep`` rows: logits ``[keep, V]``."""
        n, e = x.shape
        head = self.weights.head
        logits = torch.empty(keep, self.vocab, dtype=torch.float32)
        _, h, g, d, inter = self.dims
        scratch = self._buffers().ensure(keep, 0, e, (h + 2 * g) * d, h * d, inter)
        self.lib.rs_head(
            _addr(x), n, keep, e, _addr(self.weights.norm), self.eps, _addr(head.data), int(head.kind),
            head.group_bytes, self.vocab, _addr(logits), ctypes.byref(scratch), torch.get_num_threads(),
        )  # fmt: skip
        return logits


# ---- weights from a GGUF file ---------------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.parts[f.data[0]]
    if value.dtype == np.uint8 and len(f.types) and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value.tolist()[0] if value.size == 1 else value.tolist()


def gguf_config(reader: Any) -> LlamaConfig:
    """A transformers ``LlamaConfig`` from a GGUF file's metadata (Llama architecture)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r}: the quantized CPU runtime reads 'llama' GGUF files")
    a = f"{arch}."
    heads = int(_field(reader, a + "attention.head_count"))
    hidden = int(_field(reader, a + "embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, a + "vocab_size", len(tokens.data) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, a + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, a + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, a + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, a + "attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, a + "context_length")),
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


_GGML_KINDS = {"Q8_0": WeightType.Q8_0, "Q4_1": WeightType.Q4_1}


def _gguf_matrix(tensor: Any, fallback: WeightType) -> QuantMatrix:
    """A GGUF weight as a ``QuantMatrix``: Q8_0 / Q4_1 blocks as stored, anything else requantized."""
    from gguf import quants

    cols = int(tensor.shape[0])  # ggml lists the row length first
    kind = _GGML_KINDS.get(tensor.tensor_type.name)
    if kind is not None:
        return QuantMatrix.from_rows(kind, np.asarray(tensor.data, dtype=np.uint8).reshape(-1, tensor.data.shape[-1]),
                                     cols)
    dense = quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1, cols)
    return quantize(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)), fallback)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """GGUF stores Llama's q / k rows permuted for llama.cpp's RoPE; the row order of transformers' layout."""
    idx = np.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def weights_from_gguf(path: Path, fallback: WeightType = WeightType.Q8_0) -> LlamaWeights:
    """Read a Llama GGUF file into ``LlamaWeights`` without dequantizing its Q8_0 / Q4_1 tensors."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    config = gguf_config(reader)
    check_supported(config)
    tensors = {t.name: t for t in reader.tensors}
    _, h, g, _, _ = _dims(config)

    def mat(name: str) -> QuantMatrix:
        if name not in tensors:
            raise ModelLoadError(f"GGUF file {path} has no tensor {name}")
        return _gguf_matrix(tensors[name], fallback)

    def vec(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(tensors[name].data, dtype=np.float32).reshape(-1))

    def fuse(parts: list[QuantMatrix]) -> QuantMatrix:
        """Fused rows need one block format: a mixed group (e.g. from a K-quant file) is requantized."""
        if len({p.kind for p in parts}) > 1:
            logger.info("requantizing a mixed %s group of %s to %s", [p.kind.name for p in parts], path.name,
                        fallback.name)
            parts = [p if p.kind == fallback else quantize(p.dequantize(), fallback) for p in parts]
        return stack_rows(parts)

    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        q, k = mat(b + "attn_q.weight"), mat(b + "attn_k.weight")
        q = q.select_rows(_unpermute_rows(q.rows, h))
        k = k.select_rows(_unpermute_rows(k.rows, g))
        layers.append(LayerWeights(
            attn_norm=vec(b + "attn_norm.weight"),
            ffn_norm=vec(b + "ffn_norm.weight"),
            qkv=fuse([q, k, mat(b + "attn_v.weight")]),
            o=mat(b + "attn_output.weight"),
            gate_up=fuse([mat(b + "ffn_gate.weight"), mat(b + "ffn_up.weight")]),
            down=mat(b + "ffn_down.weight"),
        ))  # fmt: skip
    embed = mat("token_embd.weight")
    head = embed if config.tie_word_embeddings else mat("output.weight")
    kinds = sorted({tensors[n].tensor_type.name for n in tensors if tensors[n].data.ndim == 2})
    return LlamaWeights(config, embed, layers, vec("output_norm.weight"), head, "gguf:" + "+".join(kinds))


# ---- weights from a transformers model --------------------------------------------------------------------


def weights_from_hf(model: Any, kind: WeightType) -> LlamaWeights:
    """Quantize a loaded transformers Llama-family model: linear layers to ``kind``, embedding / head Q8_0."""
    config = model.config
    check_supported(config)
    inner = model.model

    def q(t: torch.Tensor, k: WeightType = kind) -> QuantMatrix:
        return quantize(t, k)

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.float32).contiguous().clone()

    layers = []
    for layer in inner.layers:
        at, mlp = layer.self_attn, layer.mlp
        bias = None
        if at.q_proj.bias is not None:
            bias = f32(torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]))
        layers.append(LayerWeights(
            attn_norm=f32(layer.input_layernorm.weight),
            ffn_norm=f32(layer.post_attention_layernorm.weight),
            qkv=q(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])),
            o=q(at.o_proj.weight),
            gate_up=q(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=q(mlp.down_proj.weight),
            qkv_bias=bias,
        ))  # fmt: skip
    embed = q(inner.embed_tokens.weight, WeightType.Q8_0)
    out = model.get_output_embeddings().weight
    tied = out.data_ptr() == inner.embed_tokens.weight.data_ptr()
    head = embed if tied else q(out, WeightType.Q8_0)
    return LlamaWeights(config, embed, layers, f32(inner.norm.weight), head, f"quantized:{kind.name.lower()}")
