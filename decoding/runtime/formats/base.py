"""What every weight format declares (``Format``), the format ids the kernels know (``WeightType``), and the byte
rearrangements the packed layouts are made of.

A packed record holds one block of each of 8 rows (a group): fp16 fields side by side (``side_by_side``), then
"chunks" of 32 bytes with 4 bytes of each row in turn (``chunks``), so one integer instruction on a chunk works on
all 8 rows. Each ``X`` here has its inverse ``X`` in the same pair (``apart``, ``unchunk``...), so a record gives
back the file's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

QK = 32  # weights per block (Q8_0, Q4_1, Q5_0...; a K-quant's sub-block)
QK_K = 256  # weights per K-quant super-block
GROUP = 8  # rows per packed record


class WeightType(IntEnum):
    """Format ids, as the kernels know them (``kernels/formats.h``'s ``RS_FORMATS`` table, checked at load)."""

    Q8_0 = 1
    Q4_1 = 2
    Q4_K = 3
    Q6_K = 4
    Q5_0 = 5
    Q4_0 = 6
    Q5_1 = 7
    IQ4_NL = 8
    IQ4_XS = 9
    Q5_K = 10
    F16 = 11
    BF16 = 12
    F32 = 13
    Q2_K = 14
    Q3_K = 15
    MXFP4 = 17  # 16: PARTS
    PARTS = 16  # rows of several matrices, one after the other (``quant.join_rows``): not a format


Blocks = np.ndarray  # uint8 GGUF blocks: [G, 8 rows, blocks, block_bytes] (pack / unpack) or [n, blocks, block_bytes]


@dataclass(frozen=True)
class Format:
    """One weight format, declared once: its sizes, where its fp16 fields lie, how its blocks are packed for the
    kernels and back, and GGUF's fp32 arithmetic for it (the reference every kernel is tested against).

    - ``pack(g)``: GGUF blocks ``[G, 8, nb, block_bytes]`` -> records ``[G, nb, record_bytes]`` (or any array whose
      bytes are those records in order); ``unpack`` is its inverse.
    - ``dequantize(blocks)``: ``[n, nb, block_bytes]`` -> fp32 with ``n * nb * block_weights`` values, in gguf-py's
      ``quants.dequantize`` order of operations (which the kernels' dequantization follows too).
    """

    kind: WeightType
    block_weights: int
    block_bytes: int
    record_bytes: int  # one block of 8 rows, packed
    pack: Callable[[Blocks], np.ndarray]
    unpack: Callable[[np.ndarray], Blocks]
    dequantize: Callable[[Blocks], np.ndarray]
    kernel: str  # the C file computing it (decoding/runtime/kernels)
    fp16_fields: tuple[int, ...] = ()  # byte offsets of a block's fp16 scales / minimums
    e8m0_fields: tuple[int, ...] = ()  # byte offsets of a block's power-of-two scales (E8M0: 2^(e - 127))
    is_float: bool = False  # rows kept as they are, multiplied by fp32 activations (no quantized activations)

    @property
    def name(self) -> str:
        return self.kind.name


def f16(a: np.ndarray) -> np.ndarray:
    """fp16 fields (2 bytes each, last axis) -> fp32."""
    return a.copy().view(np.float16).astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def bits(qh: np.ndarray) -> np.ndarray:
    """Bytes -> their bits, least significant first."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def chunks(a: np.ndarray, per_row: int) -> np.ndarray:
    """Bytes ``[G, 8 rows, blocks, per_row * 4]`` -> ``[G, blocks, per_row * 32]``: chunk c holds bytes 4c..4c+3 of
    each row in turn (row j at 4j)."""
    g, _, nb, _ = a.shape
    return a.reshape(g, GROUP, nb, per_row, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, per_row * 32)


def unchunk(a: np.ndarray, per_row: int) -> np.ndarray:
    """The inverse of ``chunks``: ``[G, blocks, per_row * 32]`` -> ``[G, 8, blocks, per_row * 4]``."""
    g, nb, _ = a.shape
    return a.reshape(g, nb, per_row, GROUP, 4).transpose(0, 3, 1, 2, 4).reshape(g, GROUP, nb, per_row * 4)


def side_by_side(a: np.ndarray) -> np.ndarray:
    """``[G, 8 rows, blocks, n]`` -> ``[G, blocks, 8 * n]``: the 8 rows' fields one after the other."""
    g, _, nb, n = a.shape
    return a.transpose(0, 2, 1, 3).reshape(g, nb, GROUP * n)


def apart(a: np.ndarray, n: int) -> np.ndarray:
    """The inverse of ``side_by_side``."""
    g, nb, _ = a.shape
    return a.reshape(g, nb, GROUP, n).transpose(0, 2, 1, 3)


def by_sub_block(v: np.ndarray) -> np.ndarray:
    """Per-sub-block bytes ``[G, 8 rows, blocks, S]`` -> ``[G, blocks, 8 S]`` with sub-block s of row j at 8s + j."""
    g, _, nb, subs = v.shape
    return v.transpose(0, 2, 3, 1).reshape(g, nb, GROUP * subs)


def by_row(v: np.ndarray) -> np.ndarray:
    """The inverse of ``by_sub_block``."""
    g, nb, n = v.shape
    return v.reshape(g, nb, n // GROUP, GROUP).transpose(0, 3, 1, 2)
