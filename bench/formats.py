"""Weight formats benchmark: the GGUF formats people download, each served by our quantized CPU runtime and by
llama.cpp from the same file, side by side in one run (issue 43).

    python -m bench.formats [--formats Q4_1 Q4_K_M ...] [--shapes llama-3.2-1b llama-3.2-3b] [--quick]
                            [--repeats N] [--threads 2] [--json PATH] [--cache-dir DIR]

Formats (``--formats``): the bundled SmolLM2-135M-Instruct GGUF as shipped (Q4_1, its embedding Q8_0) and
requantized from it by llama.cpp's own quantizer (``llama_model_quantize``, requantizing allowed: Q4_K_M, Q5_K_M,
Q6_K, Q8_0, Q4_0, IQ4_XS, Q3_K_M, Q2_K; llama.cpp falls back to other types for rows that are not a multiple of 256,
so each file's tensor-type histogram is recorded). Per format, on a ~3.5K-token document (``--context``), with the same
threads: decode tokens/s (fixed length, end of sequence ignored) and cold prefill tokens/s, ours against
llama.cpp's best build here and its AVX2 build (``scripts/build-llama-cpp``), runs interleaved (rep -> runtime)
after one warm-up each, medians and every repetition; the first 32 greedy tokens ours against each build's (equal,
or the first divergence with both runtimes' two largest logits there, so a near-tie shows as one); our runtime tag
(the formats it holds, each read as stored), our served weight MB against the file's
tensor bytes, and resident memory after load (ours: measured in a fresh process). A file our runtime refuses is
recorded as ``{"ours": "refused: <message>"}`` and llama.cpp is still measured on it.

Shapes (``--shapes``): Llama-3.2-1B and -3B shapes with random weights (speed depends on the shape, not the values),
written as F16 GGUF files (the bundled GGUF's tokenizer, padded with reserved tokens to the shape's vocabulary) and
quantized to Q4_K_M by llama.cpp (``shape_dir`` takes another llama_ftype: bench.architectures' gpt-oss is
MXFP4_MOE); decode tokens/s at a 2K-token context (``--shape-context``), ours against llama.cpp, and one cold prefill
each (the first run's time to first token). No greedy comparison: on random weights it means nothing.

Every derived file lives in ``--cache-dir`` (default ``~/.cache/ragspec/bench-formats``) and is reused when there.
``--quick``: a short context, 16 tokens, 1 repetition (the smoke test's mode and a quick look).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch

from bench.common import REPO, DocQA, machine_info, median, out, qa_documents, rss_mb, write_json
from bench.decode_cases import make_cases
from bench.decode_measure import first_mismatch, measure_prefill
from bench.decode_methods import ENGINE_CONFIG, Bench, Case, Run, run_engine, run_llama_cpp
from bench.llama_ref import BUILDS, BUILDS_DIR, LlamaWorker, build_flags, quantize
from decoding.cache.prefix import PrefixCache
from decoding.cache.slot import SlotCache
from decoding.errors import ModelFileError, ModelLoadError
from decoding.runtime.bundled import GGUF_LINK, MARKER_NAME, bundled_gguf_dir
from decoding.runtime.bundled.install import install_bundled
from decoding.runtime.loader import LoadedModel, LoadOptions, load_model
from decoding.speculative.engine import Engine

logger = logging.getLogger("bench.formats")

# format -> the llama_ftype llama.cpp requantizes the bundled file to (None: the bundled file as shipped)
FORMATS: dict[str, str | None] = {
    "Q4_1": None,
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
    "Q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
}
SHAPE_FTYPE = "LLAMA_FTYPE_MOSTLY_Q4_K_M"
DOC = "mpl-2.0"  # a QA document of the benchmark set longer than the contexts used here
GREEDY_TOKENS = 32  # the greedy prefix compared with llama.cpp's


# a Shape field added after files were stamped with the fields before it: left out of the stamp at its default, so
# that those files stay valid (``shape_stamp``)
_LATER = {"stamp": "when set"}


@dataclass(frozen=True)
class Shape:
    """A model's shape: a Llama (tied embeddings) unless ``arch`` names another GGUF architecture the runtime runs
    (``decoding.runtime.families``), whose tensors and metadata keys the file then holds (which tensors a layer
    holds is that family's table, ``shape_tensors``; the numbers and keys are these fields)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context: int = 8192
    rope_theta: float = 500000.0
    arch: str = "llama"  # general.architecture
    tied: bool = True  # no output.weight: the logits read the token embeddings
    sliding_window: int = 0  # <arch>.attention.sliding_window (0: not written)
    attn_softcap: float = 0.0  # Gemma 2's <arch>.attn_logit_softcapping (0: not written)
    final_softcap: float = 0.0  # Gemma 2's <arch>.final_logit_softcapping (0: not written)
    rms_eps: float = 1e-5
    experts: int = 0  # a mixture of experts (Qwen3-MoE, gpt-oss): <arch>.expert_count (0: a dense MLP)
    experts_used: int = 0  # <arch>.expert_used_count
    expert_ffn: int = 0  # <arch>.expert_feed_forward_length
    # <arch>.rope.scaling.type ("yarn", "linear"; "": not written), .factor, .original_context_length (0: not written)
    rope_scaling: str = dataclasses.field(default="", metadata=_LATER)
    rope_scaling_factor: float = dataclasses.field(default=0.0, metadata=_LATER)
    rope_original_context: int = dataclasses.field(default=0, metadata=_LATER)


def shape_stamp(shape: Shape, scale: float) -> str:
    """What a written file is stamped with (``shape_dir``): the shape's fields (those added later only where set)
    and the weights' scale."""
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)
              if f.metadata.get("stamp") != "when set" or getattr(shape, f.name) != f.default}
    return json.dumps({**fields, "scale": scale}, sort_keys=True)


SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ragspec" / "bench-formats"


# ---- files --------------------------------------------------------------------------------------------------


def tensor_types(gguf_path: Path) -> dict[str, Any]:
    """A GGUF file's tensors by type (gguf-py's reader): count and MB per type, and all tensor bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for t in reader.tensors:
        count[t.tensor_type.name] += 1
        size[t.tensor_type.name] += int(t.n_bytes)
    return {
        "count": dict(sorted(count.items())),
        "mb": {k: round(v / 1e6, 2) for k, v in sorted(size.items())},
        "tensor_bytes": sum(size.values()),
    }


def model_gguf(model_dir: Path) -> Path:
    return model_dir / GGUF_LINK


def _with_tokenizer(model_dir: Path, bundled_dir: Path) -> None:
    """The bundled model's tokenizer and generation files beside a GGUF of ours (as the bundled GGUF dir has
    them), so that both runtimes tokenize alike."""
    for f in bundled_dir.iterdir():
        if f.name not in (GGUF_LINK, MARKER_NAME) and f.is_file():
            shutil.copy2(f, model_dir / f.name)


def format_dir(fmt: str, bundled_dir: Path, cache: Path, lib_dir: Path, threads: int) -> Path:
    """The model dir of a format: the bundled one (Q4_1), or the bundled GGUF requantized by llama.cpp into the
    cache (made once)."""
    ftype = FORMATS[fmt]
    if ftype is None:
        return bundled_dir
    model_dir = cache / f"smollm2-135m-instruct-{fmt.lower()}"
    if not model_gguf(model_dir).is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        tmp = model_dir / (GGUF_LINK + ".tmp")
        t = time.perf_counter()
        quantize(lib_dir, model_gguf(bundled_dir).resolve(), tmp, ftype, threads)
        tmp.replace(model_gguf(model_dir))
        logger.info("%s: quantized by llama.cpp in %.0f s", fmt, time.perf_counter() - t)
    _with_tokenizer(model_dir, bundled_dir)
    return model_dir


@dataclass(frozen=True)
class Vocab:
    """A GGUF tokenizer (gpt2 BPE) as llama.cpp reads it from the metadata."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos: int
    eos: int

    def padded(self, size: int) -> Vocab:
        """Padded with reserved control tokens to ``size`` entries (Llama 3's 128256 have 256 of them)."""
        extra = size - len(self.tokens)
        if extra < 0:
            raise ValueError(f"a {len(self.tokens)}-token vocabulary cannot be cut to {size}")
        return dataclasses.replace(self, tokens=[*self.tokens, *(f"<|reserved_{i}|>" for i in range(extra))],
                                   token_types=[*self.token_types, *([3] * extra)])  # 3: llama.cpp's CONTROL

    def fitted(self, size: int) -> Vocab:
        """``size`` entries: padded as ``padded`` does, or cut to the first ``size`` tokens (Phi-3's 32064 under a
        larger vocabulary) with the merges whose parts or result were cut left out, so that every merge still
        joins two tokens into a third, as a BPE vocabulary must."""
        if size >= len(self.tokens):
            return self.padded(size)
        if max(self.bos, self.eos) >= size:
            raise ValueError(f"BOS / EOS ids {self.bos} / {self.eos} do not fit a {size}-token vocabulary")
        kept = set(self.tokens[:size])
        merges = [m for m in self.merges if (parts := m.split(" ", 1)) and len(parts) == 2
                  and parts[0] in kept and parts[1] in kept and parts[0] + parts[1] in kept]
        return dataclasses.replace(self, tokens=self.tokens[:size], token_types=self.token_types[:size], merges=merges)


