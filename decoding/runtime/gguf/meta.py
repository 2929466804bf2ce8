"""Reading a GGUF file's metadata: the reader, typed fields, and the rotary scaling a file asks for.

Shared by the weights' loader (``decoding.runtime.weights``), the architectures' configs
(``decoding.runtime.families``) and the tokenizer; nothing here knows an architecture.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np

from decoding.errors import ModelFileError, ModelLoadError


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.parts[f.data[0]]
    if value.dtype == np.uint8 and len(f.types) and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value.tolist()[0] if value.size == 1 else value.tolist()


def required(reader: Any, key: str) -> Any:
    """A metadata value the config cannot do without: a GGUF that lacks it is refused by name."""
    value = field(reader, key)
    if value is None:
        raise ModelFileError(f"the GGUF metadata has no {key}: the file is incomplete or not a model")
    return value


def read_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; a file that is not a GGUF, or one corrupt or cut short, raises
    ``ModelFileError`` saying so. The reader parses the metadata and every tensor's extent when it opens the file
    (the data is memory-mapped, not read), so a truncated download is caught here, not by a reshape deep inside the
    load. Its parser fails on bad bytes with whatever numpy raises (a bad magic or enum value: ValueError; a read
    past the end: IndexError, or ValueError from a short view), hence the kinds caught."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as exc:
        raise ModelFileError(f"cannot read the GGUF file {path}: it is corrupt, truncated or not a GGUF file "
                             f"({type(exc).__name__}: {exc})") from exc


# llama.cpp rope keys (gguf's Keys.Rope, under "<arch>.") the runtime has no counterpart for: a GGUF may carry
# them only at their neutral values (llama.cpp's defaults), any other value is refused rather than ignored
_NEUTRAL_ROPE_KEYS = {
    "rope.scaling.attn_factor": (1.0,),
    "rope.scaling.yarn_attn_factor": (1.0,),
    "rope.scaling.yarn_ext_factor": (-1.0, 1.0),  # -1: llama.cpp's "1 for yarn"
    "rope.scaling.yarn_log_multiplier": (0.0,),
}


def _short(value: float) -> float:
    """A float32 metadata value as its shortest decimal (4.0, 1.33), as a model card would write it."""
    return float(str(np.float32(value)))


def gguf_rope(reader: Any, arch: str, head_dim: int, context: int) -> dict[str, Any]:
    """The ``LlamaConfig`` keywords for a GGUF's rotary scaling: ``rope_scaling`` and / or ``rope_freqs``.

    ``<arch>.rope.scaling.type`` "linear" / "yarn" (absent with a factor: linear, llama.cpp's default) with a
    factor other than 1 become transformers' linear / yarn scaling; yarn's original window is the GGUF's
    ``original_context_length`` (else its context length, as llama.cpp takes it), and
    ``max_position_embeddings`` stays the GGUF's context length (the positions the model supports).
    A ``rope_freqs.weight`` tensor (Llama-3.1: llama.cpp divides rotary frequency i by ``rope_freqs[i]``) becomes
    ``config.rope_freqs``, a list of D/2 floats that ``decoding.runtime.quantized.rotary_tables`` divides its default
    inverse frequencies by. Anything the runtime would not reproduce (another type, both at once, a yarn knob
    away from its default) raises ``ModelLoadError``: a wrong rope gives fluent, wrong output past short contexts.
    """
    a = f"{arch}."
    kind = str(field(reader, a + "rope.scaling.type", "")).lower()
    factor = field(reader, a + "rope.scaling.factor", field(reader, a + "rope.scale_linear"))
    factor = None if factor in (None, 0.0, 1.0) else _short(factor)  # 0 / 1: no scaling to llama.cpp too
    if kind not in ("", "none", "linear", "yarn"):
        raise ModelLoadError(f"GGUF rope scaling type {kind!r}: the quantized CPU runtime runs none, linear, yarn")
    if kind == "none" and factor is not None:
        raise ModelLoadError(f"GGUF rope scaling type 'none' with a factor of {factor}: which one holds is unclear")
    out: dict[str, Any] = {}
    if kind in ("", "linear") and factor is not None:
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind == "yarn" and factor is not None:
        original = int(field(reader, a + "rope.scaling.original_context_length", context))
        yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = field(reader, a + "rope.scaling." + key)
            if value is not None:
                yarn[name] = _short(value)
        out["rope_scaling"] = yarn
    for key, neutral in _NEUTRAL_ROPE_KEYS.items():
        value = field(reader, a + key)
        if value is not None and _short(value) not in neutral:
            raise ModelLoadError(f"GGUF {a + key} = {_short(value)}: the quantized CPU runtime has no such knob")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if "rope_scaling" in out:
            raise ModelLoadError(f"GGUF with both rope_freqs.weight and a {out['rope_scaling']['rope_type']} rope "
                                 "scaling: llama.cpp would apply both, the runtime applies one")
        if values.size != head_dim // 2 or not np.all(np.isfinite(values) & (values > 0)):
            raise ModelLoadError(f"GGUF rope_freqs.weight needs {head_dim // 2} positive values (head dim "
                                 f"{head_dim}), not {values.size}")
        out["rope_freqs"] = values.tolist()
    return out


def release_pages(reader: Any, tensor: Any) -> None:
    """Drop the mapped pages of ``tensor``'s bytes from this process (the file's own, read again if touched): a tensor
    once packed for the kernels needs them no more, so a load holds the packed weights, not the file's pages beside
    them. A reader without a file mapping (or a platform without ``madvise``) is left as it is."""
    release_range(reader, int(tensor.data_offset), int(tensor.n_bytes))


def release_range(reader: Any, offset: int, nbytes: int) -> None:
    """``release_pages`` for the file's bytes ``[offset, offset + nbytes)`` (a part of a tensor, packed while the rest
    is not yet): the pages they touch are dropped, a page shared with bytes still to read is read again if touched."""
    mapping = getattr(getattr(reader, "data", None), "_mmap", None)
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or nbytes <= 0:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
