"""Q5_1 (24 bytes a block of 32): fp16 scale ``d``, fp16 minimum ``m``, 4 bytes of fifth bits, 16 bytes of nibbles;
``w = d * q + m``.

Packed (192 bytes a record): the 8 scales, the 8 minimums, the fifth bits as Q5_0's, 4 chunks of nibble bytes."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import (
    QK,
    Format,
    WeightType,
    apart,
    bits,
    chunks,
    f16,
    nibbles,
    side_by_side,
    unchunk,
)
from decoding.runtime.formats.q5_0 import fifth_bytes, fifth_chunk


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., :2]), side_by_side(g[..., 2:4]), fifth_chunk(g[..., 4:8]),
                           chunks(g[..., 8:], 4)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([apart(rec[..., :16], 2), apart(rec[..., 16:32], 2), fifth_bytes(rec[..., 32:64]),
                           unchunk(rec[..., 64:], 4)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    q = (nibbles(b[..., 8:]) | (bits(b[..., 4:8]) << 4)).astype(np.float32)
    return f16(b[..., 0:2]) * q + f16(b[..., 2:4])


FORMAT = Format(WeightType.Q5_1, QK, 24, 192, pack, unpack, dequantize, "formats_int.c", fp16_fields=(0, 2))
