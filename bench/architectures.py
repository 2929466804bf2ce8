"""Architectures benchmark: each GGUF architecture the quantized CPU runtime runs, at the shape of a real ~1-2B model
(and two mixtures of experts) with random weights, served by our runtime and by llama.cpp's best build from the same
Q4_K_M (gpt-oss: MXFP4_MOE) file, side by side.

    python -m bench.architectures [--archs llama,qwen2,qwen3,gemma2,gemma3,phi3,qwen3moe,gpt-oss]
                                  [--sections decode,prefill,long,drafter] [--contexts 2048,16384] [--runs 3]
                                  [--threads 2] [--json PATH] [--fresh]

Shapes (``ARCHS``): each architecture at the config shape of a model people run (Llama-3.2-1B, Qwen2.5-1.5B,
Qwen3-1.7B, Gemma-2-2B, Gemma-3-1B, Phi-3-mini-4k), written by ``bench.formats.write_shape_gguf`` with that family's
tensors and metadata keys as llama.cpp's converter writes them (random F16 weights, normal / sqrt(hidden), so that
every projection of a unit-RMS input gives about unit outputs and the logits a standard deviation near 1; the bundled
tokenizer fitted to the vocabulary) and quantized to Q4_K_M by llama.cpp (cached in ``--cache-dir``; gpt-oss to
MXFP4_MOE, the type its files come in: experts MXFP4, the other matrices Q8_0, the router as written). Every file's
context length is at least ``MIN_CONTEXT`` (the model's own where longer), so that 16K and 32K prompts fit; the
model's own window is recorded beside it. Speed depends on the shape, not the values.

Sections (``--sections``; each run merges what it measured into the JSON already at ``--json`` unless ``--fresh``,
so a session can run pieces):

- ``decode``: per context (``--contexts``) a prompt of that many tokens (the QA set's texts and a question; ids past
  a smaller vocabulary folded into it), 64 tokens decoded (end of sequence ignored), ours and llama.cpp interleaved
  (rep -> runtime) after one warm-up each, medians of ``--runs``; the first run's time to first token (a cold
  prefill: our prefix cache and llama.cpp's KV hold the prompt after it); the first 32 greedy tokens against
  llama.cpp's (equal, or where they part with both runtimes' top two logits there); and the logits after the prompt
  (llama.cpp's top 8, ours at the same ids: on random weights the tokens mean nothing, but a wrong forward shows as
  logits that disagree by far more than the two runtimes' rounding).
- ``prefill``: cold prefill tokens/s of a ``--prefill-tokens`` prompt, ours (no prefix cache) against llama.cpp's
  evaluation from an empty KV, interleaved, medians (``bench.decode_measure.measure_prefill``).
- ``long``: the Gemma-3-1B shape reading a ``--long-tokens`` document whole: time to first token cold, then with
  the document's KV cached (the same question again, another question: our engine's prefix cache as the service
  uses it; llama.cpp reusing its KV of the shared prefix), decode tokens/s at that length, resident memory after
  (ours in a fresh process). One cold run per runtime (each takes minutes), ``--runs`` of the cached ones.
- ``drafter``: RAPID with a smaller drafter: the Llama-3.1-8B shape as the target and the Llama-3.2-1B shape as the
  drafter (same vocabulary), ours: the target's verify forward over 0 (a plain step) .. 8 and 16 chained draft nodes
  and two trees (2 x 4, 4 x 4) on a ``--drafter-context`` cache, the drafter's one-token forward on a cache of the
  RAG drafter's context (``RAPID_BUDGET`` tokens), interleaved; then the chain model (``chain_model``): a chain of g
  drafted tokens each accepted with probability a gives 1 + a + .. + a^g tokens per step at g drafter forwards and
  one verify, against plain decoding, for a = 0.6 / 0.7 / 0.8 and g = 1..8, and the acceptance where each g breaks
  even.
- ``verify``: per architecture, ours: a verify forward over 1 / 2 / 4 / 8 / 16 rows (a chain after the root) on a
  ``--drafter-context`` cache, in units of one plain step (``decoding.speculative.calibration.verify_costs``,
  medians of ``--verify-repeats``): what one more verified row costs, on a mixture of experts (its rows route to
  more experts) beside the dense shapes.

A mixture of experts too big to write whole here (``MOE_LAYERS``: Qwen3-30B-A3B's 48 layers of 128 experts would be
60 GB of F16, gpt-oss-20b's 24 layers of 32 experts 38 GB) is written with its first layers only (gpt-oss's alternate
sliding-window and full layers in the same proportion); its rows record the layers written and the model's, and per
context the decode time per token over the layers written (``per_layer_ms``: the embedding's and output head's share
included, so at most a layer's).

The JSON records the machine (CPU flags, the kernel path) and the llama.cpp build. ``table()`` gives the README's
markdown rows. Known differences between the two runtimes on these files: llama.cpp disables Phi-3's sliding window
(its loader says so) while ours applies it as transformers does, so Phi-3 past its 2047-token window is not the same
computation on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch

from bench.common import REPO, machine_info, median, out, rss_mb, write_json
from bench.decode_measure import first_mismatch, measure_prefill
from bench.decode_methods import ENGINE_CONFIG, RAPID_BUDGET, Bench, Case, Run, run_engine, run_llama_cpp
from bench.formats import (
    SHAPE_FTYPE,
    SHAPES,
    Shape,
    available_builds,
    default_cache_dir,
    load_ours,
    model_gguf,
    rss_after_load,
    shape_dir,
    speeds,
    tensor_types,
)
from bench.gpu_models import branchy_tree
from bench.llama_ref import BUILDS_DIR, LlamaWorker, build_flags
from decoding.cache.prefix import PrefixCache
from decoding.cache.slot import SlotCache
from decoding.errors import ModelFileError, ModelLoadError
from decoding.runtime.bundled import bundled_gguf_dir
from decoding.runtime.bundled.install import install_bundled
from decoding.runtime.loader import LoadedModel
from decoding.speculative.engine import Engine
from decoding.speculative.generation import DoneEvent, GenerationConfig, Prompt
from decoding.speculative.metadata import SamplingMetadata
from decoding.speculative.prefill import drain
from decoding.speculative.tree import DraftTree

logger = logging.getLogger("bench.architectures")

MIN_CONTEXT = 36864  # every file's context length at least: a 32K-token document, its question and answer fit
GREEDY_TOKENS = 32  # the greedy prefix compared with llama.cpp's
LOGIT_TOP = 8  # llama.cpp's top logits compared with ours after the prompt
SECTIONS = ("decode", "prefill", "long", "drafter", "verify")
VERIFY_ROWS = (1, 2, 4, 8, 16)  # rows of the timed verify forwards (a chain of rows - 1 draft nodes after the root)
# llama.cpp as compared: the builds of bench.llama_ref, and each with its flash attention on (llama-cpp-python leaves it
# off unless asked, llama.cpp's own tools turn it on where it runs: it changes long contexts most)
LLAMA_BUILDS = ("llama_cpp", "llama_cpp_fa", "llama_cpp_avx2", "llama_cpp_avx2_fa")
ACCEPTANCES = (0.6, 0.7, 0.8)  # per-token acceptance of the chain model
DRAFT_LENGTHS = tuple(range(1, 9))
VERIFY_CHAINS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 16)  # draft nodes of the timed verify chains (0: a plain step)
VERIFY_TREES = ((2, 4), (4, 4))  # (branches, depth) of the timed verify trees


@dataclass(frozen=True)
class Arch:
    """A model whose shape is benchmarked: its name, its shape as written (context at least ``MIN_CONTEXT``) and its
    own window."""

    model: str
    shape: Shape
    trained_context: int
    ftype: str = SHAPE_FTYPE  # the llama_ftype llama.cpp quantizes the F16 file to

    @property
    def file_name(self) -> str:
        return "arch-" + self.model.lower()


def _arch(model: str, shape: Shape, ftype: str = SHAPE_FTYPE) -> Arch:
    return Arch(model, dataclasses.replace(shape, context=max(shape.context, MIN_CONTEXT)), shape.context, ftype)


# The real models' config shapes (their config.json); q / k rows, biases and norms as the family stores them.
ARCHS: dict[str, Arch] = {
    "llama": _arch("Llama-3.2-1B", dataclasses.replace(SHAPES["llama-3.2-1b"], context=131072)),
    "qwen2": _arch("Qwen2.5-1.5B", Shape(hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, ffn=8960,
                                         vocab=151936, context=32768, rope_theta=1e6, arch="qwen2", rms_eps=1e-6)),
    "qwen3": _arch("Qwen3-1.7B", Shape(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144,
                                       vocab=151936, context=40960, rope_theta=1e6, arch="qwen3", rms_eps=1e-6)),
    "gemma2": _arch("Gemma-2-2B", Shape(hidden=2304, layers=26, heads=8, kv_heads=4, head_dim=256, ffn=9216,
                                        vocab=256000, context=8192, rope_theta=1e4, arch="gemma2", rms_eps=1e-6,
                                        sliding_window=4096, attn_softcap=50.0, final_softcap=30.0)),
    "gemma3": _arch("Gemma-3-1B", Shape(hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256, ffn=6912,
                                        vocab=262144, context=32768, rope_theta=1e6, arch="gemma3", rms_eps=1e-6,
                                        sliding_window=512)),
    "phi3": _arch("Phi-3-mini-4k", Shape(hidden=3072, layers=32, heads=32, kv_heads=32, head_dim=96, ffn=8192,
                                         vocab=32064, context=4096, rope_theta=1e4, arch="phi3", tied=False,
                                         sliding_window=2047)),
    # Qwen3-30B-A3B: 48 layers of 128 experts (8 a token, 768 rows each) would be 60 GB of F16 to write here; its
    # first MOE_LAYERS layers are, and the per-layer time is reported beside the runs
    "qwen3moe": _arch("Qwen3-30B-A3B", Shape(hidden=2048, layers=6, heads=32, kv_heads=4, head_dim=128, ffn=6144,
                                             vocab=151936, context=40960, rope_theta=1e6, arch="qwen3moe",
                                             rms_eps=1e-6, tied=False, experts=128, experts_used=8, expert_ffn=768)),
    # gpt-oss-20b: 24 layers of 32 experts (4 a token, 2880 rows each) would be 38 GB of F16; its first MOE_LAYERS
    # layers are (sliding window on the even ones), quantized as its files come: MXFP4 experts (MXFP4_MOE)
    "gpt-oss": _arch("gpt-oss-20b", Shape(hidden=2880, layers=6, heads=64, kv_heads=8, head_dim=64, ffn=2880,
                                          vocab=201088, context=131072, rope_theta=150000.0, arch="gpt-oss",
                                          rms_eps=1e-5, tied=False, sliding_window=128, experts=32, experts_used=4,
                                          expert_ffn=2880, rope_scaling="yarn", rope_scaling_factor=32.0,
                                          rope_original_context=4096),
                     ftype="LLAMA_FTYPE_MOSTLY_MXFP4_MOE"),
}  # fmt: skip
MOE_LAYERS = {"qwen3moe": (6, 48), "gpt-oss": (6, 24)}  # layers written / the model's
LONG_ARCH = "gemma3"  # the long-document section's model
DRAFTER_ARCH = "llama"  # RAPID's drafter: the Llama-3.2-1B shape
TARGET = _arch("Llama-3.1-8B", Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
                                     vocab=128256, context=131072, rope_theta=500000.0, tied=False))
NOTES = {
    "phi3": "llama.cpp disables Phi-3's sliding window (its loader: 'Phi SWA is currently disabled'); ours applies it "
            "(2047 tokens, every layer) as transformers does: past the window the two compute different things",
}


def scale_of(shape: Shape) -> float:
    """The weights' standard deviation: about unit outputs from a unit-RMS input, logits of deviation ~1."""
    return 1.0 / math.sqrt(shape.hidden)