def vocab_of(gguf_path: Path) -> Vocab:
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    return Vocab(
        tokens=list(fields["tokenizer.ggml.tokens"].contents()),
        token_types=[int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
        merges=list(fields["tokenizer.ggml.merges"].contents()),
        pre=str(fields["tokenizer.ggml.pre"].contents()),
        bos=int(fields["tokenizer.ggml.bos_token_id"].contents()),
        eos=int(fields["tokenizer.ggml.eos_token_id"].contents()),
    )


def shape_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """A shape's tensors as llama.cpp's converter names them for ``shape.arch``: (name, dims as numpy orders them,
    kind: ``norm`` / ``bias`` (F32, as the converter keeps 1-D tensors and biases) / ``router`` (F32: the converter
    keeps a mixture's ``ffn_gate_inp`` so, llama.cpp's quantizer leaves it) / ``matrix``). Which tensors a layer
    holds is the runtime's table of the family (``decoding.runtime.families.Family``: q / k / v biases, per-head q /
    k norms, norms after the attention and the MLP, the pre-MLP norm's name, Phi-3's fused q / k / v and gate / up
    rows, gpt-oss's output / router / expert biases and attention sinks), a mixture of experts where
    ``shape.experts`` is set (as the runtime reads one where a file's expert_count is); llama.cpp's loader checks the
    same file against its own (it refuses a file with a tensor missing or one too many), so the two cannot drift
    apart unnoticed."""
    from decoding.runtime.families import FAMILIES

    family = FAMILIES[shape.arch]
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s.vocab, s.hidden), "matrix")]
    for i in range(s.layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (s.hidden,), "norm"))
        if family.fused:  # q, k, v rows in one tensor
            out.append((b + "attn_qkv.weight", (q + 2 * kv, s.hidden), "matrix"))
        else:
            out += [(b + f"attn_{x}.weight", (n, s.hidden), "matrix") for x, n in (("q", q), ("k", kv), ("v", kv))]
        if family.qkv_bias:
            out += [(b + f"attn_{x}.bias", (n,), "bias") for x, n in (("q", q), ("k", kv), ("v", kv))]
        if family.qk_norm:
            out += [(b + f"attn_{x}_norm.weight", (s.head_dim,), "norm") for x in "qk"]
        out.append((b + "attn_output.weight", (s.hidden, q), "matrix"))
        if family.biases:
            out.append((b + "attn_output.bias", (s.hidden,), "bias"))
        if family.sinks:  # a logit per query head (random like a bias)
            out.append((b + "attn_sinks.weight", (s.heads,), "bias"))
        if family.post_norms:
            out.append((b + "post_attention_norm.weight", (s.hidden,), "norm"))
        out.append((b + family.ffn_norm_tensor + ".weight", (s.hidden,), "norm"))  # gpt-oss: post_attention_norm
        if s.experts:  # the router, then the experts' matrices stacked [expert, rows, row]
            exps = {"gate": (s.expert_ffn, s.hidden), "up": (s.expert_ffn, s.hidden), "down": (s.hidden, s.expert_ffn)}
            out.append((b + "ffn_gate_inp.weight", (s.experts, s.hidden), "router"))
            out += [(b + f"ffn_{x}_exps.weight", (s.experts, *dims), "matrix") for x, dims in exps.items()]
            if family.biases:  # the router's [expert], the experts' [expert, rows]
                out.append((b + "ffn_gate_inp.bias", (s.experts,), "bias"))
                out += [(b + f"ffn_{x}_exps.bias", (s.experts, dims[0]), "bias") for x, dims in exps.items()]
        elif family.fused:  # gate rows, then up rows
            out.append((b + "ffn_up.weight", (2 * s.ffn, s.hidden), "matrix"))
        else:
            out += [(b + f"ffn_{x}.weight", (s.ffn, s.hidden), "matrix") for x in ("gate", "up")]
        if not s.experts:
            out.append((b + "ffn_down.weight", (s.hidden, s.ffn), "matrix"))
        if family.post_norms:
            out.append((b + "post_ffw_norm.weight", (s.hidden,), "norm"))
    out.append(("output_norm.weight", (s.hidden,), "norm"))
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.hidden), "matrix"))
    return out


