"""IQ4_NL (18 bytes a block of 32): fp16 scale ``d``, 16 bytes of nibbles as Q4_1's indexing a fixed non-linear
table; ``w = d * IQ4_VALUES[q]``.

Packed (144 bytes a record): as Q4_0's."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats import q4_0
from decoding.runtime.formats.base import QK, Format, WeightType, f16, nibbles

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def dequantize(b: np.ndarray) -> np.ndarray:
    return f16(b[..., 0:2]) * IQ4_VALUES[nibbles(b[..., 2:])].astype(np.float32)


FORMAT = Format(WeightType.IQ4_NL, QK, 18, 144, q4_0.pack, q4_0.unpack, dequantize, "formats_int.c",
                fp16_fields=(0,))
