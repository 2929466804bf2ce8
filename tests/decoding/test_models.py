"""Model loading, vocabulary checks, and the bundled SmolLM2 conversion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from decoding import bundled, kernels
from decoding.errors import ModelLoadError, VocabularyMismatch
from decoding.kernels import kernels_active
from decoding.models import LoadedModel, check_same_vocab, load_model, tokenizer_fingerprint

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Licenses grant permission to copy, modify and distribute the software.",
    "Question: what does the document say? Answer: it says many things.",
] * 4


def make_tokenizer(corpus: list[str] = CORPUS, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer with ChatML specials, trained in milliseconds."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML,
        clean_up_tokenization_spaces=False,
    )


def save_tiny_model(
    path: Path, tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0, vocab: int | None = None
) -> LlamaForCausalLM:
    """A seeded 2-layer random Llama + tokenizer saved as an HF dir at ``path``."""
    tokenizer = tokenizer or make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, save_tiny_model(path)


def test_load_local_dir_gives_eval_model_with_facts(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    path, original = tiny_dir
    loaded = load_model(str(path), bundled_dir=None)
    assert isinstance(loaded, LoadedModel)
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert not loaded.model.training
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert loaded.max_context == 256
    assert loaded.vocab_size == len(loaded.tokenizer) == original.config.vocab_size
    assert loaded.name == path.name
    ids = torch.tensor([loaded.tokenizer("the quick dog").input_ids])
    plain = load_model(str(path), bundled_dir=None, cpu_kernels=False)
    assert not kernels_active(plain.model)
    with torch.inference_mode():
        assert torch.equal(plain.model(ids).logits, original(ids).logits)
        if kernels.loaded() is not None:  # fp32 CPU models run small forwards on the kernels by default
            assert kernels_active(loaded.model)
            torch.testing.assert_close(loaded.model(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


def test_load_with_explicit_dtype_and_threads(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    before = torch.get_num_threads()
    loaded = load_model(str(tiny_dir[0]), bundled_dir=None, device="cpu", dtype="bfloat16", threads=1)
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)


def test_bundled_spec_uses_bundled_dir(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    loaded = load_model("bundled", bundled_dir=tiny_dir[0])
    assert loaded.name == f"bundled:{tiny_dir[0].name}"


@pytest.mark.parametrize(
    ("spec", "bundled_dir", "message"),
    [
        ("bundled", None, "no bundled_dir"),
        ("bundled", Path("/nonexistent/smollm2"), "ragspec models"),
        ("{tmp}", None, "no config.json"),
        ("nobody/no-such-model-xyz", None, "cannot load model"),
    ],
)
def test_load_errors_are_domain_errors(tmp_path: Path, spec: str, bundled_dir: Path | None, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(spec.format(tmp=tmp_path), bundled_dir=bundled_dir, local_files_only=True)


def test_bad_device_and_dtype(tiny_dir: tuple[Path, LlamaForCausalLM]) -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(str(tiny_dir[0]), bundled_dir=None, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            load_model(str(tiny_dir[0]), bundled_dir=None, device="cuda")


def test_same_vocab_passes_for_two_models_sharing_a_tokenizer(
    tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    save_tiny_model(tmp_path, seed=1)  # different weights, same (deterministically trained) tokenizer
    target = load_model(str(tiny_dir[0]), bundled_dir=None)
    drafter = load_model(str(tmp_path), bundled_dir=None)
    check_same_vocab(target, drafter)
    assert tokenizer_fingerprint(target.tokenizer) == tokenizer_fingerprint(drafter.tokenizer)


def test_vocab_mismatch_on_different_tokenizer(tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    target = load_model(str(tiny_dir[0]), bundled_dir=None)
    other = make_tokenizer(["zebra yak xylophone wombat vortex " * 3, "umbrella tundra sierra quokka"] * 4)
    save_tiny_model(tmp_path, other, vocab=target.vocab_size)  # same logits width, different mapping
    drafter = load_model(str(tmp_path), bundled_dir=None)
    with pytest.raises(VocabularyMismatch, match="tokenizers differ on"):
        check_same_vocab(target, drafter)
    assert tokenizer_fingerprint(target.tokenizer) != tokenizer_fingerprint(drafter.tokenizer)


def test_vocab_mismatch_on_logits_width(tiny_dir: tuple[Path, LlamaForCausalLM], tmp_path: Path) -> None:
    target = load_model(str(tiny_dir[0]), bundled_dir=None)
    save_tiny_model(tmp_path, vocab=target.vocab_size + 8)
    with pytest.raises(VocabularyMismatch, match="logits"):
        check_same_vocab(target, load_model(str(tmp_path), bundled_dir=None))


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
    bundled._move_into_place(_fake_converted(tmp_path / ".tmp1"), target)
    assert bundled.is_converted(target) and not (target / "half-written").exists()
    second = _fake_converted(tmp_path / ".tmp2")
    (second / "from-second").write_text("x")
    bundled._move_into_place(second, target)  # a finished conversion is already there: keep it
    assert not (target / "from-second").exists()


@pytest.mark.real_model
def test_bundled_conversion_is_verified_atomic_and_idempotent(tmp_path: Path) -> None:
    """Converts the real GGUF (about a minute): logits equality with the GGUF model is checked inside."""
    assets = bundled.install_bundled(tmp_path)
    assert assets.converted and assets.target_dir == bundled.bundled_target_dir(tmp_path)
    assert bundled.is_converted(assets.target_dir)
    assert (assets.embedder_dir / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [bundled.TARGET_DIR_NAME]  # no temp dirs left
    again = bundled.install_bundled(tmp_path)
    assert not again.converted and again.convert_s == 0.0

    files = {p.name for p in assets.target_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    config = json.loads((assets.target_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2
    assert json.loads((assets.target_dir / "generation_config.json").read_text())["eos_token_id"] == 2

    loaded = load_model("bundled", bundled_dir=assets.target_dir, threads=1)
    tok = loaded.tokenizer
    assert tok.eos_token == "<|im_end|>" and loaded.eos_token_ids == (2,)
    assert tok("Hello world").input_ids == tok("Hello world", add_special_tokens=False).input_ids  # no BOS
    assert tok.tokenize(" 2024") == ["Ġ", "2", "0", "2", "4"]  # smollm pre-tokenizer: single digits
    assert loaded.max_context == 8192 and loaded.vocab_size == 49152
    model: Any = loaded.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
