"""Model loading, vocabulary checks, and the bundled SmolLM2 conversion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from decoding.errors import ModelFileError, ModelLoadError, VocabularyMismatch
from decoding.runtime import bundled, kernels
from decoding.runtime.bundled import build as bundled_build
from decoding.runtime.families import GGUF_ARCHITECTURES
from decoding.runtime.kernels import kernels_active
from decoding.runtime.loader import LoadedModel, LoadOptions, check_same_vocab, load_model, tokenizer_fingerprint
from decoding.runtime.torch_runtime import TorchRuntime
from tests.decoding.conftest import default_kv_name, make_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_model(path)


def test_load_local_dir_gives_eval_model_with_facts(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    path, original = tiny_dir
    loaded = load_model(str(path), LoadOptions(cpu_quant="none"))
    assert isinstance(loaded, LoadedModel)
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert loaded.runtime == "torch:float32"
    assert isinstance(loaded.model, TorchRuntime) and not loaded.model.module.training
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert loaded.max_context == 256
    assert loaded.vocab_size == len(loaded.tokenizer) == original.config.vocab_size
    assert loaded.name == path.name
    ids = torch.tensor([loaded.tokenizer("the quick dog").input_ids])
    plain = load_model(str(path), LoadOptions(cpu_quant="none", cpu_kernels=False))
    assert isinstance(plain.model, TorchRuntime) and not kernels_active(plain.model.module)
    with torch.inference_mode():
        assert torch.equal(plain.model.module(ids).logits, original(ids).logits)
        if kernels.loaded() is not None:  # fp32 CPU models run small forwards on the kernels by default
            assert kernels_active(loaded.model.module)
            torch.testing.assert_close(loaded.model.module(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(kernels.load() is None, reason="no CPU kernels: no quantized runtime")
@pytest.mark.parametrize(("quant", "kv", "weights"), [("auto", "auto", "q8_0"), ("q4_1", "float32", "q4_1")])
def test_cpu_loads_quantize_an_hf_dir(tiny_dir: tuple[Path, LlamaForCausalLM], quant: str, kv: str,
                                      weights: str) -> None:
    """On a CPU an HF model is quantized at load (q8_0 by default) and served by the quantized runtime."""
    path, original = tiny_dir
    loaded = load_model(str(path), LoadOptions(cpu_quant=quant, kv_dtype=kv))
    kv_name = default_kv_name() if kv == "auto" else kv
    assert loaded.runtime == f"cpu-quantized:quantized:{weights}/kv-{kv_name}"
    assert loaded.weight_bytes < sum(p.numel() * 4 for p in original.parameters()) / 3
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert (loaded.max_context, loaded.vocab_size, loaded.name) == (256, original.config.vocab_size, path.name)
    ids = torch.tensor([loaded.tokenizer("the quick dog jumps over the lazy dog").input_ids])
    with torch.inference_mode():
        got, want = loaded.model(ids).logits[0], original(ids).logits[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.98


def test_unknown_quant_and_kv_settings_are_domain_errors(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    with pytest.raises(ModelLoadError, match="cpu_quant"):
        load_model(str(tiny_dir[0]), LoadOptions(cpu_quant="q2_k"))
    with pytest.raises(ModelLoadError, match="kv_dtype"):
        load_model(str(tiny_dir[0]), LoadOptions(kv_dtype="int4"))
    with pytest.raises(ModelLoadError, match="kv_dtype int8 is a storage of the quantized CPU runtime"):
        load_model(str(tiny_dir[0]), LoadOptions(kv_dtype="int8", cpu_quant="none"))  # transformers runs it
    if kernels.load() is not None:
        with pytest.raises(ModelLoadError, match="head size 16 is not a multiple of 32"):
            load_model(str(tiny_dir[0]), LoadOptions(kv_dtype="int8"))  # the quantized runtime, head size 16


def test_without_kernels_the_cpu_target_falls_back_to_torch(
    tiny_dir: tuple[Path, LlamaForCausalLM], caplog: pytest.LogCaptureFixture
) -> None:
    kernels.configure(enabled=False)
    try:
        with caplog.at_level("WARNING"):
            loaded = load_model(str(tiny_dir[0]))
        assert loaded.runtime == "torch:float32"
        assert isinstance(loaded.model, TorchRuntime) and not kernels_active(loaded.model.module)
        assert "quantized CPU runtime unavailable" in caplog.text
    finally:
        kernels.configure()
        kernels.load()


def test_load_with_explicit_dtype_and_threads(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    before = torch.get_num_threads()
    loaded = load_model(str(tiny_dir[0]), LoadOptions(device="cpu", dtype="bfloat16", threads=1))
    assert loaded.dtype == torch.bfloat16
    assert isinstance(loaded.model, TorchRuntime) and next(loaded.model.module.parameters()).dtype == torch.bfloat16
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_bundled_spec_on_torch_uses_the_fp32_dir(tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    import shutil

    fp32 = bundled.bundled_target_dir(tmp_path)
    shutil.copytree(tiny_dir[0], fp32)
    (fp32 / bundled.MARKER_NAME).write_text(json.dumps({"format": bundled.FORMAT_VERSION}))
    (fp32 / "model.safetensors").touch(exist_ok=True)
    loaded = load_model("bundled", LoadOptions(models_dir=tmp_path, cpu_quant="none"))
    assert loaded.name == f"bundled:{bundled.TARGET_DIR_NAME}" and loaded.runtime == "torch:float32"


@pytest.mark.parametrize(
    ("spec", "models_dir", "quant", "message"),
    [
        ("bundled", None, "auto", "no models_dir"),
        ("bundled", Path("/nonexistent/models"), "auto", "ragspec models"),
        ("{tmp}", None, "auto", "no config.json"),
        ("nobody/no-such-model-xyz", None, "none", "cannot load model"),
    ],
)
def test_load_errors_are_domain_errors(
    tmp_path: Path, spec: str, models_dir: Path | None, quant: str, message: str
) -> None:
    if quant == "auto" and spec == "bundled" and models_dir is not None and kernels.load() is None:
        pytest.skip("without the CPU kernels 'bundled' converts on demand")
    with pytest.raises(ModelLoadError, match=message):
        options = LoadOptions(models_dir=models_dir, local_files_only=True, cpu_quant=quant)
        load_model(spec.format(tmp=tmp_path), options)


@pytest.mark.skipif(kernels.load() is None, reason="no CPU kernels: no quantized runtime")
def test_a_model_that_is_itself_wrong_is_a_model_file_error(tmp_path: Path) -> None:
    """A path that is not there is said so (not taken for a hub id), and a GGUF of another architecture is named by
    the weights' reader before its tokenizer is built (this one has none: transformers would complain of that)."""
    import gguf
    import numpy as np

    with pytest.raises(ModelFileError, match=f"^{tmp_path}/gone/model.gguf does not exist$"):
        load_model(str(tmp_path / "gone" / "model.gguf"), LoadOptions(local_files_only=True))
    foreign = tmp_path / "falcon" / "model.gguf"
    foreign.parent.mkdir()
    w = gguf.GGUFWriter(str(foreign), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"^GGUF architecture 'falcon' is not supported by the quantized CPU "
                       rf"runtime \(supported: {', '.join(GGUF_ARCHITECTURES)}\)$"):
        load_model(str(foreign), LoadOptions(local_files_only=True))


