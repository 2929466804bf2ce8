"""Q4_1 (20 bytes a block of 32): fp16 scale ``d``, fp16 minimum ``m``, 16 bytes holding weight ``t`` in the low
nibble of byte ``t`` and weight ``t + 16`` in its high nibble; ``w = d * q + m``.

Packed (160 bytes a record): the 8 scales, the 8 minimums, 4 chunks of the nibble bytes (chunk c: bytes 4c..4c+3,
i.e. weights 4c..4c+3 and 16+4c..16+4c+3). Made from float weights at load too (``quant.quantize``)."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import QK, Format, WeightType, apart, chunks, f16, nibbles, side_by_side, unchunk


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., :2]), side_by_side(g[..., 2:4]), chunks(g[..., 4:], 4)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([apart(rec[..., :16], 2), apart(rec[..., 16:32], 2), unchunk(rec[..., 32:], 4)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    return f16(b[..., 0:2]) * nibbles(b[..., 4:]).astype(np.float32) + f16(b[..., 2:4])


FORMAT = Format(WeightType.Q4_1, QK, 20, 160, pack, unpack, dequantize, "formats_q8_0_q4_1.c", fp16_fields=(0, 2))
