"""MXFP4 (17 bytes a block of 32; OCP microscaling FP4, gpt-oss's experts): an E8M0 scale byte ``e`` and 16 bytes of
4-bit E2M1 codes as Q4_0's nibbles (weight t low, 16 + t high), each naming one of 16 values (``MXFP4_VALUES``,
doubled so they are integers); ``w = 2^(e - 128) * MXFP4_VALUES[q]`` (ggml's ``e8m0_to_fp32_half``).

Packed (136 bytes a record, the file's own size): the 8 scale bytes, 4 chunks of nibble bytes as Q4_0's."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import GROUP, QK, Format, WeightType, apart, chunks, nibbles, side_by_side, unchunk

MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes -> fp32 ``2^(e - 128)`` (half the scale: the values are doubled), exactly as ggml builds the
    bits (a subnormal below e = 2)."""
    u = e.astype(np.uint32)
    bits = np.where(u < 2, np.uint32(0x00200000) << u, (u - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., :1]), chunks(g[..., 1:], 4)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([apart(rec[..., :GROUP], 1), unchunk(rec[..., GROUP:], 4)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    return e8m0_half(b[..., 0:1]) * MXFP4_VALUES[nibbles(b[..., 1:])].astype(np.float32)


FORMAT = Format(WeightType.MXFP4, QK, 17, 136, pack, unpack, dequantize, "formats_int.c", e8m0_fields=(0,))
