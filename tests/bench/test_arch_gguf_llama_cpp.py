"""Ours against llama.cpp on the same files: the tiny GGUF of every architecture (``tests/decoding/gguf_families.py``,
written as llama.cpp's converter writes it) read by llama.cpp itself and by our runtime, on a 300-token prompt that
crosses Gemma's sliding windows (72): both compute transformers' logits, and each other's.

- F32 files (F32 KV, no flash attention on llama.cpp's side; our runtime at F32): max |ours - llama.cpp| and
  max |llama.cpp - transformers| within ``F32_TOL`` x the logits' standard deviation (Gemma looser: ggml's CPU GELU
  goes through an fp16 table), the greedy argmax equal at >= 99% of the rows.
- Q8_0 files: both runtimes quantize the activations to 8 bits, each its own way: max within ``Q8_TOL``, root mean
  square within ``Q8_RMS_TOL`` x the standard deviation, argmax equal at >= ``Q8_ARGMAX`` of the rows (random logits
  are flat: the top two are often close).
- Mistral and Phi-3 get windows longer than the prompt: Mistral's is not in its GGUF (neither runtime applies it) and
  llama.cpp turns Phi-3's off (its loader says so) where ours applies it as transformers does.

Measured with llama-cpp-python 0.3.36's llama.cpp (AVX-512 build), logits' std 0.56-0.61 (Gemma 0.075): F32 ours vs
llama.cpp and llama.cpp vs transformers both 2-9e-6 std at most (Gemma 1.9-2.1e-3; Qwen3-MoE 3.7e-6 / 4.1e-6); Q8_0
ours vs llama.cpp max 0.06-0.11 std (the mixtures of experts 0.48-0.95: a near-tied route flips, ``Q8_TOL_ARCH``),
root mean square 0.010-0.021, argmax equal at 96-99% of the rows. gpt-oss runs its YaRN as llama.cpp does here (below).

The mixtures of experts also go through llama.cpp's own tools (``converted``): the HF dirs of tiny Qwen3-MoE and
gpt-oss models written to GGUF by llama.cpp's converter (``convert_hf_to_gguf.py``, F32) and quantized by its quantizer
(Q8_0; gpt-oss also MXFP4_MOE, its experts MXFP4): ours against transformers and llama.cpp on the F32 files within
``F32_TOL_DEFAULT`` (measured 1.4-4.6e-6 std), and against llama.cpp on the quantized ones as above (gpt-oss Q8_0 and
MXFP4_MOE: max 0.04 std, root mean square 0.007, argmax 99.7%). gpt-oss there runs its YaRN as llama.cpp does
(``ggml_rope_yarn_corr_dims`` rounds the correction range outward, transformers' gpt-oss does not: ours follows the
file's model as transformers runs it, 2.4e-3 std from llama.cpp at 300 positions, reported beside).

Needs a llama.cpp build (``scripts/build-llama-cpp``, into ``.venv/llama-builds/best``, or ``LLAMA_CPP_LIB_PATH``)
and llama-cpp-python (the bench extra); skipped without them. One worker process runs every file, as
llama-cpp-python reads ``LLAMA_CPP_LIB_PATH`` at import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from bench import llama_ref
from decoding.runtime.gguf.tokenizer import tokenizer_from_gguf
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.weights import weights_from_gguf
from tests.decoding.conftest import make_tiny_family, needs_kernels
from tests.decoding.gguf_families import write_family_gguf
from tests.decoding.runtime.gguf_vocabs import FAMILY_VOCAB, write_vocab

ARCHS = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3moe", "olmoe", "gpt-oss", "gemma2", "gemma3",
         "phi3"]
PROMPT_LEN = 300
LONG_WINDOW = {"mistral": 1024, "phi3": 1024}  # see the module docstring
F32_TOL = {"gemma2": 5e-3, "gemma3": 5e-3}  # of the logits' standard deviation
F32_TOL_DEFAULT = 2e-4
Q8_TOL, Q8_RMS_TOL, Q8_ARGMAX = 0.25, 0.05, 0.9
# a mixture of experts: a row whose top experts are near-tied routes by each runtime's own activation rounding, and a
# flipped expert moves that row by far more than rounding (measured: Qwen3-MoE max 0.48 std on our writer's file,
# 0.69 on the converter's, root mean square 0.017 / 0.023, argmax 97%; gpt-oss 0.95 on ours, 0.04 on the converter's,
# root mean square 0.019 / 0.007, argmax 99.3-99.7%)
# Mixtral 0.49 / OLMoE 0.39 std, root mean square 0.013-0.020, argmax 97%
Q8_TOL_ARCH = {"qwen3moe": 1.0, "gpt-oss": 1.0, "mixtral": 1.0, "olmoe": 1.0}
KINDS = {"F32": gguf.GGMLQuantizationType.F32, "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def _lib_dir() -> Path | None:
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    for d in ([Path(env)] if env else []) + [llama_ref.BUILDS_DIR / "best"]:
        if any(d.glob("libllama.so*")):
            return d
    return None


LIB = _lib_dir()
pytestmark = [needs_kernels, pytest.mark.skipif(
    LIB is None or importlib.util.find_spec("llama_cpp") is None,
    reason="no llama.cpp build (scripts/build-llama-cpp or LLAMA_CPP_LIB_PATH) or no llama-cpp-python",
)]  # fmt: skip

WORKER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
for job in json.loads(sys.argv[1]):
    ids = np.load(job["ids"]).tolist()
    llm = Llama(model_path=job["gguf"], n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True, type_k=0, type_v=0,
                flash_attn=False, n_threads=2, n_threads_batch=2, verbose=False)
    llm.eval(ids)
    np.save(job["out"], np.asarray(llm.scores[: len(ids)], dtype=np.float32))
    del llm
"""


