"""The quantized CPU runtime's weights (``ModelWeights``): read from a GGUF file as stored, or quantized from a loaded
transformers model, of any family ``decoding.runtime.families`` lists, and the check that the runtime can run a
config at all.

A GGUF file's tensors are used as stored, each in its own type (``GGUF_AS_STORED``: every format of
``decoding.runtime.formats``, the K-quants Q2_K to Q6_K, the 32-weight blocks, IQ4_NL, IQ4_XS, F16, BF16, F32): the
kernels read every one of them, so nothing is dequantized or requantized at load, and a file holding a type they lack
(IQ1, IQ2 and IQ3 types, TQ, ...) is refused at load naming the tensor and its type. Fused matrices (q/k/v, gate/up)
whose parts a file stores in different types (a Q4_K_M's Q6_K attn_v beside Q4_K q and k) stay as stored too: a parts
matrix (``quant.join_rows``), each part computed in its own format. A Llama's q / k rows are put back in transformers'
order (llama.cpp permutes them for its RoPE); norms are used as stored (Gemma's hold w + 1). A transformers model's
linear layers are quantized to the requested format, its embedding and LM head to Q8_0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig

from decoding.errors import ModelFileError, ModelLoadError
from decoding.runtime.families import Family, common_config, family_of, forward_plan, gguf_family, has_experts
from decoding.runtime.gguf.meta import field, gguf_rope, read_gguf, release_pages, release_range, required
from decoding.runtime.quant import QuantMatrix, WeightType, join_rows, quantize

__all__ = ["LayerWeights", "ModelWeights", "check_supported", "gguf_config", "model_dims", "unpermute_rows",
           "weights_from_gguf", "weights_from_hf"]


@dataclass(frozen=True, eq=False)
class LayerWeights:
    attn_norm: torch.Tensor  # fp32 [E]
    ffn_norm: torch.Tensor  # fp32 [E]
    qkv: QuantMatrix  # [(H + 2G) * D, E]: q heads, then k heads, then v heads (HF rotate-half layout)
    o: QuantMatrix  # [E, H * D]
    gate_up: QuantMatrix | None  # [2I, E]: gate rows, then up rows (None: a mixture of experts instead)
    down: QuantMatrix | None  # [E, I]
    qkv_bias: torch.Tensor | None = None  # fp32 [(H + 2G) * D] (Qwen2)
    q_norm: torch.Tensor | None = None  # fp32 [D]: per-head RMSNorm of q and k before the rope (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # fp32 [E]: the attention's / MLP's output normed (Gemma)
    post_ffn_norm: torch.Tensor | None = None
    router: QuantMatrix | None = None  # [N, E]: a mixture of experts' router (its logits per expert)
    experts_gate: QuantMatrix | None = None  # [N * J, E]: every expert's gate rows, expert e's from row e * J
    experts_up: QuantMatrix | None = None  # [N * J, E]
    experts_down: QuantMatrix | None = None  # [N * E, J]: expert e's from row e * E
    o_bias: torch.Tensor | None = None  # fp32 [E] (gpt-oss)
    sinks: torch.Tensor | None = None  # fp32 [H]: each query head's attention sink logit (gpt-oss)
    router_bias: torch.Tensor | None = None  # fp32 [N] (gpt-oss)
    experts_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # fp32 gate, up [N * J], down [N * E]

    def matrices(self) -> list[QuantMatrix]:
        return [m for m in (self.qkv, self.o, self.gate_up, self.down, self.router, self.experts_gate,
                            self.experts_up, self.experts_down) if m is not None]

    def vectors(self) -> list[torch.Tensor]:
        return [v for v in (self.attn_norm, self.ffn_norm, self.qkv_bias, self.q_norm, self.k_norm,
                            self.post_attn_norm, self.post_ffn_norm, self.o_bias, self.sinks, self.router_bias,
                            *(self.experts_bias or ())) if v is not None]


@dataclass(frozen=True, eq=False)
class ModelWeights:
    config: PretrainedConfig  # a transformers config (of the family's class, from a GGUF file too)
    embed: QuantMatrix  # [V, E]
    layers: list[LayerWeights]
    norm: torch.Tensor  # fp32 [E]
    head: QuantMatrix  # [V, E] (the embedding itself when tied)
    source: str  # "gguf:Q4_K+Q6_K+Q8_0" (the formats held; "+F16>Q8_0": F16 held as Q8_0) or "quantized:q8_0"

    @property
    def nbytes(self) -> int:
        mats = [self.embed, *(m for lw in self.layers for m in lw.matrices())]
        if self.head is not self.embed:
            mats.append(self.head)
        return sum(m.nbytes for m in mats) + 4 * (self.norm.numel() + sum(v.numel() for lw in self.layers
                                                                            for v in lw.vectors()))


# ---- shapes the kernels accept ------------------------------------------------------------------------


def model_dims(config: PretrainedConfig) -> tuple[int, int, int, int, int]:
    e = int(config.hidden_size)
    h = int(config.num_attention_heads)
    g = int(getattr(config, "num_key_value_heads", None) or h)
    d = int(getattr(config, "head_dim", None) or e // h)
    return e, h, g, d, int(config.intermediate_size)


def check_supported(config: PretrainedConfig) -> Family:
    """The family running ``config``, or ``ModelFileError`` saying why the quantized CPU runtime cannot run it."""
    family = family_of(config)
    forward_plan(config)  # its activation
    if getattr(config, "mlp_bias", False) or (not family.qkv_bias and getattr(config, "attention_bias", False)):
        raise ModelFileError("the quantized CPU runtime supports q/k/v biases only (Qwen2)")
    if getattr(config, "clip_qkv", None) is not None:
        raise ModelFileError("the quantized CPU runtime does not clip q / k / v (OLMoE's clip_qkv)")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ModelFileError("the quantized CPU runtime rotates whole heads (no partial_rotary_factor)")
    rope = getattr(config, "rope_scaling", None) or {}
    if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
        raise ModelFileError("the quantized CPU runtime needs rotary frequencies fixed at load (no dynamic RoPE)")
    e, h, g, d, i = model_dims(config)
    if e % 32 or i % 32 or (h * d) % 32 or d % 8 or d > 256 or h % g:
        raise ModelFileError(f"shapes not supported by the quantized kernels (hidden {e}, head dim {d}, ffn {i})")
    return family


# ---- weights from a GGUF file ---------------------------------------------------------------------------


def gguf_config(reader: Any) -> PretrainedConfig:
    """A transformers config of the file's family (``decoding.runtime.families``) from a GGUF file's metadata, its
    rope scaling included (``gguf.meta.gguf_rope``); an architecture the runtime does not run raises
    ``ModelFileError`` naming it and the ones it runs."""
    family = gguf_family(reader)
    return family.config(reader, common_config(reader, family.gguf_arch))


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


def _gguf_fused(path: Path, parts: list[tuple[Any, np.ndarray | None]], reader: Any = None) -> QuantMatrix:
    """GGUF weights' rows one after the other as one matrix (q / k / v, gate / up; or one weight), each kept in its
    own type: neighbours of one type are packed together, once (``join_rows`` keeps runs of different types as the
    parts of one matrix). ``parts``: (tensor, its rows' order or None). One tensor read in its own order (an
    expert stack, an LM head) drops its file pages (``reader``'s mapping) as its rows are packed, so its load holds
    the packed rows and one chunk of the file's, not the whole tensor twice."""
    cols = int(parts[0][0].shape[0])  # ggml lists the row length first
    if len(parts) == 1 and parts[0][1] is None and reader is not None:
        tensor = parts[0][0]
        kind, raw = _gguf_rows(path, tensor, None)
        width, at = raw.shape[1], int(tensor.data_offset)
        return QuantMatrix.from_rows(kind, raw, cols, lambda r0, r1: release_range(reader, at + r0 * width,
                                                                                  (r1 - r0) * width))
    runs: list[tuple[WeightType, list[np.ndarray]]] = []
    for tensor, order in parts:
        kind, raw = _gguf_rows(path, tensor, order)
        if runs and runs[-1][0] == kind:
            runs[-1][1].append(raw)
        else:
            runs.append((kind, [raw]))
    return join_rows([QuantMatrix.from_rows(kind, raws[0] if len(raws) == 1 else np.concatenate(raws), cols)
                      for kind, raws in runs])


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """GGUF stores Llama's q / k rows permuted for llama.cpp's RoPE; the row order of transformers' layout."""
    idx = np.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def gguf_torch_config(path: Path) -> Any:
    """The config for transformers' loader of the GGUF at ``path`` with the GGUF's rope scaling written in, or
    None when it has none: transformers reads a GGUF's config without its rope scaling. A Llama-3.1
    ``rope_freqs.weight`` has no transformers config equivalent here, so it is refused, not dropped."""
    from transformers import AutoConfig

    reader = read_gguf(path)
    a = f"{required(reader, 'general.architecture')}."
    heads = int(required(reader, a + "attention.head_count"))
    head_dim = int(field(reader, a + "attention.key_length", int(required(reader, a + "embedding_length")) // heads))
    own = gguf_rope(reader, a[:-1], head_dim, int(required(reader, a + "context_length")))
    if "rope_freqs" in own:
        raise ModelLoadError(f"{path.name} carries rope_freqs.weight (Llama-3.1's rope scaling), which transformers' "
                             "GGUF loader drops: serve it on the quantized CPU runtime, load its HF model dir, or "
                             "give its llama3 rope_scaling")
    if not own:
        return None
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.rope_scaling = own["rope_scaling"]
    return config


def weights_from_gguf(path: Path) -> ModelWeights:
    """Read a GGUF file of any family the runtime runs into ``ModelWeights``, each tensor as stored in its own type
    (see the module's docstring); a tensor of a type the kernels do not read raises ``ModelFileError``."""
    from gguf import quants

    reader = read_gguf(path)
    config = gguf_config(reader)
    family = check_supported(config)
    tensors = {t.name: t for t in reader.tensors}
    _, h, g, _, _ = model_dims(config)
    moe = has_experts(config)

    def tensor(name: str) -> Any:
        if name not in tensors:
            raise ModelFileError(f"GGUF file {path} has no tensor {name} (a {family.gguf_arch} layer holds one)")
        return tensors[name]

    def part(name: str, heads: int = 0) -> tuple[Any, np.ndarray | None]:
        """``heads``: q / k rows, un-permuted (on the stored bytes: a row's blocks move as they are)."""
        t = tensor(name)
        return t, unpermute_rows(int(t.shape[1]), heads) if heads and family.permuted_qk else None

    def mat(*names: str | tuple[str, int]) -> QuantMatrix:
        parts = [part(n) if isinstance(n, str) else part(*n) for n in names]
        matrix = _gguf_fused(path, parts, reader)
        for tensor, _ in parts:  # packed: the file's pages of it are not needed any more
            release_pages(reader, tensor)
        return matrix

    def vec(name: str) -> torch.Tensor:
        t = tensor(name)
        return torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1))

    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        experts: dict[str, Any] = {}
        gate_up = down = None
        if family.fused:  # Phi-3: q, k, v rows in one tensor; gate and up rows in ffn_up
            qkv, gate_up = mat(b + "attn_qkv.weight"), mat(b + "ffn_up.weight")
        else:
            qkv = mat((b + "attn_q.weight", h), (b + "attn_k.weight", g), b + "attn_v.weight")
        if moe:  # the router, then every expert's matrices stacked (3-D tensors: expert, rows, row)
            experts = {"router": mat(b + "ffn_gate_inp.weight"), "experts_gate": mat(b + "ffn_gate_exps.weight"),
                       "experts_up": mat(b + "ffn_up_exps.weight"), "experts_down": mat(b + "ffn_down_exps.weight")}
        else:
            gate_up = gate_up or mat(b + "ffn_gate.weight", b + "ffn_up.weight")
            down = mat(b + "ffn_down.weight")
        bias = (torch.cat([vec(b + f"attn_{x}.bias") for x in "qkv"]) if family.qkv_bias else None)
        extra: dict[str, Any] = {}
        if family.biases:  # gpt-oss: the output projection's, the router's and the experts' (stacked by expert)
            extra = {"o_bias": vec(b + "attn_output.bias"), "router_bias": vec(b + "ffn_gate_inp.bias"),
                     "experts_bias": tuple(vec(b + f"ffn_{x}_exps.bias") for x in ("gate", "up", "down"))}
        if family.sinks:
            extra["sinks"] = vec(b + "attn_sinks.weight")
        layers.append(LayerWeights(
            attn_norm=vec(b + "attn_norm.weight"),
            ffn_norm=vec(b + family.ffn_norm_tensor + ".weight"),
            qkv=qkv,
            o=mat(b + "attn_output.weight"),
            gate_up=gate_up,
            down=down,
            qkv_bias=bias,
            q_norm=vec(b + "attn_q_norm.weight") if family.qk_norm else None,
            k_norm=vec(b + "attn_k_norm.weight") if family.qk_norm else None,
            post_attn_norm=vec(b + "post_attention_norm.weight") if family.post_norms else None,
            post_ffn_norm=vec(b + "post_ffw_norm.weight") if family.post_norms else None,
            **experts, **extra,
        ))  # fmt: skip
    embed = mat("token_embd.weight")
    head = embed if config.tie_word_embeddings else mat("output.weight")
    held = {k for m in (embed, head, *(m for lw in layers for m in lw.matrices())) for k in m.kinds}
    tag = "+".join(sorted(k.name for k in held))
    return ModelWeights(config, embed, layers, vec("output_norm.weight"), head, "gguf:" + tag)


# ---- weights from a transformers model --------------------------------------------------------------------


def weights_from_hf(model: Any, kind: WeightType) -> ModelWeights:
    """Quantize a loaded transformers model of a family the runtime runs: linear layers to ``kind``, embedding /
    head Q8_0 (F32 when ``kind`` is), norms as the runtime multiplies by them (Gemma's w + 1)."""
    config = model.config
    family = check_supported(config)
    inner = model.model

    def q(t: torch.Tensor, k: WeightType = kind) -> QuantMatrix:
        return quantize(t, k)

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.float32).contiguous().clone()

    def norm(module: Any) -> torch.Tensor:
        return f32(module.weight) + family.norm_offset

    layers = []
    for layer in inner.layers:
        at, mlp = layer.self_attn, getattr(layer, "mlp", None) or layer.block_sparse_moe  # Mixtral: the latter
        experts: dict[str, Any] = _hf_experts(mlp, family, q, f32) if has_experts(config) else {}
        if family.fused:
            qkv, gate_up, bias = at.qkv_proj.weight, mlp.gate_up_proj.weight, None
        else:
            qkv = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight])
            gate_up = None if experts else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            bias = None
            if at.q_proj.bias is not None:
                bias = f32(torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]))
        post = family.post_norms
        layers.append(LayerWeights(
            attn_norm=norm(layer.input_layernorm),
            ffn_norm=norm(layer.pre_feedforward_layernorm if post else layer.post_attention_layernorm),
            qkv=q(qkv),
            o=q(at.o_proj.weight),
            gate_up=None if gate_up is None else q(gate_up),
            down=None if experts else q(mlp.down_proj.weight),
            qkv_bias=bias,
            q_norm=norm(at.q_norm) if family.qk_norm else None,
            k_norm=norm(at.k_norm) if family.qk_norm else None,
            post_attn_norm=norm(layer.post_attention_layernorm) if post else None,
            post_ffn_norm=norm(layer.post_feedforward_layernorm) if post else None,
            o_bias=f32(at.o_proj.bias) if family.biases else None,
            sinks=f32(at.sinks) if family.sinks else None,
            **experts,
        ))  # fmt: skip
    outer = WeightType.F32 if kind == WeightType.F32 else WeightType.Q8_0  # F32: the model unquantized (tests)
    embed = q(inner.embed_tokens.weight, outer)
    out = model.get_output_embeddings().weight
    tied = out.data_ptr() == inner.embed_tokens.weight.data_ptr()
    head = embed if tied else q(out, outer)
    return ModelWeights(config, embed, layers, norm(inner.norm), head, f"quantized:{kind.name.lower()}")


