"""Q3_K (110 bytes a super-block of 256): 32 bytes of high bits (byte l, bit b: weight 32b + l), 64 bytes of 2-bit
quants as Q2_K's, 12 bytes of 6-bit sub-block scales (``q3k_scales``), fp16 ``d``;
``w = d * (sc - 32) * (q - 4 * (1 - high bit))``.

Packed (912 bytes a record): the 8 d, the 16 sub-blocks' scales minus 32 as int8 (sub-block s of row j at 8s + j),
8 chunks of high-bit bytes (chunk c: bytes 4c..4c+3), 16 chunks of quant bytes (chunk k: bytes 4k..4k+3). The
unpacked scales are the one growth (114 / 110)."""

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
from decoding.runtime.formats.q2_k import two_bits


def q3k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes ``[..., 12]`` -> the 16 sub-blocks' scales minus 32 (int8 ``[..., 16]``): the low 4 bits
    of scale s in byte s % 8 (its low nibble for s < 8, its high one after), the top 2 in byte 8 + s % 4, bits
    2 (s // 4) and 2 (s // 4) + 1."""
    low = np.concatenate([packed[..., :8] & 0x0F, packed[..., :8] >> 4], axis=-1)  # scale s: byte s % 8, nibble s // 8
    high = np.concatenate([(packed[..., 8:12] >> (2 * k)) & 3 for k in range(4)], axis=-1)  # byte 8 + s % 4
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


def q3k_pack_scales(sc: np.ndarray) -> np.ndarray:
    """The inverse of ``q3k_scales``."""
    u = (sc.astype(np.int16) + 32).astype(np.uint8)
    low = (u[..., :8] & 0x0F) | ((u[..., 8:] & 0x0F) << 4)
    top = u >> 4  # [..., 16]
    high = top[..., 0:4] | (top[..., 4:8] << 2) | (top[..., 8:12] << 4) | (top[..., 12:16] << 6)
    return np.concatenate([low, high], axis=-1).astype(np.uint8)


def pack(g: np.ndarray) -> np.ndarray:
    sc = q3k_scales(g[..., 96:108]).view(np.uint8)
    return np.concatenate([side_by_side(g[..., 108:110]), by_sub_block(sc), chunks(g[..., :32], 8),
                           chunks(g[..., 32:96], 16)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    sc = by_row(rec[..., 16:144]).view(np.int8)
    return np.concatenate([unchunk(rec[..., 144:400], 8), unchunk(rec[..., 400:], 16), q3k_pack_scales(sc),
                           apart(rec[..., :16], 2)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = (f16(b[..., 108:110]) * q3k_scales(b[..., 96:108]).astype(np.float32))[..., None]  # [n, S, 16, 1]
    bits = b[..., :32].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    clear = ((bits & 1) ^ 1).reshape(n, -1, 16, 16)  # the offset 4 applies where the high bit is clear
    q = two_bits(b[..., 32:96]).astype(np.int8) - (clear << 2).astype(np.int8)
    return dl * q.astype(np.float32)


FORMAT = Format(WeightType.Q3_K, QK_K, 110, 912, pack, unpack, dequantize, "formats_int.c", fp16_fields=(108,))
