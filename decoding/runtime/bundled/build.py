"""Making the two forms of the bundled SmolLM2 from its GGUF (``decoding.runtime.bundled`` says what they are).

Each is written to a temp dir, checked, stamped with a marker file and renamed into place, so a crash never
leaves a half-written model. Heavy imports (torch, transformers, gguf) happen inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoding.errors import ModelLoadError
from decoding.runtime.bundled import (
    BOS,
    EOS,
    FORMAT_VERSION,
    GGUF_FORMAT_VERSION,
    GGUF_LINK,
    MARKER_NAME,
    UNK,
    bundled_gguf_path,
    bundled_target_dir,
    has_gguf_dir,
    is_converted,
)

logger = logging.getLogger(__name__)


def _gguf_context_length(gguf_path: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"]
    name = bytes(arch.parts[arch.data[0]]).decode()
    field = reader.fields[f"{name}.context_length"]
    return int(field.parts[field.data[0]][0])


def write_gguf_dir(gguf_path: Path, gguf_dir: Path) -> None:
    """The corrected tokenizer, generation config and a link to the GGUF, written atomically."""
    from transformers import GenerationConfig

    gguf_dir = Path(gguf_dir)
    gguf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf_dir.parent / f".{gguf_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tokenizer = _fixed_tokenizer(gguf_path, _gguf_context_length(gguf_path))
        sample = "Hello world, this is a test of the tokenizer.\n\n  It keeps whitespace."
        if tokenizer.decode(tokenizer(sample).input_ids) != sample:
            raise ModelLoadError("the bundled tokenizer does not round-trip text")
        tokenizer.save_pretrained(tmp)
        eos_id, bos_id = tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(BOS)
        GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(tmp)
        (tmp / GGUF_LINK).symlink_to(Path(gguf_path).resolve())
        marker = {"format": GGUF_FORMAT_VERSION, "source": gguf_path.name, "gguf": str(Path(gguf_path).resolve())}
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _move_into_place(tmp, gguf_dir, finished=has_gguf_dir)
        logger.info("bundled GGUF dir ready: %s", gguf_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---- conversion --------------------------------------------------------------------------------------


def _fixed_tokenizer(gguf_path: Path, max_length: int) -> Any:
    """The GGUF tokenizer as transformers reads it, with EOS, BOS handling and pre-tokenizer corrected."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    backend = Tokenizer.from_str(raw.backend_tokenizer.to_str())
    # llama.cpp's "smollm" pre-tokenizer (= the original StarCoder-style tokenizer.json): digits split
    # individually, then the GPT-2 byte-level regex.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)  # adds no BOS
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[BOS, EOS],
        chat_template=raw.chat_template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def _load_gguf_model(gguf_path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def _save_converted(model: Any, tokenizer: Any, out: Path) -> None:
    """safetensors weights (tied lm_head left out), config, generation config and tokenizer."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    eos_id, bos_id = tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(BOS)
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only

    config = model.config
    config.tie_word_embeddings = tied
    config.eos_token_id, config.bos_token_id, config.pad_token_id = eos_id, bos_id, eos_id
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _check_tokenizer(tokenizer: Any, reference: Any) -> None:
    sample = "Hello world, this is a test of the tokenizer.\n\n  It keeps whitespace."
    if tokenizer.eos_token != EOS or tokenizer.convert_tokens_to_ids(EOS) != reference.eos_token_id:
        raise ModelLoadError(f"converted tokenizer has EOS {tokenizer.eos_token!r}, expected {EOS!r}")
    ids = tokenizer(sample).input_ids
    if tokenizer.decode(ids) != sample or ids != tokenizer(sample, add_special_tokens=False).input_ids:
        raise ModelLoadError("converted tokenizer does not round-trip text or adds special tokens")
    if tokenizer.get_vocab() != reference.tokenizer_vocab:
        raise ModelLoadError("converted tokenizer vocabulary differs from the GGUF vocabulary")
    if tokenizer.chat_template != reference.chat_template:
        raise ModelLoadError("converted tokenizer lost the chat template")


@dataclass(frozen=True)
class _Reference:
    eos_token_id: int
    tokenizer_vocab: dict[str, int]
    chat_template: str


def _check_logits(converted_dir: Path, gguf_model: Any, tokenizer: Any) -> None:
    """The converted model must reproduce the GGUF-loaded model's logits exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        converted_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")  # [1, n]
    with torch.inference_mode():
        want = gguf_model(ids).logits
        got = loaded(ids).logits
    if not torch.equal(want, got):
        diff = (want - got).abs().max().item()
        raise ModelLoadError(f"converted model's logits differ from the GGUF model's (max |diff| {diff:g})")


def convert_gguf(gguf_path: Path, target_dir: Path) -> None:
    """Convert ``gguf_path`` into an HF safetensors dir at ``target_dir`` (atomically, verified)."""
    target_dir = Path(target_dir)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = target_dir.parent / f".{target_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    start = time.perf_counter()
    logger.info("converting %s -> %s (once)", gguf_path, target_dir)
    try:
        import torch
        import transformers

        model = _load_gguf_model(gguf_path)
        max_len = int(model.config.max_position_embeddings)
        tokenizer = _fixed_tokenizer(gguf_path, max_len)
        reference = _Reference(
            eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
            tokenizer_vocab=tokenizer.get_vocab(),
            chat_template=tokenizer.chat_template,
        )
        _save_converted(model, tokenizer, tmp)

        from transformers import AutoTokenizer

        _check_tokenizer(AutoTokenizer.from_pretrained(tmp), reference)
        _check_logits(tmp, model, tokenizer)
        del model

        seconds = time.perf_counter() - start
        marker = {
            "format": FORMAT_VERSION,
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
            "dtype": "float32",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "convert_s": round(seconds, 2),
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _move_into_place(tmp, target_dir)
        logger.info("converted bundled model in %.1f s: %s", seconds, target_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(tmp: Path, target_dir: Path, finished: Callable[[Path], bool] | None = None) -> None:
    """Rename ``tmp`` to ``target_dir``; a stale (unmarked / old-format) target is moved aside first.
    ``finished`` (default ``is_converted``) tells a finished target from a stale one."""
    done = finished or is_converted
    if target_dir.exists():
        if done(target_dir):  # another process finished first: keep theirs
            return
        stale = target_dir.parent / f".{target_dir.name}.stale-{uuid.uuid4().hex[:8]}"
        target_dir.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target_dir)
    except OSError:
        if not done(target_dir):  # lost a race to a finished one is fine; anything else not
            raise


def verify_converted(target_dir: Path) -> None:
    """Load the converted model + tokenizer and run a 1-token forward; raise ModelLoadError if it fails."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            logits = model(torch.tensor([[tokenizer.convert_tokens_to_ids(BOS)]])).logits  # [1, 1, vocab]
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"bundled model at {target_dir} does not load: {exc}") from exc
    if logits.shape[-1] != model.config.vocab_size or not torch.isfinite(logits).all():
        raise ModelLoadError(f"bundled model at {target_dir} gives malformed logits {tuple(logits.shape)}")


def ensure_converted(models_dir: Path) -> Path:
    """The fp32 dir, converted now if needed (the packages must be installed: ``ragspec models``)."""
    target_dir = bundled_target_dir(models_dir)
    if not is_converted(target_dir):
        convert_gguf(bundled_gguf_path(), target_dir)
    return target_dir
