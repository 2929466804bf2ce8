"""The quantized CPU runtime's weights (``LlamaWeights``): read from a GGUF file as stored, or quantized from a loaded
transformers model, and the check that the runtime can run an architecture at all.

A GGUF file's tensors are used as stored, each in its own type (``GGUF_AS_STORED``: the K-quants Q4_K, Q5_K, Q6_K;
the 32-weight blocks Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; IQ4_NL, IQ4_XS; and F16, BF16, F32): the kernels read every one
of them, so nothing is dequantized or requantized at load, and a file holding a type they lack (Q2_K, Q3_K, the
other IQ types, ...) is refused at load naming the tensor and its type. Fused matrices (q/k/v, gate/up) whose parts
a file stores in different types (a Q4_K_M's Q6_K attn_v beside Q4_K q and k) stay as stored too: a parts matrix
(``quant.join_rows``), each part computed in its own format. Its q / k rows are put back in transformers' order
(llama.cpp permutes them for its RoPE). A transformers model's linear layers are quantized to the requested format,
its embedding and LM head to Q8_0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig

from decoding.errors import ModelFileError, ModelLoadError
from decoding.runtime.quant import QuantMatrix, WeightType, join_rows, quantize


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
    source: str  # "gguf:Q4_K+Q6_K+Q8_0" (the formats held; "+F16>Q8_0": F16 held as Q8_0) or "quantized:q8_0"

    @property
    def nbytes(self) -> int:
        mats = [self.embed, *(m for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down))]
        if self.head is not self.embed:
            mats.append(self.head)
        return sum(m.nbytes for m in mats) + 4 * self.norm.numel() * (2 * len(self.layers) + 1)


# ---- shapes the kernels accept ------------------------------------------------------------------------


def llama_dims(config: PretrainedConfig) -> tuple[int, int, int, int, int]:
    e = int(config.hidden_size)
    h = int(config.num_attention_heads)
    g = int(getattr(config, "num_key_value_heads", None) or h)
    d = int(getattr(config, "head_dim", None) or e // h)
    return e, h, g, d, int(config.intermediate_size)


def check_supported(config: PretrainedConfig) -> None:
    """Raise ``ModelFileError`` (saying why) unless the quantized CPU runtime can run this architecture."""
    kind = getattr(config, "model_type", "")
    if kind not in ("llama", "mistral", "qwen2"):
        raise ModelFileError(f"the quantized CPU runtime runs Llama-family models, not {kind!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelFileError(f"the quantized CPU runtime needs a SiLU MLP, not {config.hidden_act!r}")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise ModelFileError("the quantized CPU runtime has no sliding-window attention")
    if getattr(config, "mlp_bias", False) or (kind != "qwen2" and getattr(config, "attention_bias", False)):
        raise ModelFileError("the quantized CPU runtime supports q/k/v biases only (Qwen2)")
    rope = getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        raise ModelFileError("the quantized CPU runtime needs rotary frequencies fixed at load (no dynamic RoPE)")
    e, h, g, d, i = llama_dims(config)
    if e % 32 or i % 32 or (h * d) % 32 or d % 8 or d > 256 or h % g:
        raise ModelFileError(f"shapes not supported by the quantized kernels (hidden {e}, head dim {d}, ffn {i})")


# ---- weights from a GGUF file ---------------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.parts[f.data[0]]
    if value.dtype == np.uint8 and len(f.types) and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value.tolist()[0] if value.size == 1 else value.tolist()


def _required(reader: Any, key: str) -> Any:
    """A metadata value the config cannot do without: a GGUF that lacks it is refused by name."""
    value = _field(reader, key)
    if value is None:
        raise ModelFileError(f"the GGUF metadata has no {key}: the file is incomplete or not a model")
    return value


GGUF_ARCHITECTURES = ("llama",)  # the GGUF architectures the quantized CPU runtime reads (gguf_config)


def read_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; a file that is not a GGUF, or one corrupt or cut short, raises
    ``ModelFileError`` saying so. The reader parses the metadata and every tensor's extent when it opens the file
    (the data is memory-mapped, not read), so a truncated download is caught here, not by a reshape deep inside the
    load. Its parser fails on bad bytes with whatever numpy raises (a bad magic or enum value: ValueError; a read
    past the end: IndexError, or ValueError from a short view), hence the kinds caught."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as exc:
        raise ModelFileError(f"cannot read the GGUF file {path}: it is corrupt, truncated or not a GGUF file "
                             f"({type(exc).__name__}: {exc})") from exc


def gguf_config(reader: Any) -> LlamaConfig:
    """A transformers ``LlamaConfig`` from a GGUF file's metadata (Llama architecture), its rope scaling included
    (``gguf_rope``)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"GGUF architecture {arch!r} is not supported by the quantized CPU runtime (supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)})")
    a = f"{arch}."
    heads = int(_required(reader, a + "attention.head_count"))
    hidden = int(_required(reader, a + "embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, a + "vocab_size", len(tokens.data) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    head_dim = int(_field(reader, a + "attention.key_length", hidden // heads))
    context = int(_required(reader, a + "context_length"))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_required(reader, a + "feed_forward_length")),
        num_hidden_layers=int(_required(reader, a + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, a + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=context,
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, a + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        **gguf_rope(reader, arch, head_dim, context),
    )


# llama.cpp rope keys (gguf's Keys.Rope, under "<arch>.") the runtime has no counterpart for: a GGUF may carry
# them only at their neutral values (llama.cpp's defaults), any other value is refused rather than ignored
_NEUTRAL_ROPE_KEYS = {
    "rope.scaling.attn_factor": (1.0,),
    "rope.scaling.yarn_attn_factor": (1.0,),
    "rope.scaling.yarn_ext_factor": (-1.0, 1.0),  # -1: llama.cpp's "1 for yarn"
    "rope.scaling.yarn_log_multiplier": (0.0,),
}


def _short(value: float) -> float:
    """A float32 metadata value as its shortest decimal (4.0, 1.33), as a model card would write it."""
    return float(str(np.float32(value)))


def gguf_rope(reader: Any, arch: str, head_dim: int, context: int) -> dict[str, Any]:
    """The ``LlamaConfig`` keywords for a GGUF's rotary scaling: ``rope_scaling`` and / or ``rope_freqs``.

    ``<arch>.rope.scaling.type`` "linear" / "yarn" (absent with a factor: linear, llama.cpp's default) with a
    factor other than 1 become transformers' linear / yarn scaling; yarn's original window is the GGUF's
    ``original_context_length`` (else its context length, as llama.cpp takes it), and
    ``max_position_embeddings`` stays the GGUF's context length (the positions the model supports).
    A ``rope_freqs.weight`` tensor (Llama-3.1: llama.cpp divides rotary frequency i by ``rope_freqs[i]``) becomes
    ``config.rope_freqs``, a list of D/2 floats that ``decoding.runtime.cpu_llama.rotary_tables`` divides its default
    inverse frequencies by. Anything the runtime would not reproduce (another type, both at once, a yarn knob
    away from its default) raises ``ModelLoadError``: a wrong rope gives fluent, wrong output past short contexts.
    """
    a = f"{arch}."
    kind = str(_field(reader, a + "rope.scaling.type", "")).lower()
    factor = _field(reader, a + "rope.scaling.factor", _field(reader, a + "rope.scale_linear"))
    factor = None if factor in (None, 0.0, 1.0) else _short(factor)  # 0 / 1: no scaling to llama.cpp too
    if kind not in ("", "none", "linear", "yarn"):
        raise ModelLoadError(f"GGUF rope scaling type {kind!r}: the quantized CPU runtime runs none, linear, yarn")
    if kind == "none" and factor is not None:
        raise ModelLoadError(f"GGUF rope scaling type 'none' with a factor of {factor}: which one holds is unclear")
    out: dict[str, Any] = {}
    if kind in ("", "linear") and factor is not None:
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn" and factor is not None:
        original = int(_field(reader, a + "rope.scaling.original_context_length", context))
        yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = _field(reader, a + "rope.scaling." + key)
            if value is not None:
                yarn[name] = _short(value)
        out["rope_scaling"] = yarn
    for key, neutral in _NEUTRAL_ROPE_KEYS.items():
        value = _field(reader, a + key)
        if value is not None and _short(value) not in neutral:
            raise ModelLoadError(f"GGUF {a + key} = {_short(value)}: the quantized CPU runtime has no such knob")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if "rope_scaling" in out:
            raise ModelLoadError(f"GGUF with both rope_freqs.weight and a {out['rope_scaling']['rope_type']} rope "
                                 "scaling: llama.cpp would apply both, the runtime applies one")
        if values.size != head_dim // 2 or not np.all(np.isfinite(values) & (values > 0)):
            raise ModelLoadError(f"GGUF rope_freqs.weight needs {head_dim // 2} positive values (head dim "
                                 f"{head_dim}), not {values.size}")
        out["rope_freqs"] = values.tolist()
    return out


GGUF_AS_STORED = {kind.name: kind for kind in WeightType if kind != WeightType.PARTS}  # every type the kernels read


def _gguf_rows(path: Path, tensor: Any, order: np.ndarray | None = None) -> tuple[WeightType, np.ndarray]:
    """A GGUF weight's type and its rows as stored (uint8 ``[rows, bytes]``, in ``order`` if given); a type the
    kernels do not read raises ``ModelFileError`` naming the tensor and its type."""
    kind = GGUF_AS_STORED.get(tensor.tensor_type.name)
    if kind is None:
        raise ModelFileError(f"{path.name}: tensor {tensor.name} is {tensor.tensor_type.name}, which the quantized "
                             f"CPU runtime does not read (it reads {', '.join(GGUF_AS_STORED)}); requantize the "
                             "file to one of those (e.g. llama.cpp's llama-quantize to Q4_K_M)")
    raw = np.asarray(tensor.data).view(np.uint8).reshape(int(np.prod(tensor.shape[1:])), -1)
    return kind, raw if order is None else raw[order]


def _gguf_fused(path: Path, parts: list[tuple[Any, np.ndarray | None]]) -> QuantMatrix:
    """GGUF weights' rows one after the other as one matrix (q / k / v, gate / up; or one weight), each kept in its
    own type: neighbours of one type are packed together, once (``join_rows`` keeps runs of different types as the
    parts of one matrix). ``parts``: (tensor, its rows' order or None)."""
    cols = int(parts[0][0].shape[0])  # ggml lists the row length first
    runs: list[tuple[WeightType, list[np.ndarray]]] = []
    for tensor, order in parts:
        kind, raw = _gguf_rows(path, tensor, order)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(raw)
        else:
            runs.append((kind, [raw]))
    return join_rows([QuantMatrix.from_rows(kind, raws[0] if len(raws) == 1 else np.concatenate(raws), cols)
                      for kind, raws in runs])


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """GGUF stores Llama's q / k rows permuted for llama.cpp's RoPE; the row order of transformers' layout."""
    idx = np.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def gguf_torch_config(path: Path) -> Any:
    """The config for transformers' loader of the GGUF at ``path`` with the GGUF's rope scaling written in, or
    None when it has none: transformers reads a GGUF's config without its rope scaling. A Llama-3.1
    ``rope_freqs.weight`` has no transformers config equivalent here, so it is refused, not dropped."""
    from transformers import AutoConfig

    reader = read_gguf(path)
    a = f"{_required(reader, 'general.architecture')}."
    heads = int(_required(reader, a + "attention.head_count"))
    head_dim = int(_field(reader, a + "attention.key_length", int(_required(reader, a + "embedding_length")) // heads))
    own = gguf_rope(reader, a[:-1], head_dim, int(_required(reader, a + "context_length")))
    if "rope_freqs" in own:
        raise ModelLoadError(f"{path.name} carries rope_freqs.weight (Llama-3.1's rope scaling), which transformers' "
                             "GGUF loader drops: serve it on the quantized CPU runtime, load its HF model dir, or "
                             "give its llama3 rope_scaling")
    if not own:
        return None
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.rope_scaling = own["rope_scaling"]
    return config


def weights_from_gguf(path: Path) -> LlamaWeights:
    """Read a Llama GGUF file into ``LlamaWeights``, each tensor as stored in its own type (see the module's
    docstring); a tensor of a type the kernels do not read raises ``ModelFileError``."""
    from gguf import quants

    reader = read_gguf(path)
    config = gguf_config(reader)
    check_supported(config)
    tensors = {t.name: t for t in reader.tensors}
    _, h, g, _, _ = llama_dims(config)

    def part(name: str, heads: int = 0) -> tuple[Any, np.ndarray | None]:
        """``heads``: q / k rows, un-permuted (on the stored bytes: a row's blocks move as they are)."""
        if name not in tensors:
            raise ModelFileError(f"GGUF file {path} has no tensor {name}")
        t = tensors[name]
        return t, _unpermute_rows(int(t.shape[1]), heads) if heads else None

    def mat(*names: str | tuple[str, int]) -> QuantMatrix:
        return _gguf_fused(path, [part(n) if isinstance(n, str) else part(*n) for n in names])

    def vec(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelFileError(f"GGUF file {path} has no tensor {name}")
        t = tensors[name]
        return torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1))

    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=vec(b + "attn_norm.weight"),
            ffn_norm=vec(b + "ffn_norm.weight"),
            qkv=mat((b + "attn_q.weight", h), (b + "attn_k.weight", g), b + "attn_v.weight"),
            o=mat(b + "attn_output.weight"),
            gate_up=mat(b + "ffn_gate.weight", b + "ffn_up.weight"),
            down=mat(b + "ffn_down.weight"),
        ))  # fmt: skip
    embed = mat("token_embd.weight")
    head = embed if config.tie_word_embeddings else mat("output.weight")
    held = {k for m in (embed, head, *(m for lw in layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)))
            for k in m.kinds}
    tag = "+".join(sorted(k.name for k in held))
    return LlamaWeights(config, embed, layers, vec("output_norm.weight"), head, "gguf:" + tag)


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