def test_bad_device_and_dtype(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(str(tiny_dir[0]), LoadOptions(dtype="float8"))
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            load_model(str(tiny_dir[0]), LoadOptions(device="cuda"))


def test_same_vocab_passes_for_two_models_sharing_a_tokenizer(
    tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    save_tiny_model(tmp_path, seed=1)  # different weights, same (deterministically trained) tokenizer
    target = load_model(str(tiny_dir[0]))
    drafter = load_model(str(tmp_path))
    check_same_vocab(target, drafter)
    assert tokenizer_fingerprint(target.tokenizer) == tokenizer_fingerprint(drafter.tokenizer)


def test_vocab_mismatch_on_different_tokenizer(tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    target = load_model(str(tiny_dir[0]))
    other = make_tokenizer(["zebra yak xylophone wombat vortex " * 3, "umbrella tundra sierra quokka"] * 4)
    save_tiny_model(tmp_path, other, vocab=target.vocab_size)  # same logits width, different mapping
    drafter = load_model(str(tmp_path))
    with pytest.raises(VocabularyMismatch, match="tokenizers differ on"):
        check_same_vocab(target, drafter)
    assert tokenizer_fingerprint(target.tokenizer) != tokenizer_fingerprint(drafter.tokenizer)


def test_vocab_mismatch_on_logits_width(tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    """Same tokenizer, but the drafter has no logits for its last ids (a wider one passes:
    tests/decoding/test_drafter_width.py)."""
    target = load_model(str(tiny_dir[0]))
    save_tiny_model(tmp_path, vocab=target.vocab_size - 8)
    with pytest.raises(VocabularyMismatch, match="logits"):
        check_same_vocab(target, load_model(str(tmp_path)))


def test_fingerprint_is_stable_and_sees_special_tokens(tmp_path: Path) -> None:
    tok = make_tokenizer()
    first = tokenizer_fingerprint(tok)
    tok.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(PreTrainedTokenizerFast.from_pretrained(tmp_path)) == first
    tok.eos_token = "<|endoftext|>"
    tok.pad_token = "<|endoftext|>"
    assert tokenizer_fingerprint(tok) != first


# ---- bundled assets ---------------------------------------------------------------------------------


def _fake_converted(path: Path, fmt: int = bundled.FORMAT_VERSION) -> Path:
    path.mkdir(parents=True)
    for name in bundled.REQUIRED_FILES:
        (path / name).write_text("{}")
    (path / bundled.MARKER_NAME).write_text(json.dumps({"format": fmt}))
    return path


def test_is_converted_needs_marker_of_current_format_and_files(tmp_path: Path) -> None:
    assert not bundled.is_converted(tmp_path / "missing")
    good = _fake_converted(tmp_path / "good")
    assert bundled.is_converted(good)
    assert not bundled.is_converted(_fake_converted(tmp_path / "old", fmt=bundled.FORMAT_VERSION - 1))
    (good / "model.safetensors").unlink()
    assert not bundled.is_converted(good)


def test_move_into_place_replaces_stale_dir_and_keeps_finished_one(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "half-written").write_text("x")  # crashed earlier run without a marker
    bundled_build._move_into_place(_fake_converted(tmp_path / ".tmp1"), target)
    assert bundled.is_converted(target) and not (target / "half-written").exists()
    second = _fake_converted(tmp_path / ".tmp2")
    (second / "from-second").write_text("x")
    bundled_build._move_into_place(second, target)  # a finished conversion is already there: keep it
    assert not (target / "from-second").exists()


# ---- where the weights are built -----------------------------------------------------------------------


def test_a_cuda_load_puts_the_weights_on_the_gpu_while_reading(
    tiny_dir: tuple[Path, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA transformers gets ``device_map`` (every module on that device, nothing built on the host first)
    and the model is not moved afterwards. No GPU here: the device and the transformers call are stand-ins
    (the model they return stays on the CPU, so a ``.to('cuda')`` after the load would fail this test)."""
    from transformers import AutoModelForCausalLM

    import decoding.runtime.loader as models

    calls: list[dict[str, Any]] = []

    def from_pretrained(source: str, **kwargs: Any) -> LlamaForCausalLM:
        calls.append(kwargs)
        return LlamaForCausalLM.from_pretrained(source, dtype=kwargs["dtype"]).eval()

    monkeypatch.setattr(models, "resolve_device", lambda device: torch.device("cuda", 1))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(from_pretrained))
    loaded = load_model(str(tiny_dir[0]), LoadOptions(device="cuda:1"))
    assert calls[-1]["device_map"] == {"": torch.device("cuda", 1)}
    assert calls[-1]["dtype"] == torch.bfloat16 and loaded.dtype == torch.bfloat16  # auto on a GPU
    assert loaded.device == torch.device("cuda", 1) and loaded.runtime == "torch:bfloat16"


def test_a_cpu_load_builds_on_the_host_as_before(
    tiny_dir: tuple[Path, LlamaForCausalLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained
    calls: list[dict[str, Any]] = []

    def spy(source: str, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(source, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(spy))
    loaded = load_model(str(tiny_dir[0]), LoadOptions(device="cpu", cpu_quant="none", cpu_kernels=False))
    assert calls and all("device_map" not in kwargs for kwargs in calls)
    ids = torch.tensor([loaded.tokenizer("the quick dog").input_ids])
    assert isinstance(loaded.model, TorchRuntime)
    with torch.inference_mode():
        assert torch.equal(loaded.model.module(ids).logits, tiny_dir[1](ids).logits)


def test_a_packed_tensors_file_pages_are_released_and_read_again_if_touched(tmp_path: Path) -> None:
    """``release_pages`` drops the page-aligned range of a tensor's bytes from the mapping (a load then holds the
    packed weights, not the file's pages beside them), and the bytes read back the same afterwards."""
    import mmap

    import gguf
    import numpy as np

    from decoding.runtime.gguf.meta import read_gguf, release_pages

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    rng = np.random.default_rng(0)
    for i in range(3):
        w.add_tensor(f"t{i}", rng.standard_normal((64, 256)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = read_gguf(tmp_path / "t.gguf")
    before = [np.array(t.data) for t in reader.tensors]
    for t in reader.tensors:
        release_pages(reader, t)
    assert all(np.array_equal(np.array(t.data), b) for t, b in zip(reader.tensors, before, strict=True))

    calls = []

    class Mapping:
        def madvise(self, option: int, start: int, length: int) -> None:
            calls.append((option, start, length))

    fake = type("Reader", (), {"data": type("Data", (), {"_mmap": Mapping()})()})()
    release_pages(fake, type("T", (), {"data_offset": 5000, "n_bytes": 10000})())
    [(option, start, length)] = calls
    assert option == mmap.MADV_DONTNEED and start % mmap.PAGESIZE == 0 and start <= 5000 and start + length == 15000
