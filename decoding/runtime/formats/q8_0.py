"""Q8_0 (34 bytes a block of 32): fp16 scale ``d``, 32 int8 ``q``; ``w = d * q``.

Packed (272 bytes a record): the 8 scales, 8 chunks of weights (chunk c: weights 4c..4c+3). Made from float weights
at load too (``quant.quantize``)."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import QK, Format, WeightType, apart, chunks, f16, side_by_side, unchunk


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., :2]), chunks(g[..., 2:], 8)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([apart(rec[..., :16], 2), unchunk(rec[..., 16:], 8)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    return f16(b[..., 0:2]) * b[..., 2:].view(np.int8).astype(np.float32)


FORMAT = Format(WeightType.Q8_0, QK, 34, 272, pack, unpack, dequantize, "formats_q8_0_q4_1.c", fp16_fields=(0,))
