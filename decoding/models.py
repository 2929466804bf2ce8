"""Loading target / drafter models, and the vocabulary checks that make drafted token ids meaningful.

``load_model(spec)`` accepts ``'bundled'`` (the converted SmolLM2 dir, see ``decoding.bundled``), a local
HF model dir, or a hub id (resolved from the local HF cache; downloads only where the caller allows it and
a hub is reachable — transformers honours ``HF_HUB_OFFLINE`` itself).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from decoding.attention import use_grouped_sdpa
from decoding.errors import ModelLoadError, VocabularyMismatch
from decoding.kernels import use_cpu_kernels

logger = logging.getLogger(__name__)

BUNDLED = "bundled"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A causal LM in eval mode with its tokenizer and the facts the engine needs."""

    model: PreTrainedModel
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    max_context: int  # config.max_position_embeddings
    vocab_size: int  # width of the logits (config.vocab_size)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``'auto'``: CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``'auto'``: bfloat16 on a GPU, float32 on a CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _resolve_source(spec: str, bundled_dir: Path | None) -> tuple[str, str]:
    """(what to pass to from_pretrained, a display name)."""
    if spec == BUNDLED:
        if bundled_dir is None:
            raise ModelLoadError("model 'bundled' requested but no bundled_dir was given")
        if not (Path(bundled_dir) / "config.json").is_file():
            raise ModelLoadError(f"bundled model missing at {bundled_dir}: run `ragspec models` first")
        return str(bundled_dir), f"{BUNDLED}:{Path(bundled_dir).name}"
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model dir (no config.json)")
        return str(path), path.name
    return spec, spec  # hub id


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a generation: tokenizer EOS plus the config / generation config EOS ids."""
    ids: list[int] = []
    sources = [tokenizer.eos_token_id, model.config.eos_token_id]
    if model.generation_config is not None:
        sources.append(model.generation_config.eos_token_id)
    for value in sources:
        for i in value if isinstance(value, list | tuple) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def load_model(
    spec: str,
    *,
    bundled_dir: Path | None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    threads: int | None = None,
    local_files_only: bool = False,
    cpu_kernels: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    ``spec``: ``'bundled'`` (then ``bundled_dir`` is the converted dir,
    ``decoding.bundled.bundled_target_dir(models_dir)``), a local HF dir, or a hub id.
    ``threads`` sets torch's intra-op threads for the whole process. ``cpu_kernels``: on an fp32 CPU model,
    run small forwards on ``decoding.kernels`` (falls back to torch's kernels where unavailable).
    """
    if threads is not None:
        torch.set_num_threads(int(threads))
    source, name = _resolve_source(spec, bundled_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dt, attn_implementation="sdpa", local_files_only=local_files_only
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    model.to(dev)  # type: ignore[arg-type]  # in place; transformers' typing of `to` confuses mypy
    model.eval()
    use_grouped_sdpa(model)  # CPU: no KV head repetition under tree masks
    if cpu_kernels:
        use_cpu_kernels(model)
    eos = _eos_ids(model, tokenizer)
    if not eos:
        raise ModelLoadError(f"model {spec!r} defines no EOS token")
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if max_context <= 0:
        raise ModelLoadError(f"model {spec!r} has no max_position_embeddings in its config")
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=dev,
        dtype=dt,
        eos_token_ids=eos,
        max_context=max_context,
        vocab_size=int(model.config.vocab_size),
    )
    logger.info("loaded %s on %s (%s, %d-token window, eos %s)", name, dev, dt, max_context, eos)
    return loaded


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A stable hash of the token -> id mapping and the special tokens (keys the cross-session draft cache).

    Two tokenizers with the same fingerprint turn the same id sequences into the same text.
    """
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "special": sorted(
            (str(tok), int(tokenizer.convert_tokens_to_ids(tok))) for tok in tokenizer.all_special_tokens
        ),
    }
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _vocab_digest(tokenizer: Any) -> str:
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def check_same_vocab(target: LoadedModel, drafter: LoadedModel) -> None:
    """Raise ``VocabularyMismatch`` unless drafter token ids mean the same as target token ids.

    Both the logits widths and the tokenizers' token -> id mappings must be equal.
    """
    if target.vocab_size != drafter.vocab_size:
        raise VocabularyMismatch(
            f"target {target.name} has {target.vocab_size} logits but drafter {drafter.name} has "
            f"{drafter.vocab_size}: choose a drafter from the same model family and vocabulary"
        )
    if _vocab_digest(target.tokenizer) == _vocab_digest(drafter.tokenizer):
        return
    tv, dv = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    differing = sorted(tok for tok in tv.keys() | dv.keys() if tv.get(tok) != dv.get(tok))
    example = differing[0]
    raise VocabularyMismatch(
        f"target {target.name} and drafter {drafter.name} tokenizers differ on {len(differing)} tokens "
        f"(e.g. {example!r}: target id {tv.get(example)}, drafter id {dv.get(example)})"
    )