def _hf_experts(mlp: Any, family: Family, q: Any, f32: Any) -> dict[str, Any]:
    """A transformers mixture of experts' router (kept in fp32, as llama.cpp's converter keeps ffn_gate_inp) and its
    experts' matrices stacked by expert: Qwen3-MoE's and Mixtral's expert modules, or gpt-oss's 3-D parameters
    (``gate_up_proj`` [N, E, 2J], gate and up columns interleaved; ``down_proj`` [N, J, E]) with the router's and
    experts' biases."""
    if not family.biases:  # Qwen3-MoE's gate / up / down_proj, Mixtral's w1 / w3 / w2
        names = ("gate_proj", "up_proj", "down_proj") if hasattr(mlp.experts[0], "gate_proj") else ("w1", "w3", "w2")
        stacks = [q(torch.cat([getattr(x, name).weight for x in mlp.experts])) for name in names]
        return {"router": q(mlp.gate.weight, WeightType.F32), "experts_gate": stacks[0], "experts_up": stacks[1],
                "experts_down": stacks[2]}
    ex = mlp.experts
    gate_up, down = ex.gate_up_proj.detach(), ex.down_proj.detach()  # [N, E, 2J], [N, J, E]
    n, e, j = gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2

    def rows(t: torch.Tensor) -> torch.Tensor:  # [N, K, R] (x @ t) -> the stacked weight rows [N * R, K]
        return t.transpose(1, 2).reshape(-1, t.shape[1])

    return {"router": q(mlp.router.weight, WeightType.F32), "router_bias": f32(mlp.router.bias),
            "experts_gate": q(rows(gate_up[..., ::2])), "experts_up": q(rows(gate_up[..., 1::2])),
            "experts_down": q(rows(down)),
            "experts_bias": (f32(ex.gate_up_proj_bias[:, ::2].reshape(n * j)),
                             f32(ex.gate_up_proj_bias[:, 1::2].reshape(n * j)), f32(ex.down_proj_bias.reshape(n * e)))}
