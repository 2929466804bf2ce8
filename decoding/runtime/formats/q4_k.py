"""Q4_K (144 bytes a super-block of 256): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit scales and mins (one of each
per sub-block of 32, ``q4k_scales``), 128 bytes of nibbles; ``w = d * sc * q - dmin * m``.

Packed (1184 bytes a record): the 8 d, the 8 dmin, the 6-bit scales unpacked to bytes (sub-block s of row j at
8s + j), the mins likewise, 32 chunks of nibble bytes (chunk k: bytes 4k..4k+3). The unpacked scales are the one
growth over the file (148 / 144)."""

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


def q4k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes ``[..., 12]`` -> the 8 sub-blocks' 6-bit scales and mins ``[..., 8]`` each (ggml's
    ``get_scale_min_k4``): bytes 0-3 / 4-7 hold scales / mins 0-3 in their low 6 bits and the top 2 bits of
    scales / mins 4-7; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4k_pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The inverse of ``q4k_scales`` (a bijection of 16 six-bit values and 12 bytes)."""
    lo_s, hi_s, lo_m, hi_m = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    d = lo_s | ((hi_s >> 4) << 6)
    m = lo_m | ((hi_m >> 4) << 6)
    md = (hi_s & 0x0F) | ((hi_m & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=-1).astype(np.uint8)


def pack(g: np.ndarray) -> np.ndarray:
    sc, mn = q4k_scales(g[..., 4:16])
    return np.concatenate([side_by_side(g[..., :2]), side_by_side(g[..., 2:4]), by_sub_block(sc), by_sub_block(mn),
                           chunks(g[..., 16:], 32)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    sc, mn = by_row(rec[..., 32:96]), by_row(rec[..., 96:160])
    return np.concatenate([apart(rec[..., :16], 2), apart(rec[..., 16:32], 2), q4k_pack_scales(sc, mn),
                           unchunk(rec[..., 160:], 32)], axis=-1)


def scaled(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block ``d * sc`` and ``dmin * m`` ``[n, S, 8, 1]`` (Q4_K's and Q5_K's)."""
    sc, mn = q4k_scales(b[..., 4:16])
    dl = (f16(b[..., 0:2]) * sc.astype(np.float32))[..., None]
    ml = (f16(b[..., 2:4]) * mn.astype(np.float32))[..., None]
    return dl, ml


def dequantize(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = scaled(b)
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, -1, 8, 32).astype(np.float32)
    return dl * q - ml


FORMAT = Format(WeightType.Q4_K, QK_K, 144, 1184, pack, unpack, dequantize, "formats_int.c", fp16_fields=(0, 2))
