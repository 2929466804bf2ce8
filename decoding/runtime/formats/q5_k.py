"""Q5_K (176 bytes a super-block of 256): Q4_K's fields with 32 bytes of fifth bits (byte l, bit s: weight 32s + l)
before the nibbles; ``w = d * sc * q - dmin * m``.

Packed (1440 bytes a record): as Q4_K's, with 8 chunks of the fifth bits (chunk c: each row's qh bytes 4c..4c+3)
before the nibbles."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import (
    QK_K,
    Format,
    WeightType,
    apart,
    by_row,
    by_sub_block,
    chunks,
    side_by_side,
    unchunk,
)
from decoding.runtime.formats.q4_k import q4k_pack_scales, q4k_scales, scaled


def pack(g: np.ndarray) -> np.ndarray:
    sc, mn = q4k_scales(g[..., 4:16])
    return np.concatenate([side_by_side(g[..., :2]), side_by_side(g[..., 2:4]), by_sub_block(sc), by_sub_block(mn),
                           chunks(g[..., 16:48], 8), chunks(g[..., 48:], 32)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    sc, mn = by_row(rec[..., 32:96]), by_row(rec[..., 96:160])
    return np.concatenate([apart(rec[..., :16], 2), apart(rec[..., 16:32], 2), q4k_pack_scales(sc, mn),
                           unchunk(rec[..., 160:416], 8), unchunk(rec[..., 416:], 32)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = scaled(b)
    qs = b[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = ((qs & 0x0F).reshape(n, -1, 8, 32) | ((qh & 1) << 4)).astype(np.float32)
    return dl * q - ml


FORMAT = Format(WeightType.Q5_K, QK_K, 176, 1440, pack, unpack, dequantize, "formats_int.c", fp16_fields=(0, 2))
