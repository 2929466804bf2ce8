"""Q4_0 (18 bytes a block of 32): fp16 scale ``d``, 16 bytes of nibbles as Q4_1's; ``w = d * (q - 8)``.

Packed (144 bytes a record): the 8 scales, 4 chunks of nibble bytes as Q4_1's."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import QK, Format, WeightType, apart, chunks, f16, nibbles, side_by_side, unchunk


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., :2]), chunks(g[..., 2:], 4)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([apart(rec[..., :16], 2), unchunk(rec[..., 16:], 4)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    return f16(b[..., 0:2]) * (nibbles(b[..., 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)


FORMAT = Format(WeightType.Q4_0, QK, 18, 144, pack, unpack, dequantize, "formats_int.c", fp16_fields=(0,))
