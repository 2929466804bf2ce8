"""Q5_0 (22 bytes a block of 32): fp16 scale ``d``, 4 bytes of fifth bits (bit v: weight v), 16 bytes of nibbles
as Q4_1's; ``w = d * (q - 16)``.

Packed (176 bytes a record): the 8 scales, a chunk of fifth bits (``fifth_chunk``), 4 chunks of nibble bytes as
Q4_1's."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import (
    GROUP,
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


def fifth_chunk(qh: np.ndarray) -> np.ndarray:
    """The 32-weight blocks' fifth bits ``[G, 8 rows, blocks, 4]`` (bit v: weight v) -> ``[G, blocks, 32]``: byte
    4j + t, bit 2c + h: row j's weight 16h + 4c + t."""
    nb = qh.shape[2]
    unpacked = np.unpackbits(qh, axis=-1, bitorder="little")  # [G, j, b, 32]
    unpacked = unpacked.reshape(-1, GROUP, nb, 2, 4, 4).transpose(0, 2, 1, 5, 4, 3)  # [G, b, j, t, c, h]
    return np.packbits(unpacked.reshape(-1, nb, 32, 8), axis=-1, bitorder="little").reshape(-1, nb, 32)


def fifth_bytes(chunk: np.ndarray) -> np.ndarray:
    """The inverse of ``fifth_chunk``."""
    nb = chunk.shape[1]
    unpacked = np.unpackbits(chunk.reshape(-1, nb, 32, 1), axis=-1, bitorder="little")  # [G, b, 4j+t, 2c+h]
    unpacked = unpacked.reshape(-1, nb, GROUP, 4, 4, 2).transpose(0, 2, 1, 5, 4, 3)  # [G, j, b, h, c, t]
    return np.packbits(unpacked.reshape(-1, GROUP, nb, 32), axis=-1, bitorder="little")


def pack(g: np.ndarray) -> np.ndarray:
    return np.concatenate([side_by_side(g[..., :2]), fifth_chunk(g[..., 2:6]), chunks(g[..., 6:], 4)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return np.concatenate([apart(rec[..., :16], 2), fifth_bytes(rec[..., 16:48]), unchunk(rec[..., 48:], 4)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    q = (nibbles(b[..., 6:]) | (bits(b[..., 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return f16(b[..., 0:2]) * q.astype(np.float32)


FORMAT = Format(WeightType.Q5_0, QK, 22, 176, pack, unpack, dequantize, "formats_int.c", fp16_fields=(0,))