def _model(arch: str, vocab: int) -> torch.nn.Module:
    """Hidden = heads x head size (as real models have: llama.cpp's Qwen 2 reads no key length), narrow weights."""
    window = {"window": LONG_WINDOW[arch]} if arch in LONG_WINDOW else {}
    layers = 6 if arch == "gemma3" else 3  # llama.cpp lays Gemma 3's windows out 5 : 1 from the layer count
    return make_tiny_family(arch, seed=11, vocab=vocab, layers=layers, max_position_embeddings=1024, hidden_size=128,
                            initializer_range=0.05, **window)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """(arch, kind) -> transformers' logits ("hf", on the file's dequantized weights for Q8_0: not kept), ours and
    llama.cpp's on the same file."""
    tmp = tmp_path_factory.mktemp("arch_gguf")
    ids = torch.randint(3, 97, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0))
    np.save(tmp / "ids.npy", ids.numpy().astype(np.int64))
    results: dict[tuple[str, str], dict[str, Any]] = {}
    jobs = []
    for arch in ARCHS:
        (tmp / arch).mkdir()
        vocab = len(tokenizer_from_gguf(write_vocab(FAMILY_VOCAB[arch], tmp / arch)))  # llama.cpp needs one
        hf = _model(arch, vocab)
        if arch == "gpt-oss":
            _llama_cpp_yarn(hf)
        for kind, qtype in KINDS.items():
            path = write_family_gguf(tmp / f"{arch}.{kind}.gguf", hf, qtype, vocab=FAMILY_VOCAB[arch])
            weights = weights_from_gguf(path)
            if arch == "gpt-oss":
                _llama_cpp_yarn_config(weights.config)
            model = QuantizedModel(weights, torch.float32)
            with torch.inference_mode():
                ours = model.forward(ids[None], model.new_cache(PROMPT_LEN)).numpy()
                want = hf(ids[None]).logits[0].float().numpy() if kind == "F32" else None
            results[arch, kind] = {"hf": want, "ours": ours, "out": tmp / f"{arch}.{kind}.npy"}
            jobs.append({"gguf": str(path), "ids": str(tmp / "ids.npy"), "out": str(results[arch, kind]["out"])})
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(jobs)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for res in results.values():
        res["cpp"] = np.load(res["out"])
    return results