# ---- prompts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """Token ids to build prompts from: the QA set's texts one after the other, and questions."""

    stream: list[int]
    questions: list[list[int]]

    @classmethod
    def of(cls, tokenizer: Any) -> Text:
        from bench.datasets import load_qa

        docs = load_qa()
        stream = [i for d in docs for i in tokenizer("\n\n" + d.text, add_special_tokens=False).input_ids]
        questions = [tokenizer(f"\n\nQuestion: {q.question}\nAnswer:", add_special_tokens=False).input_ids
                     for q in docs[0].questions[:2]]
        return cls(stream, questions)

    def prompt(self, tokens: int, vocab: int, key: str | None, question: int = 0,
               document: int | None = None) -> Prompt:
        """A prompt of ``tokens`` ids (or a ``document`` of that many ids, then the question): the texts, repeated
        where they run out, then question ``question``; ids at or past ``vocab`` folded into it (``id % vocab``)."""
        q = self.questions[question % len(self.questions)]
        n = document if document is not None else max(1, tokens - len(q))
        reps = -(-n // len(self.stream))
        doc = (self.stream * reps)[:n]
        return Prompt([i % vocab for i in doc], [i % vocab for i in q], prefix_key=key)


def _case(prompt: Prompt, name: str) -> Case:
    return Case(name, "", "", prompt)


# ---- files --------------------------------------------------------------------------------------------------


def arch_dir(arch: Arch, bundled_dir: Path, cache: Path, lib_dir: Path, threads: int) -> Path:
    """The model dir of ``arch``: its random weights quantized to ``arch.ftype`` by llama.cpp (made once, cached)."""
    return shape_dir(arch.file_name, arch.shape, bundled_dir, cache, lib_dir, threads, scale=scale_of(arch.shape),
                     ftype=arch.ftype)


def file_row(arch: Arch, model_dir: Path) -> dict[str, Any]:
    gguf = model_gguf(model_dir)
    return {"model": arch.model, "shape": dataclasses.asdict(arch.shape), "trained_context": arch.trained_context,
            "weight_scale": round(scale_of(arch.shape), 6), "quantized_to": arch.ftype, "file": str(gguf.resolve()),
            "file_mb": round(gguf.resolve().stat().st_size / 1e6, 1), "tensor_types": tensor_types(gguf)}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ---- our logits, the greedy check -----------------------------------------------------------------------------


def logits_after(engine: Engine, prompt: Prompt, extra: Sequence[int] = ()) -> torch.Tensor:
    """Our logits after ``prompt`` and ``extra`` tokens, reading the prompt's prefix from the engine's prefix cache
    (filled by the timed runs: only the question and ``extra`` run here)."""
    ids = [*prompt.ids, *extra]
    cache = SlotCache(engine.num_layers, len(ids) + 4)
    with torch.inference_mode():
        read = drain(engine.reader.read(ids, [len(prompt.prefix_ids)], prompt.prefix_key, cache, None))
    assert read.last is not None
    return read.last.float()


def _top(logits: torch.Tensor, k: int) -> list[list[float]]:
    values, idx = torch.topk(logits, k)
    return [[int(i), round(float(v), 4)] for v, i in zip(values, idx, strict=True)]


def greedy_check(engine: Engine, prompt: Prompt, runs: dict[str, list[Run]], workers: dict[str, LlamaWorker],
                 tokens: int) -> dict[str, Any]:
    """The first ``tokens`` greedy tokens, ours against each llama.cpp build's: equal, or where they part with each
    runtime's two largest logits there (after the same tokens)."""
    ours = runs["ours"][0].tokens[:tokens]
    result: dict[str, Any] = {"tokens": tokens, "ours_same_every_rep": all(r.tokens[:tokens] == ours
                                                                           for r in runs["ours"])}
    for name, worker in workers.items():
        theirs = runs[name][0].tokens[:tokens]
        at = first_mismatch(ours, theirs)
        row: dict[str, Any] = {"equal": at is None, "same_every_rep": all(r.tokens[:tokens] == theirs
                                                                          for r in runs[name])}
        if at is not None and at < min(len(ours), len(theirs)):
            row |= {"first_divergence": at, "ours_top2": _top(logits_after(engine, prompt, ours[:at]), 2),
                    "llama_cpp_top2": [[t, round(v, 4)] for t, v in worker.top([*prompt.ids, *ours[:at]], 2)]}
        result[f"vs_{name}"] = row
    return result


def logits_check(engine: Engine, prompt: Prompt, worker: LlamaWorker, k: int = LOGIT_TOP) -> dict[str, Any]:
    """The logits after the prompt: llama.cpp's ``k`` largest, ours at the same ids, and ours' own top ``k``; the
    largest difference on llama.cpp's ids against the spread of our logits (their standard deviation)."""
    ours = logits_after(engine, prompt)
    theirs = worker.top(prompt.ids, k)
    ids = [t for t, _ in theirs]
    diff = np.abs(ours[ids].numpy() - np.array([v for _, v in theirs], dtype=np.float32))
    ours_top = _top(ours, k)
    return {"k": k, "top1_equal": int(ours_top[0][0]) == ids[0],
            "top_k_overlap": len({int(t) for t, _ in ours_top} & set(ids)),
            "max_abs_diff": round(float(diff.max()), 4), "ours_logit_std": round(float(ours.std()), 4),
            "ours_top": ours_top, "llama_cpp_top": [[t, round(v, 4)] for t, v in theirs]}


# ---- decode and prefill ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    runs: int = 3
    threads: int = 2
    max_new: int = 64
    builds: dict[str, Path] = dataclasses.field(default_factory=dict)  # llama.cpp build name -> its library dir
    flash: frozenset[str] = frozenset()  # the builds run with llama.cpp's flash attention on (``*_fa``)
    contexts: tuple[int, ...] = (2048, 16384)  # decode; () for none
    prefill_tokens: int | None = 2048  # None: no prefill section
    long_tokens: int = 32768
    drafter_context: int = 2048
    verify_repeats: int = 7
    rss_probe: bool = True  # our resident memory after load, in a fresh process (seconds per file)


def _warm_up(bench: Bench, names: Sequence[str], text: Text, vocab: int) -> None:
    warm = _case(text.prompt(64, vocab, None), "warm-up")
    small = dataclasses.replace(bench, max_new_tokens=8)
    for name in names:
        if name == "ours":
            run_engine(small, warm, [])
        else:
            run_llama_cpp(small, warm, name)


def measure_context(target: LoadedModel | None, gguf: Path, plan: Plan, text: Text, vocab: int, context: int,
                    decode: bool, prefill: bool, label: str) -> dict[str, Any]:
    """One context of one file: decode (and the greedy and logits checks) and / or prefill, ours (unless ``target``
    is None: refused) and each llama.cpp build, interleaved."""
    result: dict[str, Any] = {}
    workers: dict[str, LlamaWorker] = {}
    try:
        for name, lib in plan.builds.items():
            workers[name] = LlamaWorker(lib, gguf, plan.threads, n_ctx=context + plan.max_new + 256,
                                        flash_attn=name in plan.flash)
        fixed = (dataclasses.replace(target, eos_token_ids=()) if target is not None
                 else cast(LoadedModel, SimpleNamespace(eos_token_ids=())))  # llama.cpp alone
        engine = Engine(fixed, PrefixCache(byte_budget=8 << 30), config=ENGINE_CONFIG) if target is not None else None
        bench = Bench(fixed, cast(Engine, engine), plan.max_new, [], workers)
        names = (["ours"] if target is not None else []) + list(workers)
        _warm_up(bench, names, text, vocab)
        prompt = text.prompt(context, vocab, f"{label}@{context}")
        case = _case(prompt, f"{label}@{context}")
        if decode:
            runs: dict[str, list[Run]] = {name: [] for name in names}
            for rep in range(plan.runs):
                for name in names:
                    run = run_engine(bench, case, []) if name == "ours" else run_llama_cpp(bench, case, name)
                    runs[name].append(run)
                    logger.info("%s@%d rep %d %-10s %6.2f tok/s  ttft %.2f s", label, context, rep + 1, name,
                                run.decode_tps, run.ttft_s)
            piece: dict[str, Any] = {"measured_at": _now(), "prompt_tokens": len(prompt.ids),
                                     "new_tokens": plan.max_new}
            piece |= {name: speeds([r.decode_tps for r in rs]) for name, rs in runs.items()}
            if target is not None:
                for name in workers:
                    piece[f"ours_vs_{name}"] = round(piece["ours"]["median"] / piece[name]["median"], 3)
            # the first run of each read the prompt cold (the later ones reuse its KV)
            piece["cold_ttft_s"] = {name: round(rs[0].ttft_s, 3) for name, rs in runs.items()}
            piece["cold_prefill_tokens_per_s"] = {name: round(len(prompt.ids) / rs[0].ttft_s, 1)
                                                  for name, rs in runs.items()}
            piece["llama_cpp_memory"] = {name: w.memory() for name, w in workers.items()}
            if target is not None and engine is not None:
                piece["greedy"] = greedy_check(engine, prompt, runs, workers, min(GREEDY_TOKENS, plan.max_new))
                piece["logits"] = {name: logits_check(engine, prompt, w) for name, w in workers.items()}
            result["decode"] = piece
        if prefill:
            result["prefill"] = {"measured_at": _now(),
                                 **measure_prefill(bench, case, plan.runs, ours=target is not None)}
    finally:
        for worker in workers.values():
            worker.close()
    return result


def verify_curve(target: LoadedModel, plan: Plan) -> dict[str, Any]:
    """Ours: a verify forward over each of ``VERIFY_ROWS`` rows on a ``plan.drafter_context`` cache, against a plain
    step (medians of ``plan.verify_repeats``, the sizes round-robin)."""
    from decoding.speculative.calibration import verify_costs

    engine = Engine(dataclasses.replace(target, eos_token_ids=()), None)
    context, seconds = verify_costs(engine, plan.drafter_context, [rows - 1 for rows in VERIFY_ROWS],
                                    plan.verify_repeats)
    return {"context_tokens": context, "step_ms": round(1000 * seconds[0], 2),
            "rows_vs_step": {str(rows): round(seconds[rows - 1] / seconds[0], 3) for rows in VERIFY_ROWS}}


def measure_arch(name: str, arch: Arch, model_dir: Path, plan: Plan, text: Text, decode: bool,
                 prefill: bool) -> dict[str, Any]:
    """One architecture's file at every context of the plan (decode) and the prefill length (prefill)."""
    row = file_row(arch, model_dir)
    written = arch.shape.layers
    if name in MOE_LAYERS:
        row["layers_written"], row["model_layers"] = MOE_LAYERS[name]
    gguf = model_gguf(model_dir)
    target: LoadedModel | None = None
    try:
        target = load_ours(model_dir, plan.threads)
    except (ModelFileError, ModelLoadError) as exc:
        row["ours"] = f"refused: {exc}"
        logger.warning("%s: ours refused it: %s", name, exc)
    if target is not None:
        row["ours"] = {"runtime": target.runtime, "served_weight_mb": round(target.weight_bytes / 1e6, 1),
                       "file_tensor_mb": round(row["tensor_types"]["tensor_bytes"] / 1e6, 1),
                       "max_context": target.max_context}
        if plan.rss_probe:
            row["ours"]["rss_after_load"] = rss_after_load(model_dir, plan.threads)
    if name in NOTES:
        row["note"] = NOTES[name]
    contexts = sorted({*(plan.contexts if decode else ()), *([plan.prefill_tokens] if prefill and plan.prefill_tokens
                                                                else [])})
    row["decode"] = {}
    for context in contexts:
        out(f"{name} ({arch.model} shape) at {context} tokens")
        got = measure_context(target, gguf, plan, text, arch.shape.vocab, context,
                              decode and context in plan.contexts, prefill and context == plan.prefill_tokens, name)
        if "decode" in got:
            row["decode"][str(context)] = got["decode"]
            if name in MOE_LAYERS:  # a token's time over the layers written (the embedding's and head's share in it)
                got["decode"]["per_layer_ms"] = {
                    k: round(1000 / v["median"] / written, 3) for k, v in got["decode"].items()
                    if isinstance(v, dict) and v.get("median")}
        if "prefill" in got:
            row["prefill"] = got["prefill"]
    del target
    gc.collect()
    return row


# ---- the long document ----------------------------------------------------------------------------------------


def _vm(key: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def long_ours(model_dir: Path, tokens: int, runs: int, threads: int, max_new: int, text: Text) -> dict[str, Any]:
    """Our engine reading a ``tokens``-token document whole: time to first token cold, then with the document's KV in
    the prefix cache (the same question again, another question), decode speed, resident memory (this process: run
    it in a fresh one)."""
    torch.set_num_threads(threads)
    before = rss_mb()
    target = load_ours(model_dir, threads)
    fixed = dataclasses.replace(target, eos_token_ids=())
    memory: dict[str, float] = {"after_load_mb": round(rss_mb() - before, 1)}
    prefix_cache = PrefixCache(byte_budget=16 << 30)
    engine = Engine(fixed, prefix_cache, config=ENGINE_CONFIG)
    bench = Bench(fixed, engine, 8, [])
    _warm_up(bench, ["ours"], text, fixed.vocab_size)
    vocab = fixed.vocab_size
    first, other = (text.prompt(0, vocab, "long", question=q, document=tokens) for q in (0, 1))
    config = GenerationConfig(max_new_tokens=max_new)

    def ask(prompt: Prompt) -> dict[str, Any]:
        done = next(e for e in engine.generate(prompt, config) if isinstance(e, DoneEvent))
        s = done.stats
        return {"ttft_s": s.ttft_s, "reused": s.prefix_reused_tokens, "tokens": list(done.token_ids),
                "decode_tps": (s.completion_tokens - 1) / s.decode_s if s.decode_s > 0 else 0.0}

    cold = ask(first)
    memory["after_cold_mb"] = round(rss_mb() - before, 1)
    same: list[dict[str, Any]] = []
    another: list[dict[str, Any]] = []
    for _ in range(runs):
        same.append(ask(first))
        another.append(ask(other))
    memory |= {"after_all_mb": round(rss_mb() - before, 1), "peak_process_mb": round(_vm("VmHWM"), 1),
               "kv_mb": round(prefix_cache.bytes_used / 1e6, 3),  # the document's and questions' entries
               "kv_full_layers_mb": round(engine.kv_bytes(len(first.ids)) / 1e6, 1)}
    return {"runtime": target.runtime, "prompt_tokens": len(first.ids), "document_tokens": tokens,
            "cold_ttft_s": round(cold["ttft_s"], 3),
            "cold_prefill_tokens_per_s": round(len(first.ids) / cold["ttft_s"], 1),
            "same_question_ttft_ms": speeds([1000 * r["ttft_s"] for r in same]),
            "another_question_ttft_ms": speeds([1000 * r["ttft_s"] for r in another]),
            "reused_tokens": [r["reused"] for r in [*same, *another]],
            "same_output_cached": all(r["tokens"] == cold["tokens"] for r in same),
            "decode_tokens_per_s": speeds([r["decode_tps"] for r in [cold, *same, *another]]),
            "memory": memory}


def _long_probe(model_dir: Path, tokens: int, runs: int, threads: int, max_new: int) -> dict[str, Any]:
    """``long_ours`` in a fresh process (its resident memory is the document's alone)."""
    cmd = [sys.executable, "-m", "bench.architectures", "--long-probe", str(model_dir), "--long-tokens", str(tokens),
           "--runs", str(runs), "--threads", str(threads), "--max-new-tokens", str(max_new)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": done.stderr.strip()[-1500:]}
    return cast(dict[str, Any], json.loads(lines[-1]))


def long_llama(gguf: Path, lib: Path, tokens: int, runs: int, threads: int, max_new: int, text: Text,
               vocab: int, flash_attn: bool = False) -> dict[str, Any]:
    """llama.cpp reading the same document: a cold prompt, then the same question and another one (its KV of the
    shared prefix reused), decode speed, the worker's memory."""
    first, other = (text.prompt(0, vocab, None, question=q, document=tokens) for q in (0, 1))
    worker = LlamaWorker(lib, gguf, threads, n_ctx=len(first.ids) + max_new + 512, flash_attn=flash_attn)
    try:
        loaded = worker.memory()
        worker.generate(text.prompt(64, vocab, None).ids, 8, [])  # warm-up
        cold = worker.generate(first.ids, max_new, [])
        after_cold = worker.memory()
        same: list[dict[str, Any]] = []
        another: list[dict[str, Any]] = []
        for _ in range(runs):  # another question first: the same one then re-reads its question, as ours does
            another.append(worker.generate(other.ids, max_new, []))
            same.append(worker.generate(first.ids, max_new, []))
        runs_all = [cold, *same, *another]
        return {"prompt_tokens": len(first.ids), "cold_ttft_s": round(cold["ttft_s"], 3),
                "cold_prefill_tokens_per_s": round(len(first.ids) / cold["ttft_s"], 1),
                "same_question_ttft_ms": speeds([1000 * r["ttft_s"] for r in same]),
                "another_question_ttft_ms": speeds([1000 * r["ttft_s"] for r in another]),
                "decode_tokens_per_s": speeds([(len(r["tokens"]) - 1) / r["decode_s"] for r in runs_all
                                               if r["decode_s"] > 0]),
                "tokens": cold["tokens"][:GREEDY_TOKENS],
                "memory": {"after_load_mb": loaded["rss_mb"], "after_cold_mb": after_cold["rss_mb"],
                           "after_all_mb": worker.memory()["rss_mb"], "peak_process_mb": worker.memory()["peak_mb"]}}
    finally:
        worker.close()


def long_document(model_dir: Path, plan: Plan, text: Text, fresh_process: bool = True) -> dict[str, Any]:
    """The long-document section: ours (in a fresh process unless ``fresh_process`` is False), then each llama.cpp
    build (one after the other: a cold 32K read takes minutes on each side)."""
    gguf = model_gguf(model_dir)
    arch = ARCHS[LONG_ARCH]
    if fresh_process:
        ours = _long_probe(model_dir, plan.long_tokens, plan.runs, plan.threads, plan.max_new)
    else:
        ours = long_ours(model_dir, plan.long_tokens, plan.runs, plan.threads, plan.max_new, text)
    if "error" in ours:
        logger.warning("long document, ours: %s", ours["error"])
    else:
        logger.info("long document, ours: cold TTFT %.1f s, cached %.0f / %.0f ms (same / another question)",
                    ours["cold_ttft_s"], ours["same_question_ttft_ms"]["median"],
                    ours["another_question_ttft_ms"]["median"])
    result: dict[str, Any] = {"measured_at": _now(), "model": arch.model, "document_tokens": plan.long_tokens,
                              "new_tokens": plan.max_new, "ours": ours}
    for name, lib in plan.builds.items():
        theirs = long_llama(gguf, lib, plan.long_tokens, plan.runs, plan.threads, plan.max_new, text, arch.shape.vocab,
                            name in plan.flash)
        result[name] = theirs
        if "cold_ttft_s" in ours:
            result[f"cold_ttft_ours_vs_{name}"] = round(theirs["cold_ttft_s"] / ours["cold_ttft_s"], 3)
            result[f"decode_ours_vs_{name}"] = round(ours["decode_tokens_per_s"]["median"]
                                                     / theirs["decode_tokens_per_s"]["median"], 3)
    return result


# ---- RAPID with a smaller drafter: verify costs and the chain model --------------------------------------------


def expected_tokens(a: float, g: int) -> float:
    """Tokens one verify step yields from a chain of ``g`` drafted tokens, each accepted with probability ``a`` given
    the ones before: 1 (the bonus) + a + a^2 + .. + a^g."""
    return float(sum(a**i for i in range(g + 1)))


def chain_speedup(a: float, g: int, step_s: float, draft_s: float, verify_s: float) -> float:
    """Tokens per second of speculative decoding over plain decoding: ``expected_tokens`` per (g drafter forwards +
    one verify of g nodes), against one token per plain step."""
    return expected_tokens(a, g) * step_s / (g * draft_s + verify_s)


def break_even(g: int, step_s: float, draft_s: float, verify_s: float) -> float | None:
    """The per-token acceptance at which a chain of ``g`` pays exactly (None: not even at 1.0)."""
    if chain_speedup(1.0, g, step_s, draft_s, verify_s) < 1.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_speedup(mid, g, step_s, draft_s, verify_s) < 1.0 else (lo, mid)
    return round(hi, 4)


def chain_model(step_s: float, draft_s: float, verify_s: dict[int, float],
                acceptances: Sequence[float] = ACCEPTANCES, lengths: Sequence[int] = DRAFT_LENGTHS) -> dict[str, Any]:
    """Per acceptance and draft length: expected tokens per verify step, the step's cost, the speed-up over plain
    decoding; the best length per acceptance; the break-even acceptance per length."""
    by_a: dict[str, Any] = {}
    for a in acceptances:
        rows = {str(g): {"expected_tokens": round(expected_tokens(a, g), 4),
                         "step_ms": round(1000 * (g * draft_s + verify_s[g]), 2),
                         "speedup": round(chain_speedup(a, g, step_s, draft_s, verify_s[g]), 4)} for g in lengths}
        best = max(rows, key=lambda g: rows[g]["speedup"])
        by_a[str(a)] = {"by_length": rows, "best_length": int(best), "best_speedup": rows[best]["speedup"],
                        "pays": rows[best]["speedup"] > 1.0}
    return {"acceptance": by_a,
            "break_even_acceptance": {str(g): break_even(g, step_s, draft_s, verify_s[g]) for g in lengths}}


def _tree_name(branches: int, depth: int) -> str:
    return f"tree_{branches}x{depth}"


def drafter_costs(target: LoadedModel, drafter: LoadedModel, plan: Plan, draft_context: int = RAPID_BUDGET
                  ) -> dict[str, Any]:
    """Our target's verify forwards (chains of ``VERIFY_CHAINS`` nodes, trees of ``VERIFY_TREES``) on a
    ``plan.drafter_context``-token cache and the drafter's one-token forward on a ``draft_context``-token cache,
    interleaved, ``plan.verify_repeats`` each after a warm-up round; the chain model on their medians."""
    engines = {"target": Engine(dataclasses.replace(target, eos_token_ids=()), None),
               "drafter": Engine(dataclasses.replace(drafter, eos_token_ids=()), None)}
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    caches: dict[str, SlotCache] = {}
    roots: dict[str, int] = {}
    with torch.inference_mode():
        for role, context in (("target", plan.drafter_context), ("drafter", draft_context)):
            engine = engines[role]
            ids = torch.randint(0, engine.model.vocab_size, (context,), generator=gen).tolist()
            caches[role] = SlotCache(engine.num_layers, context + max(VERIFY_CHAINS) + 24)
            t = time.perf_counter()
            engine.prefill(ids, caches[role])
            logger.info("drafter section: %s prefilled %d tokens in %.1f s", role, context, time.perf_counter() - t)
            roots[role] = ids[-1]
    vocab = target.vocab_size
    shapes: dict[str, tuple[str, DraftTree]] = {}
    for n in VERIFY_CHAINS:
        shapes[f"chain_{n}"] = ("target", DraftTree.chain([rng.randrange(vocab) for _ in range(n)], "bench"))
    for b, d in VERIFY_TREES:
        shapes[_tree_name(b, d)] = ("target", branchy_tree(b, d, vocab, rng))
    shapes["drafter_step"] = ("drafter", DraftTree())
    times: dict[str, list[float]] = {k: [] for k in shapes}
    with torch.inference_mode():
        for rep in range(plan.verify_repeats + 1):  # the first round warms up
            for key, (role, tree) in shapes.items():
                cache, base = caches[role], caches[role].length
                t = time.perf_counter()
                engines[role].verify(roots[role], tree, cache, SamplingMetadata())
                if rep:
                    times[key].append(time.perf_counter() - t)
                cache.truncate(base)
    med = {k: median(v) for k, v in times.items()}
    step, draft = med["chain_0"], med["drafter_step"]
    verify = {g: med[f"chain_{g}"] for g in VERIFY_CHAINS}
    return {
        "target_context": plan.drafter_context, "drafter_context": draft_context, "repeats": plan.verify_repeats,
        "target_runtime": target.runtime, "drafter_runtime": drafter.runtime,
        "target_step_ms": round(1000 * step, 2), "drafter_forward_ms": round(1000 * draft, 2),
        "drafter_vs_step": round(draft / step, 4),
        "verify_ms": {k: round(1000 * v, 2) for k, v in med.items() if k != "drafter_step"},
        "verify_vs_step": {k: round(v / step, 3) for k, v in med.items() if k != "drafter_step"},
        "spread": {k: round(max(v) / min(v) - 1, 4) for k, v in times.items() if v and min(v) > 0},
        "chain_model": chain_model(step, draft, verify),
    }


# ---- the run ------------------------------------------------------------------------------------------------


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` over ``old``: an architecture's contexts measured now replace those measured before, the others stay;
    a section measured now replaces the earlier one; ``runs`` lists every run's time, arguments and pieces."""
    merged = {**old, **{k: v for k, v in new.items() if k not in ("architectures", "runs")}}
    archs = dict(old.get("architectures", {}))
    for name, row in new.get("architectures", {}).items():
        before = archs.get(name, {})
        decode = {**before.get("decode", {}), **row.get("decode", {})}
        archs[name] = {**before, **row, "decode": decode}
    merged["architectures"] = archs
    merged["llama_cpp_builds"] = {**old.get("llama_cpp_builds", {}), **new.get("llama_cpp_builds", {})}
    merged["runs"] = [*old.get("runs", []), *new.get("runs", [])]
    return merged


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    models_dir = Path(args.data_dir) / "models"
    install_bundled(models_dir)
    bundled_dir = bundled_gguf_dir(models_dir)
    cache = Path(args.cache_dir)
    found = available_builds(Path(args.builds_dir))
    builds = {name: found[name.removesuffix("_fa")] for name in args.builds if name.removesuffix("_fa") in found}
    plan = Plan(runs=args.runs, threads=args.threads, max_new=args.max_new_tokens, builds=builds,
                flash=frozenset(name for name in builds if name.endswith("_fa")),
                contexts=tuple(args.contexts), prefill_tokens=args.prefill_tokens, long_tokens=args.long_tokens,
                drafter_context=args.drafter_context, verify_repeats=args.verify_repeats)
    from transformers import AutoTokenizer

    text = Text.of(AutoTokenizer.from_pretrained(str(bundled_dir)))
    result: dict[str, Any] = {
        "benchmark": "architectures",
        "config": {"threads": args.threads, "runs": args.runs, "max_new_tokens": args.max_new_tokens,
                   "greedy_tokens": min(GREEDY_TOKENS, args.max_new_tokens), "cache_dir": str(cache),
                   "min_context": MIN_CONTEXT},
        "machine": machine_info(),
        "llama_cpp_builds": {name: {"lib_dir": str(lib), "flash_attn": name.endswith("_fa"),
                                    "build_flags": build_flags(lib)} for name, lib in
                             builds.items()},
        "architectures": {},
        "runs": [{"at": _now(), "archs": args.archs, "sections": args.sections, "contexts": args.contexts,
                  "prefill_tokens": args.prefill_tokens}],
    }
    previous: dict[str, Any] = {}
    if not args.fresh and args.json.is_file():
        loaded = json.loads(args.json.read_text())
        previous = loaded if loaded.get("benchmark") == "architectures" else {}
    quantizer = next(iter(found.values()), None)
    if quantizer is None:
        result["skipped"] = "no llama.cpp build to quantize with (scripts/build-llama-cpp, make bench)"
        return merge(previous, result)

    def save() -> None:
        write_json(args.json, merge(previous, result))

    def dir_of(arch: Arch) -> Path:
        return arch_dir(arch, bundled_dir, cache, quantizer, args.threads)

    decode, prefill = "decode" in args.sections, "prefill" in args.sections
    if decode or prefill:
        for name in args.archs:
            model_dir = dir_of(ARCHS[name])
            result["architectures"][name] = measure_arch(name, ARCHS[name], model_dir, plan, text, decode, prefill)
            save()
    if "long" in args.sections:
        out(f"long document: {ARCHS[LONG_ARCH].model} shape, {args.long_tokens} tokens")
        result["long_document"] = long_document(dir_of(ARCHS[LONG_ARCH]), plan, text)
        save()
    if "verify" in args.sections:
        for name in args.archs:
            out(f"verify cost: {ARCHS[name].model} shape")
            target = load_ours(dir_of(ARCHS[name]), args.threads)
            result.setdefault("verify", {})[name] = {"measured_at": _now(), **verify_curve(target, plan)}
            del target
            gc.collect()
            save()
    if "drafter" in args.sections:
        target_dir, drafter_dir = dir_of(TARGET), dir_of(ARCHS[DRAFTER_ARCH])
        out(f"drafter: {ARCHS[DRAFTER_ARCH].model} shape for a {TARGET.model} shape")
        target, drafter = load_ours(target_dir, args.threads), load_ours(drafter_dir, args.threads)
        result["drafter"] = {"measured_at": _now(), "target": file_row(TARGET, target_dir),
                             "drafter": file_row(ARCHS[DRAFTER_ARCH], drafter_dir),
                             **drafter_costs(target, drafter, plan)}
        del target, drafter
        gc.collect()
        save()
    return merge(previous, result)


# ---- the table ----------------------------------------------------------------------------------------------


def _k(tokens: int | str) -> str:
    n = int(tokens)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _builds_in(piece: dict[str, Any]) -> list[str]:
    return [b for b in LLAMA_BUILDS if isinstance(piece.get(b), dict) or f"{b}_tokens_per_s" in piece]


def _label(build: str) -> str:
    return build.removeprefix("llama_cpp").removeprefix("_").replace("fa", "flash attn").replace("_", " ")


def _pair(piece: dict[str, Any], fmt: str = ".1f") -> str:
    """Ours / the first llama.cpp build (the ratio), then each other build's figure and ratio."""
    builds = _builds_in(piece)
    if not isinstance(piece.get("ours"), dict) or not builds:
        return "-"
    first, *rest = builds
    cell = f"{piece['ours']['median']:{fmt}} / {piece[first]['median']:{fmt}} (**{piece[f'ours_vs_{first}']:.2f}x**)"
    return cell + "".join(f"; {_label(b)} {piece[b]['median']:{fmt}} ({piece[f'ours_vs_{b}']:.2f}x)" for b in rest)


def _prefill(pf: dict[str, Any]) -> str:
    builds = [b for b in _builds_in(pf) if f"ours_vs_{b}" in pf]
    if "ours_tokens_per_s" not in pf or not builds:
        return "-"
    first, *rest = builds
    cell = f"{pf['ours_tokens_per_s']:.0f} / {pf[first + '_tokens_per_s']:.0f} ({pf['ours_vs_' + first]:.2f}x)"
    return cell + "".join(f"; {_label(b)} {pf[b + '_tokens_per_s']:.0f} ({pf['ours_vs_' + b]:.2f}x)" for b in rest)


def _checks(row: dict[str, Any]) -> str:
    """The greedy and logits checks against the first llama.cpp build, per context: '=' equal 32 tokens, else the
    first divergence (and the top-two gaps of both runtimes there); the logits' largest difference after the prompt."""
    parts = []
    for context, piece in sorted(row.get("decode", {}).items(), key=lambda kv: int(kv[0])):
        build = next(iter(_builds_in(piece)), "llama_cpp")
        g = piece.get("greedy", {}).get(f"vs_{build}")
        lg = piece.get("logits", {}).get(build)
        if g is None:
            continue
        if g["equal"]:
            mark = "="
        else:
            gap = [round(t[0][1] - t[1][1], 2) for t in (g.get("ours_top2"), g.get("llama_cpp_top2")) if t]
            mark = f"{g.get('first_divergence', '!=')} (gaps {'/'.join(str(x) for x in gap)})"
        if lg is not None:
            mark += f", logits ±{lg['max_abs_diff']:.2f}"
        parts.append(f"{_k(context)}: {mark}")
    return "; ".join(parts) or "-"


def table(result: dict[str, Any]) -> list[str]:
    """Markdown rows for the README: per architecture, decode at each context and prefill, ours / llama.cpp's best
    build (medians, the ratio); the checks; then the long document and the drafter's chain model where measured."""
    archs = result.get("architectures", {})
    contexts = sorted({c for row in archs.values() for c in row.get("decode", {})}, key=int)
    lines = ["| architecture (shape) | weights MB | " + " | ".join(f"decode at {_k(c)} ours / llama.cpp (tok/s)"
                                                                    for c in contexts)
             + " | prefill ours / llama.cpp (tok/s) | greedy (32 tokens), logits after the prompt |",
             "|---|---|" + "---|" * len(contexts) + "---|---|"]
    for name, row in archs.items():
        ours = row.get("ours")
        weights = ours.get("served_weight_mb", "-") if isinstance(ours, dict) else str(ours)[:60]
        cells = [_pair(row["decode"][c]) if c in row.get("decode", {}) else "-" for c in contexts]
        model = row.get("model", "?") + (f", {row['layers_written']} of {row['model_layers']} layers"
                                         if "layers_written" in row else "")
        lines.append(f"| `{name}` ({model}) | {weights} | " + " | ".join(cells)
                     + f" | {_prefill(row.get('prefill', {}))} | {_checks(row)} |")
    long = result.get("long_document")
    if long and isinstance(long.get("ours"), dict) and "cold_ttft_s" in long["ours"]:
        sides = [long["ours"], *(long[b] for b in _builds_in(long))]
        names = " / ".join(["ours", *(f"llama.cpp {_label(b)}".strip() for b in _builds_in(long))])

        def both(key: str, unit: str, fmt: str = ".2f") -> str:
            def one(side: dict[str, Any]) -> str:
                v = side.get(key)
                v = v["median"] if isinstance(v, dict) else v
                return f"{v:{fmt}}{unit}" if isinstance(v, int | float) else "-"
            return " / ".join(one(side) for side in sides)

        head = f"| {long['model']} shape, {_k(long['document_tokens'])}-token document whole | {names} |"
        lines += ["", head,
                  "|---|---|",
                  f"| time to first token, cold | {both('cold_ttft_s', ' s', '.1f')} |",
                  f"| time to first token, same question again (document KV cached) | "
                  f"{both('same_question_ttft_ms', ' ms', '.0f')} |",
                  f"| time to first token, another question (document KV cached) | "
                  f"{both('another_question_ttft_ms', ' ms', '.0f')} |",
                  f"| decode at that length (tok/s) | {both('decode_tokens_per_s', '', '.1f')} |",
                  "| resident memory after (MB over the process before loading) | "
                  + " / ".join(str(side.get("memory", {}).get("after_all_mb", "-")) for side in sides) + " |"]
    drafter = result.get("drafter")
    if drafter and "chain_model" in drafter:
        cm = drafter["chain_model"]
        lines += ["", f"| RAPID, {drafter['drafter']['model']}-shape drafter for a {drafter['target']['model']} "
                      f"shape (step {drafter['target_step_ms']:.0f} ms, drafter token "
                      f"{drafter['drafter_forward_ms']:.0f} ms) | "
                  + " | ".join(f"g={g}" for g in DRAFT_LENGTHS) + " |",
                  "|---|" + "---|" * len(DRAFT_LENGTHS)]
        for a, row in cm["acceptance"].items():
            lines.append(f"| speed-up over plain decoding at acceptance {a} | "
                         + " | ".join(f"{row['by_length'][str(g)]['speedup']:.2f}x" for g in DRAFT_LENGTHS) + " |")
        lines.append("| break-even acceptance | " + " | ".join(
            f"{v:.2f}" if v is not None else "never" for v in cm["break_even_acceptance"].values()) + " |")
    return lines


# ---- the command ----------------------------------------------------------------------------------------------


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def _names(known: Sequence[str]) -> Any:
    def parse(value: str) -> list[str]:
        names = [v.strip().lower() for v in value.split(",") if v.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {','.join(known)}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.architectures", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--archs", type=_names(list(ARCHS)), default=list(ARCHS),
                   help=f"architectures (comma-separated; default all: {','.join(ARCHS)})")
    p.add_argument("--sections", type=_names(SECTIONS), default=list(SECTIONS),
                   help=f"what to measure (comma-separated; default all: {','.join(SECTIONS)})")
    p.add_argument("--contexts", type=_ints, default=[2048, 16384], help="decode contexts (default 2048,16384)")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="the prefill section's prompt (default 2048)")
    p.add_argument("--long-tokens", type=int, default=32768, help="the long document's tokens (default 32768)")
    p.add_argument("--drafter-context", type=int, default=2048, help="the target's cache in the drafter section")
    p.add_argument("--verify-repeats", type=int, default=7, help="timings per verify shape in the drafter section")
    p.add_argument("--runs", type=int, default=3, help="interleaved repetitions (medians)")
    p.add_argument("--threads", type=int, default=2, help="threads of every runtime")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    p.add_argument("--builds", type=_names(list(LLAMA_BUILDS)), default=["llama_cpp"],
                   help="llama.cpp builds to compare with (default llama_cpp: the best one here; *_fa: the same build "
                        "with its flash attention on)")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "architectures.json")
    p.add_argument("--fresh", action="store_true", help="write a new JSON instead of merging into the one there")
    p.add_argument("--cache-dir", default=str(default_cache_dir()), help="where the derived GGUF files are kept")
    p.add_argument("--builds-dir", default=str(BUILDS_DIR), help="the llama.cpp builds (scripts/build-llama-cpp)")
    p.add_argument("--data-dir", default=str(REPO / "data"), help="where the bundled model lives")
    p.add_argument("--long-probe", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    if args.long_probe is not None:
        from transformers import AutoTokenizer

        models_dir = Path(args.data_dir) / "models"
        install_bundled(models_dir)
        text = Text.of(AutoTokenizer.from_pretrained(str(bundled_gguf_dir(models_dir))))
        print(json.dumps(long_ours(args.long_probe, args.long_tokens, args.runs, args.threads, args.max_new_tokens,
                                   text)))
        return 0
    result = run_benchmark(args)
    write_json(args.json, result)
    logger.info("wrote %s", args.json)
    for line in table(result):
        out(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