def write_shape_gguf(path: Path, shape: Shape, vocab: Vocab, seed: int = 0, scale: float = 0.02) -> None:
    """A random-weight model of ``shape`` (its architecture's tensors, ``shape_tensors``, and metadata keys) as an
    F16 GGUF file with llama.cpp's converter's names and keys: matrices normal * ``scale`` (a mixture's router too,
    in F32), q / k rows in any order (the values are random), norms F32 ones (a multiplier of 1 in every family:
    Gemma's files store transformers' ``1 + w``, and w = 0), biases (and gpt-oss's sinks) F32 normal * 0.5.
    ``vocab`` is fitted to the shape's size (``Vocab.fitted``). Streamed: one tensor in memory at a time, generated
    in row chunks."""
    import gguf

    vocab = vocab.fitted(shape.vocab)
    s = shape
    tensors = shape_tensors(s)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), s.arch)
    w.add_name("random weights")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.attn_softcap:
        w.add_attn_logit_softcapping(s.attn_softcap)
    if s.final_softcap:
        w.add_final_logit_softcapping(s.final_softcap)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(s.rope_scaling))
        w.add_rope_scaling_factor(s.rope_scaling_factor)
        if s.rope_original_context:
            w.add_rope_scaling_orig_ctx_len(s.rope_original_context)
    w.add_vocab_size(s.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_add_bos_token(False)
    for name, dims, kind in tensors:
        dtype = np.dtype(np.float16 if kind == "matrix" else np.float32)  # F32: norms, biases, routers
        w.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, kind in tensors:
        if kind == "norm":
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        if kind == "bias":
            w.write_tensor_data(rng.standard_normal(dims, dtype=np.float32) * np.float32(0.5))
            continue
        cols = dims[-1]
        rows = int(np.prod(dims[:-1]))  # an expert tensor's experts one after the other
        data = np.empty((rows, cols), dtype=np.float16 if kind == "matrix" else np.float32)
        step = max(1, (1 << 24) // cols)  # ~64 MB of fp32 at a time
        for r in range(0, rows, step):
            chunk = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
            chunk *= scale
            data[r : r + len(chunk)] = chunk
        w.write_tensor_data(data.reshape(dims))
    w.close()
    tmp.replace(path)


def shape_dir(name: str, shape: Shape, bundled_dir: Path, cache: Path, lib_dir: Path, threads: int,
              scale: float = 0.02, ftype: str = SHAPE_FTYPE) -> Path:
    """The model dir of a shape: random F16 weights (``write_shape_gguf`` with ``scale``) quantized to ``ftype`` (a
    llama_ftype name: Q4_K_M, or MXFP4_MOE for gpt-oss) by llama.cpp (made once; the F16 file is removed after). A
    stamp beside it (``shape.json``: ``shape_stamp``) has a changed shape written anew; a file without one (written
    before the stamps) is kept."""
    model_dir = cache / f"{name}-random-{ftype.removeprefix('LLAMA_FTYPE_MOSTLY_').lower()}"
    f16 = cache / f"{name}-random-f16.gguf"
    stamp = model_dir / "shape.json"
    want = shape_stamp(shape, scale)
    if stamp.is_file() and stamp.read_text() != want:
        logger.info("%s: the shape changed: written anew", name)
        model_gguf(model_dir).unlink(missing_ok=True)
        f16.unlink(missing_ok=True)
    if not model_gguf(model_dir).is_file():
        model_dir.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        if not f16.is_file():
            write_shape_gguf(f16, shape, vocab_of(model_gguf(bundled_dir)), scale=scale)
            logger.info("%s: F16 GGUF written in %.0f s", name, time.perf_counter() - t)
        tmp = model_dir / (GGUF_LINK + ".tmp")
        quantize(lib_dir, f16, tmp, ftype, threads)
        tmp.replace(model_gguf(model_dir))
        f16.unlink()
        stamp.write_text(want)
        logger.info("%s: random weights written and quantized in %.0f s", name, time.perf_counter() - t)
    _with_tokenizer(model_dir, bundled_dir)
    return model_dir


# ---- measuring ------------------------------------------------------------------------------------------


def load_ours(model_dir: Path, threads: int) -> LoadedModel:
    return load_model(str(model_dir), LoadOptions(threads=threads, local_files_only=True))


def rss_after_load(model_dir: Path, threads: int) -> dict[str, Any]:
    """Our resident memory after loading ``model_dir`` (MB over the process before it), in a fresh process: in
    this one the formats before it would share the count."""
    cmd = [sys.executable, "-m", "bench.formats", "--rss-probe", str(model_dir), "--threads", str(threads)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": done.stderr.strip()[-500:]}
    return cast(dict[str, Any], json.loads(lines[-1]))


def _probe(model_dir: Path, threads: int) -> None:
    before = rss_mb()
    try:
        target = load_ours(model_dir, threads)
    except (ModelFileError, ModelLoadError) as exc:
        print(json.dumps({"error": f"refused: {exc}"}))
        return
    print(json.dumps({"rss_mb": round(rss_mb() - before, 1), "runtime": target.runtime}))


def speeds(values: Sequence[float]) -> dict[str, Any]:
    """Median, every repetition and the spread (max / min - 1) of a throughput."""
    lo = min(values) if values else 0.0
    return {"median": round(median(values), 2), "reps": [round(v, 2) for v in values],
            "spread": round(max(values) / lo - 1, 4) if lo > 0 else None}


def _tokens_text(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids)))


def _top2_ours(engine: Engine, ids: list[int], tokenizer: Any) -> list[list[Any]]:
    cache = SlotCache(engine.num_layers, len(ids) + 4)
    with torch.inference_mode():
        logits, _ = engine.prefill(ids, cache)
    values, idx = torch.topk(logits.float(), 2)
    return [[int(i), round(float(v), 4), _tokens_text(tokenizer, [int(i)])] for v, i in zip(values, idx, strict=True)]


def greedy_check(bench: Bench, case: Case, runs: dict[str, list[Run]], tokenizer: Any) -> dict[str, Any]:
    """The first ``GREEDY_TOKENS`` greedy tokens, ours against each llama.cpp build's: equal, or where they part
    with each runtime's two largest logits there (after the same tokens)."""
    n = min(GREEDY_TOKENS, bench.max_new_tokens)
    ours = runs["ours"][0].tokens[:n]
    result: dict[str, Any] = {"tokens": n, "ours_text": _tokens_text(tokenizer, ours),
                              "ours_same_every_rep": all(r.tokens[:n] == ours for r in runs["ours"])}
    ours_top: dict[int, list[list[Any]]] = {}
    for name, worker in bench.llama.items():
        theirs = runs[name][0].tokens[:n]
        at = first_mismatch(ours, theirs)
        row: dict[str, Any] = {"equal": at is None,
                               "same_every_rep": all(r.tokens[:n] == theirs for r in runs[name])}
        if at is not None and at < min(len(ours), len(theirs)):
            ids = [*case.prompt.ids, *ours[:at]]
            if at not in ours_top:
                ours_top[at] = _top2_ours(bench.engine, ids, tokenizer)
            row |= {"first_divergence": at, "text_before": _tokens_text(tokenizer, ours[:at]),
                    "ours_top2": ours_top[at],
                    "llama_cpp_top2": [[t, round(v, 4), _tokens_text(tokenizer, [t])] for t, v in worker.top(ids, 2)]}
        result[f"vs_{name}"] = row
    return result


@dataclass(frozen=True)
class Plan:
    context: int
    max_new: int
    repeats: int
    threads: int
    builds: dict[str, Path]  # llama.cpp build name (bench.llama_ref.BUILDS) -> its library dir
    greedy: bool = True
    prefill: bool = True


def _cases(tokenizer_of: Any, plan: Plan) -> tuple[Case, Case]:
    """The timed case (the document cut to ``plan.context`` tokens) and a short warm-up case."""
    [doc] = qa_documents([DOC])
    case = make_cases(tokenizer_of, [doc], 1, plan.max_new, plan.context)[0]
    warm = make_cases(tokenizer_of, [DocQA(doc.name + "-warm", doc.text[:300], doc.questions)], 1, 8)[0]
    return case, warm


def measure(model_dir: Path, plan: Plan) -> dict[str, Any]:
    """One model file on every runtime: ours (unless it refuses the file) and each llama.cpp build, interleaved."""
    gguf = model_gguf(model_dir)
    row: dict[str, Any] = {"file": str(gguf.resolve()), "file_mb": round(gguf.resolve().stat().st_size / 1e6, 1),
                           "tensor_types": tensor_types(gguf)}
    target: LoadedModel | None = None
    try:
        target = load_ours(model_dir, plan.threads)
    except (ModelFileError, ModelLoadError) as exc:
        row["ours"] = f"refused: {exc}"
        logger.warning("%s: ours refused it: %s", model_dir.name, exc)
    if target is not None:
        row["ours"] = {"runtime": target.runtime, "served_weight_mb": round(target.weight_bytes / 1e6, 1),
                       "file_tensor_mb": round(row["tensor_types"]["tensor_bytes"] / 1e6, 1),
                       "rss_after_load": rss_after_load(model_dir, plan.threads)}
        fixed = dataclasses.replace(target, eos_token_ids=())  # fixed-length runs on both sides
        engine = Engine(fixed, PrefixCache(byte_budget=6 << 30), config=ENGINE_CONFIG)
        tokenizer_of: Any = fixed
    else:  # llama.cpp alone, on the same prompt ids
        from transformers import AutoTokenizer

        fixed = cast(LoadedModel, SimpleNamespace(eos_token_ids=()))
        engine = cast(Engine, None)
        tokenizer_of = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(model_dir)), max_context=8192)
    workers: dict[str, LlamaWorker] = {}
    try:
        for name, lib in plan.builds.items():
            workers[name] = LlamaWorker(lib, gguf, plan.threads)
        row["llama_cpp"] = {name: {"rss_after_load_mb": w.info["rss_mb"], "build": w.info["build_flags"][:1]
                                   if w.info["build_flags"] else None} for name, w in workers.items()}
        case, warm = _cases(tokenizer_of, plan)
        bench = Bench(fixed, engine, plan.max_new, [case], workers)
        methods: dict[str, Callable[[Case], Run]] = {}
        if target is not None:
            methods["ours"] = lambda c: run_engine(bench, c, [])
        for name in workers:
            methods[name] = lambda c, n=name: run_llama_cpp(bench, c, n)  # type: ignore[misc]
        warm_bench = dataclasses.replace(bench, max_new_tokens=8)
        for name in methods:  # warm-up: the kernels, the threads
            if name == "ours":
                run_engine(warm_bench, warm, [])
            else:
                run_llama_cpp(warm_bench, warm, name)
        row["prompt_tokens"] = len(case.prompt.ids)
        if plan.prefill:
            row["prefill"] = measure_prefill(bench, case, plan.repeats, ours=target is not None)
        runs: dict[str, list[Run]] = {name: [] for name in methods}
        for rep in range(plan.repeats):
            for name, run in methods.items():
                runs[name].append(run(case))
                logger.info("%s rep %d %-15s %6.1f tok/s  ttft %.2fs", model_dir.name, rep + 1, name,
                            runs[name][-1].decode_tps, runs[name][-1].ttft_s)
        decode: dict[str, Any] = {name: speeds([r.decode_tps for r in rs]) for name, rs in runs.items()}
        decode["new_tokens"] = plan.max_new
        if not plan.prefill:  # the first (cold) run's time to first token: one prefill each
            decode["cold_prefill_tokens_per_s"] = {name: round(len(case.prompt.ids) / rs[0].ttft_s, 1)
                                                   for name, rs in runs.items()}
        if "ours" in runs:
            for name in workers:
                decode[f"ours_vs_{name}"] = round(decode["ours"]["median"] / decode[name]["median"], 3)
        row["decode"] = decode
        if plan.greedy and target is not None:
            row["greedy"] = greedy_check(bench, case, runs, target.tokenizer)
    finally:
        for worker in workers.values():
            worker.close()
    del target, engine
    gc.collect()
    return row