def _report(what: str, ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    """max |diff| and its root mean square, both over the logits' standard deviation, and the argmax agreement."""
    std = float(ref.std())
    rel, rms = float(np.abs(got - ref).max()) / std, float(np.sqrt(((got - ref) ** 2).mean())) / std
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    print(f"{what:24s} std {std:.3f}  max|diff| / std {rel:.3g}  rms / std {rms:.3g}  argmax {agree:.3f}")
    return rel, rms, agree


@pytest.mark.parametrize("arch", ARCHS)
def test_ours_and_llama_cpp_compute_transformers_logits_from_f32_files(runs: dict, arch: str) -> None:
    res, tol = runs[arch, "F32"], F32_TOL.get(arch, F32_TOL_DEFAULT)
    for what, ref, got in (("llama.cpp vs transformers", res["hf"], res["cpp"]),
                           ("ours vs llama.cpp", res["cpp"], res["ours"])):
        rel, _, agree = _report(f"{arch} F32 {what}", ref, got)
        assert rel <= tol and agree >= 0.99, f"{arch}: {what} differ by {rel:.3g} std, argmax {agree:.3f}"


@pytest.mark.parametrize("arch", ARCHS)
def test_ours_follows_llama_cpp_on_q8_0_files(runs: dict, arch: str) -> None:
    res = runs[arch, "Q8_0"]
    rel, rms, agree = _report(f"{arch} Q8_0 ours vs llama.cpp", res["cpp"], res["ours"])
    tol = Q8_TOL_ARCH.get(arch, Q8_TOL)
    assert rel <= tol and rms <= Q8_RMS_TOL and agree >= Q8_ARGMAX, f"{arch}: {rel:.3g} / {rms:.3g} std, {agree}"


# ---- the files llama.cpp's own converter and quantizer write --------------------------------------------------------

CONVERTED = {"qwen3moe": ("Q8_0",), "gpt-oss": ("Q8_0", "MXFP4_MOE")}  # llama_ftype names past F32


def _converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` beside the build (``scripts/build-llama-cpp`` copies it there)."""
    script = LIB / "converter" / "convert_hf_to_gguf.py" if LIB is not None else None
    return script if script is not None and script.is_file() else None


def _llama_cpp_yarn_config(config: Any) -> None:
    """gpt-oss's YaRN as llama.cpp runs it: its correction range rounded outward (``truncate``), in place."""
    config.rope_scaling = {**config.rope_scaling, "truncate": True}


def _llama_cpp_yarn(hf: torch.nn.Module) -> None:
    """A transformers gpt-oss with llama.cpp's YaRN (``_llama_cpp_yarn_config``), its rotary tables made again."""
    _llama_cpp_yarn_config(hf.config)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """(arch, kind) -> logits of transformers (F32), ours and llama.cpp's on the file llama.cpp's converter writes
    from the HF dir (F32) and its quantizer makes of that; for gpt-oss also ours with the file's YaRN as transformers
    runs it ("ours_reference"). The vocabulary is SmolLM2's (one the converter knows)."""
    from bench.llama_ref import quantize
    from decoding.runtime.bundled import bundled_gguf_path

    script = _converter()
    if script is None:
        pytest.skip("no llama.cpp converter beside the build (scripts/build-llama-cpp copies it)")
    assert LIB is not None
    tmp = tmp_path_factory.mktemp("converted")
    tokenizer = tokenizer_from_gguf(bundled_gguf_path())
    ids = torch.randint(3, 97, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    np.save(tmp / "ids.npy", ids.numpy().astype(np.int64))
    results: dict[tuple[str, str], dict[str, Any]] = {}
    for arch, kinds in CONVERTED.items():
        hf, d = _model(arch, len(tokenizer)), tmp / arch
        if arch == "gpt-oss":
            _llama_cpp_yarn(hf)
        hf.save_pretrained(d)
        tokenizer.save_pretrained(d)
        f32 = d / "F32.gguf"
        done = subprocess.run([sys.executable, str(script), str(d), "--outtype", "f32", "--outfile", str(f32)],
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        with torch.inference_mode():
            want = hf(ids[None]).logits[0].float().numpy()
        for kind in ("F32", *kinds):
            path = d / f"{kind}.gguf"
            if kind != "F32":
                quantize(LIB, f32, path, f"LLAMA_FTYPE_MOSTLY_{kind}", 2)
            weights = weights_from_gguf(path)
            res: dict[str, Any] = {"hf": want, "gguf": str(path), "out": d / f"{kind}.npy"}
            with torch.inference_mode():
                if arch == "gpt-oss":  # as the file says (transformers' YaRN), then as llama.cpp rounds it
                    model = QuantizedModel(weights, torch.float32)
                    res["ours_reference"] = model.forward(ids[None], model.new_cache(PROMPT_LEN)).numpy()
                    _llama_cpp_yarn_config(weights.config)
                model = QuantizedModel(weights, torch.float32)
                res["ours"] = model.forward(ids[None], model.new_cache(PROMPT_LEN)).numpy()
            results[arch, kind] = res
    jobs = [{"gguf": r["gguf"], "ids": str(tmp / "ids.npy"), "out": str(r["out"])} for r in results.values()]
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LIB)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(jobs)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for res in results.values():
        res["cpp"] = np.load(res["out"])
    return results


@pytest.mark.parametrize("arch", list(CONVERTED))
def test_llama_cpps_converter_writes_files_we_serve_as_llama_cpp_does(converted: dict, arch: str) -> None:
    """F32: ours within F32_TOL_DEFAULT of transformers and of llama.cpp (gpt-oss with llama.cpp's YaRN rounding on
    every side; ours with the file's YaRN as transformers runs it is reported beside)."""
    res = converted[arch, "F32"]
    for what, ref, got in (("ours vs transformers", res["hf"], res["ours"]), ("ours vs llama.cpp", res["cpp"],
                                                                                 res["ours"])):
        rel, _, agree = _report(f"{arch} converter F32 {what}", ref, got)
        assert rel <= F32_TOL_DEFAULT and agree >= 0.99, f"{arch}: {what} differ by {rel:.3g} std, argmax {agree}"
    if "ours_reference" in res:
        _report(f"{arch} F32 unrounded YaRN vs llama.cpp", res["cpp"], res["ours_reference"])


@pytest.mark.parametrize(("arch", "kind"), [(a, k) for a, kinds in CONVERTED.items() for k in kinds])
def test_llama_cpps_quantizer_writes_files_we_serve_as_llama_cpp_does(converted: dict, arch: str, kind: str) -> None:
    res = converted[arch, kind]
    rel, rms, agree = _report(f"{arch} converter {kind} ours vs llama.cpp", res["cpp"], res["ours"])
    tol = Q8_TOL_ARCH.get(arch, Q8_TOL)
    assert rel <= tol and rms <= Q8_RMS_TOL and agree >= Q8_ARGMAX, f"{arch} {kind}: {rel:.3g} / {rms:.3g}, {agree}"
