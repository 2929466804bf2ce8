"""IQ4_XS (136 bytes a super-block of 256): fp16 ``d``, 2 + 4 bytes of 6-bit sub-block scales (``iq4xs_scales``),
128 bytes of nibbles indexing IQ4_NL's table; ``w = d * (sc - 32) * IQ4_VALUES[q]``.

Packed (1104 bytes a record): the 8 d, the 8 sub-blocks' scales minus 32 as int8 (sub-block s of row j at 8s + j),
32 chunks of nibble bytes (chunk k: bytes 4k..4k+3). The unpacked scales are the one growth (138 / 136)."""

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
    nibbles,
    side_by_side,
    unchunk,
)
from decoding.runtime.formats.iq4_nl import IQ4_VALUES


def iq4xs_scales(head: np.ndarray) -> np.ndarray:
    """IQ4_XS's scale bytes ``[..., 6]`` (uint16 scales_h, then scales_l[4]) -> the 8 sub-blocks' scales minus 32
    (int8 ``[..., 8]``): the low 4 bits of scale s in nibble s % 2 of scales_l[s // 2], its top 2 in bits 2s, 2s + 1
    of scales_h."""
    high = head[..., 0].astype(np.uint16) | (head[..., 1].astype(np.uint16) << 8)
    lo = np.stack([head[..., 2:6] & 0x0F, head[..., 2:6] >> 4], axis=-1).reshape(*head.shape[:-1], 8)
    hi = (high[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return ((lo | (hi.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8)


def iq4xs_pack_scales(sc: np.ndarray) -> np.ndarray:
    """The inverse of ``iq4xs_scales``."""
    ls = (sc.astype(np.int16) + 32).astype(np.uint16)
    high = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1).astype(np.uint16)
    low = (ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)
    return np.concatenate([(high & 0xFF)[..., None], (high >> 8)[..., None], low], axis=-1).astype(np.uint8)


def pack(g: np.ndarray) -> np.ndarray:
    sc = iq4xs_scales(g[..., 2:8]).view(np.uint8)
    return np.concatenate([side_by_side(g[..., :2]), by_sub_block(sc), chunks(g[..., 8:], 32)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    sc = by_row(rec[..., 16:80]).view(np.int8)
    return np.concatenate([apart(rec[..., :16], 2), iq4xs_pack_scales(sc), unchunk(rec[..., 80:], 32)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl = (f16(b[..., 0:2]) * iq4xs_scales(b[..., 2:8]).astype(np.float32))[..., None]  # [n, S, 8, 1]
    return dl * IQ4_VALUES[nibbles(b[..., 8:].reshape(n, -1, 8, 16))].astype(np.float32)


FORMAT = Format(WeightType.IQ4_XS, QK_K, 136, 1104, pack, unpack, dequantize, "formats_int.c", fp16_fields=(0,))