# ---- the run --------------------------------------------------------------------------------------------


def available_builds(builds_dir: Path) -> dict[str, Path]:
    found = {name: builds_dir / sub for name, sub in BUILDS.items() if any((builds_dir / sub).glob("libllama.so*"))}
    for name in sorted(set(BUILDS) - set(found)):
        logger.warning("%s not built in %s (scripts/build-llama-cpp, make bench): left out", name, builds_dir)
    return found


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    models_dir = Path(args.data_dir) / "models"
    install_bundled(models_dir)
    bundled_dir = bundled_gguf_dir(models_dir)
    cache = Path(args.cache_dir)
    builds = available_builds(Path(args.builds_dir))
    quantizer = next(iter(builds.values()), None)
    plan = Plan(args.context, args.max_new_tokens, args.repeats, args.threads, builds)
    shape_plan = dataclasses.replace(plan, context=args.shape_context, greedy=False, prefill=False)
    formats: dict[str, Any] = {}
    for fmt in args.formats:
        if FORMATS[fmt] is not None and quantizer is None:
            formats[fmt] = {"skipped": "no llama.cpp build to quantize with"}
            continue
        model_dir = format_dir(fmt, bundled_dir, cache, quantizer or Path(), args.threads)
        out(f"format {fmt}: {model_dir}")
        formats[fmt] = measure(model_dir, plan)
    shapes: dict[str, Any] = {}
    for name in args.shapes:
        if quantizer is None:
            shapes[name] = {"skipped": "no llama.cpp build to quantize with"}
            continue
        model_dir = shape_dir(name, SHAPES[name], bundled_dir, cache, quantizer, args.threads)
        out(f"shape {name}: {model_dir}")
        shapes[name] = {"shape": dataclasses.asdict(SHAPES[name]), "quantized_to": SHAPE_FTYPE,
                        **measure(model_dir, shape_plan)}
    return {
        "benchmark": "formats",
        "config": {"threads": args.threads, "repeats": args.repeats, "quick": args.quick, "document": DOC,
                   "context": args.context, "shape_context": args.shape_context,
                   "max_new_tokens": args.max_new_tokens, "greedy_tokens": min(GREEDY_TOKENS, args.max_new_tokens),
                   "cache_dir": str(cache)},
        "machine": machine_info(),
        "llama_cpp_builds": {name: {"lib_dir": str(lib), "build_flags": build_flags(lib)}
                             for name, lib in builds.items()},
        "formats": formats,
        "shapes": shapes,
    }


