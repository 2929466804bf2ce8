"""Tiny models of every family written to GGUF as llama.cpp's converter (``convert_hf_to_gguf.py``) writes them, with
gguf-py's writer: the file's architecture name and metadata keys, its tensor names, and its transforms:

- ``llama`` (Llama, Mistral: MistralModel converts to arch ``llama``): q / k rows permuted for llama.cpp's
  interleaved rope (``LlamaModel.permute``); others rotate halves and are stored as transformers holds them;
  Mixtral (arch ``llama`` too) with ``expert_count`` / ``expert_used_count`` and its experts (``w1`` / ``w3`` /
  ``w2``) stacked as Qwen3-MoE's below;
- ``qwen2``: ``attn_{q,k,v}.bias``; ``qwen3``: ``attn_{q,k}_norm.weight`` [head dim];
- ``gemma2`` / ``gemma3``: every RMSNorm weight stored plus one (the converter adds transformers' ``1 + w``),
  ``post_attention_norm`` / ``post_ffw_norm`` beside ``attn_norm`` / ``ffn_norm`` (the pre-feed-forward norm), no
  ``output.weight`` (tied), ``<arch>.attention.sliding_window``; Gemma 2's ``attn_logit_softcapping`` /
  ``final_logit_softcapping``; Gemma 3's linear rope scaling as ``rope.scaling.type`` / ``factor``;
- ``phi3``: ``attn_qkv.weight`` (q, k, v rows) and ``ffn_up.weight`` (gate rows, then up rows: transformers'
  ``gate_up_proj``), ``rope.dimension_count``, ``attention.sliding_window``;
- ``qwen3moe``: Qwen 3's attention; ``ffn_gate_inp.weight`` (the router, F32) and the experts' matrices stacked as
  3-D tensors ``ffn_{gate,up,down}_exps.weight`` [expert, rows, row], ``expert_count``, ``expert_used_count``,
  ``expert_feed_forward_length``;
- ``olmoe``: ``attn_{q,k}_norm.weight`` across all heads ([heads x head size]), experts as Qwen3-MoE's;
- ``gpt-oss``: the same expert tensors (gate and up split from transformers' interleaved ``gate_up_proj``) with their
  biases, the router's bias, q / k / v / output biases, ``attn_sinks.weight``, the pre-MLP norm as
  ``post_attention_norm``, ``attention.sliding_window``, and the YaRN rope as ``rope.scaling.type`` yarn, ``factor``
  and ``original_context_length``.

2-D weights are stored in ``kind`` (any type gguf-py quantizes), norms and biases F32 as the converter keeps them.
The vocabulary is one of the tokenizer tests' (``vocab``), or none (the tests' tokenizer files beside the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.decoding.conftest import gguf_writer, permute

# transformers model_type -> the converter's architecture
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss",
             "mixtral": "llama", "olmoe": "olmoe"}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def write_family_gguf(path: Path, hf: Any, kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
                      eos: int = 2, bos: int = 1, vocab: str | None = None,
                      experts: gguf.GGMLQuantizationType | None = None) -> Path:
    """``hf`` (a transformers model of a family the runtime runs) as llama.cpp's converter writes it; returns path.
    ``vocab``: one of the test vocabularies (``tests/decoding/runtime/gguf_vocabs.py``) written into the file, its
    tokenizer, chat template and special ids (then ``eos`` / ``bos`` are its). ``experts``: the experts' stacked
    tensors' type where it is not ``kind`` (MXFP4: llama.cpp's MXFP4_MOE mix)."""
    c = hf.config
    arch = GGUF_ARCH[c.model_type]
    gemma = arch.startswith("gemma")
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    if vocab is None:
        w = gguf_writer(path, c, arch, eos, bos)
    else:
        from tests.decoding.runtime.gguf_vocabs import add_vocab

        w = gguf_writer(path, c, arch, eos=None)
        add_vocab(w, vocab)
    window = getattr(c, "sliding_window", None)
    if window and arch != "llama":
        w.add_sliding_window(int(window))
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", float(c.attn_logit_softcapping))
        w.add_float32(f"{arch}.final_logit_softcapping", float(c.final_logit_softcapping))
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
    moe = c.model_type in ("qwen3_moe", "gpt_oss", "mixtral", "olmoe")
    if moe:  # Mixtral's and OLMoE's experts are as wide as feed_forward_length: the converter writes no other
        w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch not in ("llama", "olmoe"):
            w.add_expert_feed_forward_length(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    scaling = getattr(c, "rope_scaling", None)
    if scaling and scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))

    def put(name: str, a: np.ndarray, quantized: bool = True) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        as_type = experts if experts is not None and name.endswith("_exps.weight") else kind
        if not quantized or as_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif as_type == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, as_type), raw_dtype=as_type)

    def norm(name: str, module: Any) -> None:
        put(name, _np(module.weight) + (1.0 if gemma else 0.0), quantized=False)

    inner = hf.model
    put("token_embd.weight", _np(inner.embed_tokens.weight))
    for i, layer in enumerate(inner.layers):
        mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe  # Mixtral's
        b, at = f"blk.{i}.", layer.self_attn
        norm(b + "attn_norm.weight", layer.input_layernorm)
        if gemma:
            norm(b + "post_attention_norm.weight", layer.post_attention_layernorm)
            norm(b + "ffn_norm.weight", layer.pre_feedforward_layernorm)
            norm(b + "post_ffw_norm.weight", layer.post_feedforward_layernorm)
        else:  # gpt-oss's pre-MLP norm under llama.cpp's name for a post-attention norm
            norm(b + ("post_attention_norm" if arch == "gpt-oss" else "ffn_norm") + ".weight",
                 layer.post_attention_layernorm)
        if arch == "phi3":
            put(b + "attn_qkv.weight", _np(at.qkv_proj.weight))
            put(b + "ffn_up.weight", _np(mlp.gate_up_proj.weight))
        else:
            q, k = _np(at.q_proj.weight), _np(at.k_proj.weight)
            if arch == "llama":  # for llama.cpp's interleaved rope
                q = permute(at.q_proj.weight, c.num_attention_heads)
                k = permute(at.k_proj.weight, c.num_key_value_heads)
            put(b + "attn_q.weight", q)
            put(b + "attn_k.weight", k)
            put(b + "attn_v.weight", _np(at.v_proj.weight))
            if arch in ("qwen3moe", "olmoe") or c.model_type == "mixtral":
                put(b + "ffn_gate_inp.weight", _np(mlp.gate.weight), quantized=False)
                projs = ("w1", "w3", "w2") if c.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
                for name, proj in zip(("gate", "up", "down"), projs, strict=True):
                    put(b + f"ffn_{name}_exps.weight", np.stack([_np(getattr(x, proj).weight) for x in mlp.experts]))
            elif arch == "gpt-oss":
                _gpt_oss_layer(put, b, at, mlp)
            else:
                put(b + "ffn_gate.weight", _np(mlp.gate_proj.weight))
                put(b + "ffn_up.weight", _np(mlp.up_proj.weight))
            if arch == "qwen2":
                for x in "qkv":
                    put(b + f"attn_{x}.bias", _np(getattr(at, f"{x}_proj").bias), quantized=False)
        if hasattr(at, "q_norm"):
            norm(b + "attn_q_norm.weight", at.q_norm)
            norm(b + "attn_k_norm.weight", at.k_norm)
        put(b + "attn_output.weight", _np(at.o_proj.weight))
        if not moe:
            put(b + "ffn_down.weight", _np(mlp.down_proj.weight))
    norm("output_norm.weight", inner.norm)
    if not c.tie_word_embeddings:
        put("output.weight", _np(hf.lm_head.weight))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gpt_oss_layer(put: Any, b: str, at: Any, mlp: Any) -> None:
    """gpt-oss's tensors beyond q / k / v, as the converter writes an unquantized checkpoint (``GptOssModel``):
    q / k / v / output biases, ``attn_sinks.weight``, the router (F32) and its bias, the experts' interleaved
    ``gate_up_proj`` [N, E, 2J] split into gate (even columns) and up (odd) stacks [N, J, E], ``down_proj`` [N, J, E]
    as [N, E, J], and their biases [N, J] / [N, E] (F32)."""
    for x in "qkv":
        put(b + f"attn_{x}.bias", _np(getattr(at, f"{x}_proj").bias), quantized=False)
    put(b + "attn_output.bias", _np(at.o_proj.bias), quantized=False)
    put(b + "attn_sinks.weight", _np(at.sinks), quantized=False)
    put(b + "ffn_gate_inp.weight", _np(mlp.router.weight), quantized=False)
    put(b + "ffn_gate_inp.bias", _np(mlp.router.bias), quantized=False)
    ex = mlp.experts
    gate_up, bias = _np(ex.gate_up_proj), _np(ex.gate_up_proj_bias)
    put(b + "ffn_gate_exps.weight", gate_up[..., ::2].transpose(0, 2, 1))
    put(b + "ffn_up_exps.weight", gate_up[..., 1::2].transpose(0, 2, 1))
    put(b + "ffn_down_exps.weight", _np(ex.down_proj).transpose(0, 2, 1))
    put(b + "ffn_gate_exps.bias", bias[:, ::2], quantized=False)
    put(b + "ffn_up_exps.bias", bias[:, 1::2], quantized=False)
    put(b + "ffn_down_exps.bias", _np(ex.down_proj_bias), quantized=False)
