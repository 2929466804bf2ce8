"""Q2_K (84 bytes a super-block of 256): 16 bytes of sub-block scales and mins (one byte per 16 weights: scale in the
low nibble, min in the high), 64 bytes of 2-bit quants (in each 128 weights, byte l holds weights l, 32 + l, 64 + l,
96 + l in bits 0-1, 2-3, 4-5, 6-7), fp16 ``d``, fp16 ``dmin``; ``w = d * sc * q - dmin * m``.

Packed (672 bytes a record, the file's own size): the 8 d, the 8 dmin, the scale bytes as stored (sub-block s of row
j at 8s + j), 16 chunks of quant bytes (chunk k: bytes 4k..4k+3)."""

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
    f16,
    side_by_side,
    unchunk,
)


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., 80:82]), side_by_side(g[..., 82:84]), by_sub_block(g[..., :16]),
                           chunks(g[..., 16:80], 16)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([by_row(rec[..., 32:160]), unchunk(rec[..., 160:], 16), apart(rec[..., :16], 2),
                           apart(rec[..., 16:32], 2)], axis=-1)


def two_bits(qs: np.ndarray) -> np.ndarray:
    """64 quant bytes ``[n, S, 64]`` -> the 256 weights' 2 low bits ``[n, S, 16 sub-blocks, 16]`` (Q2_K's and Q3_K's
    layout: in each half of 128 weights, byte l's bits 2j, 2j + 1 are weight 32j + l)."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    return (shifted & 3).reshape(n, -1, 16, 16)


def dequantize(b: np.ndarray) -> np.ndarray:
    sc = b[..., :16]
    dl = (f16(b[..., 80:82]) * (sc & 0x0F).astype(np.float32))[..., None]  # [n, S, 16, 1]
    ml = (f16(b[..., 82:84]) * (sc >> 4).astype(np.float32))[..., None]
    return dl * two_bits(b[..., 16:80]).astype(np.float32) - ml


FORMAT = Format(WeightType.Q2_K, QK_K, 84, 672, pack, unpack, dequantize, "formats_int.c", fp16_fields=(80, 82))