def _tps(decode: dict[str, Any], key: str) -> str:
    return f"{decode[key]['median']:.1f}" if key in decode else "-"


def _pf(prefill: dict[str, Any], cold: dict[str, Any], key: str) -> str:
    """Prefill tokens/s of a runtime: the median, or the one cold run (marked *) where there is no median."""
    if prefill:
        return f"{prefill[key + '_tokens_per_s']:.0f}" if key + "_tokens_per_s" in prefill else "-"
    return f"{cold[key]:.0f}*" if key in cold else "-"


def table(result: dict[str, Any]) -> list[str]:
    """The results as text: one line per format and shape."""
    builds = list(result["llama_cpp_builds"])
    head = f"{'model':14s} {'ours runtime (gguf:...)':38s} {'decode ours':>11s} "
    head += " ".join(f"{b:>14s}" for b in builds)
    head += f" {'prefill ours':>12s} " + " ".join(f"{b:>14s}" for b in builds) + "  greedy  weight MB ours/file"
    lines = [head]
    rows = [(k, v) for k, v in result["formats"].items()] + [(k, v) for k, v in result["shapes"].items()]
    for name, row in rows:
        ours = row.get("ours")
        if not isinstance(ours, dict):
            lines.append(f"{name:14s} {str(ours or row.get('skipped', ''))[:100]}")
            if not isinstance(row.get("decode"), dict):
                continue
            ours = {}
        decode, prefill = row.get("decode", {}), row.get("prefill", {})
        cold = decode.get("cold_prefill_tokens_per_s", {})

        tag = ours.get("runtime", "").removeprefix("cpu-quantized:").removeprefix("gguf:")
        line = f"{name:14s} {tag:38s} {_tps(decode, 'ours'):>11s} "
        line += " ".join(f"{_tps(decode, b) + ' (' + str(decode.get(f'ours_vs_{b}', '-')) + 'x)':>14s}" for b in builds)
        line += f" {_pf(prefill, cold, 'ours'):>12s} " + " ".join(f"{_pf(prefill, cold, b):>14s}" for b in builds)
        greedy = row.get("greedy", {})
        eq = "/".join("=" if greedy[f"vs_{b}"]["equal"] else str(greedy[f"vs_{b}"].get("first_divergence", "!="))
                      for b in builds if f"vs_{b}" in greedy) or "-"
        line += f"  {eq:6s}  {ours.get('served_weight_mb', '-')}/{ours.get('file_tensor_mb', '-')}"
        lines.append(line)
    lines.append("decode: tokens/s (ours / build); prefill: tokens/s (* one cold run); greedy: '=' equal first "
                 f"{result['config']['greedy_tokens']} tokens per build, else the first divergence")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.formats", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--formats", nargs="*", default=None, type=str.upper,
                   help=f"formats of the bundled model (default all: {' '.join(FORMATS)})")
    p.add_argument("--shapes", nargs="*", default=None, type=str.lower,
                   help=f"random-weight model shapes (default all: {' '.join(SHAPES)})")
    p.add_argument("--quick", action="store_true", help="short contexts, 16 tokens, 1 repetition")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=2, help="threads of every runtime")
    p.add_argument("--context", type=int, default=None, help="document tokens for the formats (default 3500)")
    p.add_argument("--shape-context", type=int, default=None, help="document tokens for the shapes (default 2048)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens decoded per run (default 64; quick 16)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "formats.json")
    p.add_argument("--cache-dir", default=str(default_cache_dir()), help="where the derived GGUF files are kept")
    p.add_argument("--builds-dir", default=str(BUILDS_DIR), help="the llama.cpp builds (scripts/build-llama-cpp)")
    p.add_argument("--data-dir", default=str(REPO / "data"), help="where the bundled model lives")
    p.add_argument("--rss-probe", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.formats = list(FORMATS) if args.formats is None else args.formats
    args.shapes = list(SHAPES) if args.shapes is None else args.shapes
    for value, known in ((args.formats, FORMATS), (args.shapes, SHAPES)):
        unknown = [v for v in value if v not in known]
        if unknown:
            p.error(f"unknown {unknown}; known: {' '.join(known)}")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.context = args.context or (400 if args.quick else 3500)
    args.shape_context = args.shape_context or (256 if args.quick else 2048)
    args.max_new_tokens = args.max_new_tokens or (16 if args.quick else 64)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.rss_probe is not None:
        _probe(args.rss_probe, args.threads)
        return 0
    result = run_benchmark(args)
    write_json(args.json, result)
    logger.info("wrote %s", args.json)
    for line in table(result):
        out(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
