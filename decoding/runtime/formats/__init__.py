"""The weight formats the quantized runtime reads as stored: one module each (its sizes, packed layout, GGUF's
arithmetic; ``base.Format``), collected here into ``FORMATS``. The C side declares the same sizes once
(``kernels/formats.h``); ``check_library`` compares them when a library is loaded.

Adding a format: a module here defining a ``Format`` (found by this package: no list to edit), its id in
``base.WeightType`` and in ``kernels/formats.h``'s table, its kernel (docs/architecture.md, "Adding a weight format").
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil

from decoding.runtime.formats.base import QK, QK_K, Format, WeightType

__all__ = ["FORMATS", "QK", "QK_K", "Format", "WeightType", "check_library", "format_of"]


def _collect() -> dict[WeightType, Format]:
    found: dict[WeightType, Format] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Format):
                if found.get(value.kind, value) is not value:
                    raise RuntimeError(f"two formats declare {value.kind.name}")
                found[value.kind] = value
    missing = [k.name for k in WeightType if k != WeightType.PARTS and k not in found]
    if missing:
        raise RuntimeError(f"weight types without a format module: {', '.join(missing)}")
    return dict(sorted(found.items()))


FORMATS: dict[WeightType, Format] = _collect()


def format_of(kind: WeightType) -> Format:
    """The format of ``kind``; a ValueError for a kind that is not one (``PARTS``)."""
    try:
        return FORMATS[kind]
    except KeyError:
        raise ValueError(f"{WeightType(kind).name} is not a weight format") from None


def check_library(lib: ctypes.CDLL, formats: dict[WeightType, Format] | None = None) -> None:
    """A RuntimeError unless the compiled library knows every format with the sizes declared here (and no other):
    a format's sizes on one side only would make the kernels read wrong bytes without an error."""
    formats = FORMATS if formats is None else formats
    out = (ctypes.c_int * 3)()
    wrong = []
    for kind, f in formats.items():
        if lib.rs_format_sizes(int(kind), out) != 0:
            wrong.append(f"{f.name}: unknown to the library")
        elif tuple(out) != (f.block_weights, f.block_bytes, f.record_bytes):
            wrong.append(f"{f.name}: (weights, bytes, record bytes) {tuple(out)} in C, "
                         f"{(f.block_weights, f.block_bytes, f.record_bytes)} in Python")
    extra = [k for k in range(1, 64) if k not in formats and k != WeightType.PARTS and lib.rs_format_sizes(k, out) == 0]
    wrong += [f"format id {k}: known to the library only" for k in extra]
    if wrong:
        raise RuntimeError("the CPU kernels' weight formats differ from decoding.runtime.formats: " + "; ".join(wrong))
