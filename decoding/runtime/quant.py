"""Quantized weight matrices in GGUF's formats, kept as stored: the 32-weight blocks Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
IQ4_NL; the super-blocks of 256 Q4_K, Q5_K, Q6_K, IQ4_XS; and F16, BF16, F32 rows.

A matrix is ``rows`` weight rows (output features) of ``cols`` weights (input features), each row a run of
blocks, e.g.:

- ``Q8_0`` (34 bytes a block): fp16 scale ``d``, 32 int8 ``q``; ``w = d * q``.
- ``Q4_1`` (20 bytes a block): fp16 scale ``d``, fp16 minimum ``m``, 16 bytes holding weight ``t`` in the low
  nibble of byte ``t`` and weight ``t + 16`` in its high nibble; ``w = d * q + m``.
- ``Q4_K`` (144 bytes a super-block of 256): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit scales and mins (one of
  each per sub-block of 32), 128 bytes of nibbles; ``w = d * sc * q - dmin * m``.

(every format's block, packed layout and arithmetic: its file under ``decoding/runtime/kernels``). These are the
exact block layouts of GGUF (ggml-common.h), so a GGUF tensor is used without changing a value: its bytes are only
rearranged, 8 rows interleaved (``pack_rows``; the float formats' rows stay as they are), into what
``decoding/runtime/kernels`` reads (the K-quants' and IQ4_XS's 6-bit scales unpacked, the one growth: at most
1.028x). ``quantize`` makes Q8_0 / Q4_1 from fp32 weights at load (a safetensors model on the CPU), the way
llama.cpp's reference quantizers do; the other formats come only from GGUF files. ``dequantize`` is the fp32
reference (tests), GGUF's own arithmetic. ``join_rows`` keeps rows of several formats together as one "parts" matrix
(a fused q/k/v whose parts a file stores in different types), each part computed in its own format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

QK = 32  # weights per block (Q8_0, Q4_1, Q5_0; a K-quant's sub-block)
QK_K = 256  # weights per K-quant super-block


class WeightType(IntEnum):
    Q8_0 = 1  # the values the kernels know them by
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
    PARTS = 16  # rows of several matrices, one after the other (join_rows)


BLOCK_BYTES = {WeightType.Q8_0: 34, WeightType.Q4_1: 20, WeightType.Q4_K: 144, WeightType.Q6_K: 210,
               WeightType.Q5_0: 22, WeightType.Q4_0: 18, WeightType.Q5_1: 24, WeightType.IQ4_NL: 18,
               WeightType.IQ4_XS: 136, WeightType.Q5_K: 176, WeightType.F16: 2, WeightType.BF16: 2, WeightType.F32: 4}
BLOCK_WEIGHTS = {**{kind: QK for kind in (WeightType.Q8_0, WeightType.Q4_1, WeightType.Q5_0, WeightType.Q4_0,
                                          WeightType.Q5_1, WeightType.IQ4_NL)},
                 **{kind: QK_K for kind in (WeightType.Q4_K, WeightType.Q5_K, WeightType.Q6_K, WeightType.IQ4_XS)},
                 **{kind: 1 for kind in (WeightType.F16, WeightType.BF16, WeightType.F32)}}
FLOATS = frozenset({WeightType.F16, WeightType.BF16, WeightType.F32})  # rows kept as they are, fp32 activations
NAMES = {"q8_0": WeightType.Q8_0, "q4_1": WeightType.Q4_1}  # what ``quantize`` makes (settings' cpu_quant)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


# one block of 8 rows, packed (see pack_rows)
RECORD_BYTES = {WeightType.Q8_0: 272, WeightType.Q4_1: 160, WeightType.Q4_K: 1184, WeightType.Q6_K: 1680,
                WeightType.Q5_0: 176, WeightType.Q4_0: 144, WeightType.Q5_1: 192, WeightType.IQ4_NL: 144,
                WeightType.IQ4_XS: 1104, WeightType.Q5_K: 1440, WeightType.F16: 16, WeightType.BF16: 16,
                WeightType.F32: 32}
GROUP = 8


def _chunks(a: np.ndarray, per_row: int) -> np.ndarray:
    """Bytes ``[G, 8 rows, blocks, per_row * 4]`` -> ``[G, blocks, per_row * 32]``: chunk c holds bytes 4c..4c+3 of
    each row in turn (row j at 4j)."""
    g, _, nb, _ = a.shape
    return a.reshape(g, GROUP, nb, per_row, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, per_row * 32)


def _unchunk(a: np.ndarray, per_row: int) -> np.ndarray:
    """The inverse of ``_chunks``: ``[G, blocks, per_row * 32]`` -> ``[G, 8, blocks, per_row * 4]``."""
    g, nb, _ = a.shape
    return a.reshape(g, nb, per_row, GROUP, 4).transpose(0, 3, 1, 2, 4).reshape(g, GROUP, nb, per_row * 4)


def _side_by_side(a: np.ndarray) -> np.ndarray:
    """``[G, 8 rows, blocks, n]`` -> ``[G, blocks, 8 * n]``: the 8 rows' fields one after the other."""
    g, _, nb, n = a.shape
    return a.transpose(0, 2, 1, 3).reshape(g, nb, GROUP * n)


def _apart(a: np.ndarray, n: int) -> np.ndarray:
    """The inverse of ``_side_by_side``."""
    g, nb, _ = a.shape
    return a.reshape(g, nb, GROUP, n).transpose(0, 2, 1, 3)


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


def q6k_fields(ql: np.ndarray, qh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K's bytes ``ql [..., 128]``, ``qh [..., 64]`` -> each weight's low 4 and high 2 bits ``[..., 256]`` each: in
    each half of 128 weights, ql byte l (0..63) holds weights l (low nibble) and 64 + l (high nibble), qh byte l
    (0..31) weights l, 32 + l, 64 + l, 96 + l (bits 0-1, 2-3, 4-5, 6-7)."""
    shape = ql.shape[:-1]
    q = ql.reshape(*shape, 2, 1, 64)
    low = np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*shape, 256)
    h = qh.reshape(*shape, 2, 1, 32)
    high = np.concatenate([(h >> (2 * r)) & 3 for r in range(4)], axis=-2).reshape(*shape, 256)
    return low, high


def q6k_bytes(low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``q6k_fields``."""
    shape = low.shape[:-1]
    lo = low.reshape(*shape, 2, 2, 64)
    ql = (lo[..., 0, :] | (lo[..., 1, :] << 4)).reshape(*shape, 128)
    hi = high.reshape(*shape, 2, 4, 32)
    qh = (hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)).reshape(*shape, 64)
    return ql.astype(np.uint8), qh.astype(np.uint8)


def _fifth_chunk(qh: np.ndarray) -> np.ndarray:
    """The 32-weight blocks' fifth bits ``[G, 8 rows, blocks, 4]`` (bit v: weight v) -> ``[G, blocks, 32]``: byte
    4j + t, bit 2c + h: row j's weight 16h + 4c + t."""
    nb = qh.shape[2]
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [G, j, b, 32]
    bits = bits.reshape(-1, GROUP, nb, 2, 4, 4).transpose(0, 2, 1, 5, 4, 3)  # [G, b, j, t, c, h]
    return np.packbits(bits.reshape(-1, nb, 32, 8), axis=-1, bitorder="little").reshape(-1, nb, 32)


def _fifth_bytes(chunk: np.ndarray) -> np.ndarray:
    """The inverse of ``_fifth_chunk``."""
    nb = chunk.shape[1]
    bits = np.unpackbits(chunk.reshape(-1, nb, 32, 1), axis=-1, bitorder="little")  # [G, b, 4j+t, 2c+h]
    bits = bits.reshape(-1, nb, GROUP, 4, 4, 2).transpose(0, 2, 1, 5, 4, 3)  # [G, j, b, h, c, t]
    return np.packbits(bits.reshape(-1, GROUP, nb, 32), axis=-1, bitorder="little")


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


def pack_rows(kind: WeightType, rows: np.ndarray) -> np.ndarray:
    """GGUF rows ``[n, blocks * BLOCK_BYTES]`` -> the kernels' layout ``[ceil(n / 8), blocks * RECORD_BYTES]``.

    Rows go in groups of 8 (the last one padded with zero rows); per group and block one record holding the
    8 blocks' bytes rearranged, nothing recomputed, the 8 rows' fp16 fields side by side, then "chunks" of 32 bytes
    with 4 bytes of each row in turn (bytes 4j..4j+3: row j), so one integer instruction on a chunk works on all 8
    rows:

    - Q8_0 (272): the 8 scales, 8 chunks of weights (chunk c: weights 4c..4c+3);
    - Q4_1 (160): the 8 scales, the 8 minimums, 4 chunks of the nibble bytes (chunk c: bytes 4c..4c+3, i.e.
      weights 4c..4c+3 and 16+4c..16+4c+3);
    - Q5_0 (176): the 8 scales, a chunk of fifth bits (byte 4j + t, bit 2c + h: row j's weight 16h + 4c + t), 4
      chunks of nibble bytes as Q4_1's;
    - Q4_0 and IQ4_NL (144): the 8 scales, 4 chunks of nibble bytes as Q4_1's;
    - Q5_1 (192): the 8 scales, the 8 minimums, the fifth bits as Q5_0's, 4 chunks of nibble bytes;
    - Q5_K (1440): as Q4_K, with 8 chunks of the fifth bits (chunk c: each row's qh bytes 4c..4c+3) before the
      nibbles;
    - IQ4_XS (1104): the 8 d, the 8 sub-blocks' scales minus 32 as int8 (sub-block s of row j at 8s + j), 32
      chunks of nibble bytes (chunk k: bytes 4k..4k+3);
    - F16, BF16, F32: the 8 rows as they are, one after the other (nothing interleaved: the kernels read a row's
      values in order).
    - Q4_K (1184): the 8 d, the 8 dmin, the 6-bit scales unpacked to bytes (sub-block s of row j at 8s + j), the
      mins likewise, 32 chunks of nibble bytes (chunk k: bytes 4k..4k+3);
    - Q6_K (1680): the 8 d, then per block of 32 weights b (208 bytes): each row's int8 scale pair (sc[2b],
      sc[2b+1]), 4 chunks of low bits (chunk p: the low 4 bits of weights 32b + 4p + t, low nibble, and
      32b + 16 + 4p + t, high nibble), 2 chunks of high bits (chunk k: bits 2u, 2u + 1 the high 2 bits of weight
      32b + 16k + 4u + t): the file's 4-bit and 2-bit fields regrouped by block (``q6k_fields``), so the kernel
      reads every byte once, in order.
    """
    n, width = rows.shape
    bb = BLOCK_BYTES[kind]
    nb = width // bb
    padded = np.zeros(((n + GROUP - 1) // GROUP * GROUP, width), dtype=np.uint8)
    padded[:n] = rows
    g = padded.reshape(-1, GROUP, nb, bb)  # [G, j, b, bytes]
    if kind in FLOATS:
        return np.ascontiguousarray(padded.reshape(-1, GROUP * width))
    if kind == WeightType.Q8_0:
        rec = np.concatenate([_side_by_side(g[..., :2]), _chunks(g[..., 2:], 8)], axis=-1)
    elif kind in (WeightType.Q4_0, WeightType.IQ4_NL):
        rec = np.concatenate([_side_by_side(g[..., :2]), _chunks(g[..., 2:], 4)], axis=-1)
    elif kind == WeightType.Q5_1:
        rec = np.concatenate([_side_by_side(g[..., :2]), _side_by_side(g[..., 2:4]), _fifth_chunk(g[..., 4:8]),
                              _chunks(g[..., 8:], 4)], axis=-1)
    elif kind == WeightType.Q5_K:
        sc, mn = q4k_scales(g[..., 4:16])
        rec = np.concatenate([_side_by_side(g[..., :2]), _side_by_side(g[..., 2:4]), _apart_t(sc), _apart_t(mn),
                              _chunks(g[..., 16:48], 8), _chunks(g[..., 48:], 32)], axis=-1)
    elif kind == WeightType.IQ4_XS:
        sc = iq4xs_scales(g[..., 2:8]).view(np.uint8)
        rec = np.concatenate([_side_by_side(g[..., :2]), _apart_t(sc), _chunks(g[..., 8:], 32)], axis=-1)
    elif kind == WeightType.Q4_1:
        rec = np.concatenate([_side_by_side(g[..., :2]), _side_by_side(g[..., 2:4]), _chunks(g[..., 4:], 4)], axis=-1)
    elif kind == WeightType.Q5_0:
        rec = np.concatenate([_side_by_side(g[..., :2]), _fifth_chunk(g[..., 2:6]), _chunks(g[..., 6:], 4)], axis=-1)
    elif kind == WeightType.Q4_K:
        sc, mn = q4k_scales(g[..., 4:16])
        rec = np.concatenate([_side_by_side(g[..., :2]), _side_by_side(g[..., 2:4]), _apart_t(sc), _apart_t(mn),
                              _chunks(g[..., 16:], 32)], axis=-1)
    elif kind == WeightType.Q6_K:
        low, high = q6k_fields(g[..., :128], g[..., 128:192])  # [G, j, S, 256] each
        low = low.reshape(-1, GROUP, nb, 8, 2, 4, 4)  # [G, j, S, b, half, p, t]
        ql = low[..., 0, :, :] | (low[..., 1, :, :] << 4)  # [G, j, S, b, p, t]
        high = high.reshape(-1, GROUP, nb, 8, 2, 4, 4)  # [G, j, S, b, k, u, t]
        qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)  # [.., k, t]
        pairs = g[..., 192:208].reshape(-1, GROUP, nb, 8, 2)  # [G, j, S, b, 2]
        blocks = np.concatenate([pairs.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 8, 16),
                                 ql.transpose(0, 2, 3, 4, 1, 5).reshape(-1, nb, 8, 128),
                                 qh.transpose(0, 2, 3, 4, 1, 5).reshape(-1, nb, 8, 64)], axis=-1)
        rec = np.concatenate([_side_by_side(g[..., 208:210]), blocks.reshape(-1, nb, 8 * 208)], axis=-1)
    else:
        raise ValueError(f"no packed layout for {kind.name}")
    return np.ascontiguousarray(rec.reshape(rec.shape[0], -1))


def _apart_t(v: np.ndarray) -> np.ndarray:
    """Per-sub-block bytes ``[G, 8 rows, blocks, 8]`` -> ``[G, blocks, 64]`` with sub-block s of row j at 8s + j."""
    g, _, nb, _ = v.shape
    return v.transpose(0, 2, 3, 1).reshape(g, nb, 64)


def _together_t(v: np.ndarray) -> np.ndarray:
    """The inverse of ``_apart_t``."""
    g, nb, _ = v.shape
    return v.reshape(g, nb, 8, GROUP).transpose(0, 3, 1, 2)


def unpack_rows(kind: WeightType, packed: np.ndarray, n: int, cols: int) -> np.ndarray:
    """The inverse of ``pack_rows``: GGUF rows ``[n, blocks * BLOCK_BYTES]``."""
    nb = cols // BLOCK_WEIGHTS[kind]
    if kind in FLOATS:
        return np.ascontiguousarray(packed.reshape(-1, cols * BLOCK_BYTES[kind])[:n])
    rec = packed.reshape(-1, nb, RECORD_BYTES[kind])
    if kind == WeightType.Q8_0:
        parts = [_apart(rec[..., :16], 2), _unchunk(rec[..., 16:], 8)]
    elif kind in (WeightType.Q4_0, WeightType.IQ4_NL):
        parts = [_apart(rec[..., :16], 2), _unchunk(rec[..., 16:], 4)]
    elif kind == WeightType.Q5_1:
        parts = [_apart(rec[..., :16], 2), _apart(rec[..., 16:32], 2), _fifth_bytes(rec[..., 32:64]),
                 _unchunk(rec[..., 64:], 4)]
    elif kind == WeightType.Q5_K:
        sc, mn = _together_t(rec[..., 32:96]), _together_t(rec[..., 96:160])
        parts = [_apart(rec[..., :16], 2), _apart(rec[..., 16:32], 2), q4k_pack_scales(sc, mn),
                 _unchunk(rec[..., 160:416], 8), _unchunk(rec[..., 416:], 32)]
    elif kind == WeightType.IQ4_XS:
        sc = _together_t(rec[..., 16:80]).view(np.int8)
        parts = [_apart(rec[..., :16], 2), iq4xs_pack_scales(sc), _unchunk(rec[..., 80:], 32)]
    elif kind == WeightType.Q4_1:
        parts = [_apart(rec[..., :16], 2), _apart(rec[..., 16:32], 2), _unchunk(rec[..., 32:], 4)]
    elif kind == WeightType.Q5_0:
        parts = [_apart(rec[..., :16], 2), _fifth_bytes(rec[..., 16:48]), _unchunk(rec[..., 48:], 4)]
    elif kind == WeightType.Q4_K:
        sc, mn = _together_t(rec[..., 32:96]), _together_t(rec[..., 96:160])
        parts = [_apart(rec[..., :16], 2), _apart(rec[..., 16:32], 2), q4k_pack_scales(sc, mn),
                 _unchunk(rec[..., 160:], 32)]
    elif kind == WeightType.Q6_K:
        blocks = rec[..., 16:].reshape(-1, nb, 8, 208)  # [G, S, b, bytes]
        pairs = blocks[..., :16].reshape(-1, nb, 8, GROUP, 2).transpose(0, 3, 1, 2, 4).reshape(-1, GROUP, nb, 16)
        ql = blocks[..., 16:144].reshape(-1, nb, 8, 4, GROUP, 4).transpose(0, 4, 1, 2, 3, 5)  # [G, j, S, b, p, t]
        qh = blocks[..., 144:].reshape(-1, nb, 8, 2, GROUP, 4).transpose(0, 4, 1, 2, 3, 5)  # [G, j, S, b, k, t]
        low = np.stack([ql & 0x0F, ql >> 4], axis=-3)  # [G, j, S, b, half, p, t]
        high = np.stack([(qh >> (2 * u)) & 3 for u in range(4)], axis=-2)  # [G, j, S, b, k, u, t]
        gql, gqh = q6k_bytes(low.reshape(-1, GROUP, nb, 256), high.reshape(-1, GROUP, nb, 256))
        parts = [gql, gqh, pairs, _apart(rec[..., :16], 2)]
    else:
        raise ValueError(f"no packed layout for {kind.name}")
    rows = np.concatenate(parts, axis=-1)
    return np.ascontiguousarray(rows.reshape(-1, nb * BLOCK_BYTES[kind])[:n])


def dequantize_rows(kind: WeightType, raw: np.ndarray, cols: int) -> np.ndarray:
    """fp32 ``[n, cols]`` of GGUF rows ``[n, blocks * BLOCK_BYTES]``, in GGUF's own fp32 arithmetic (gguf-py's
    ``quants.dequantize`` order of operations, which the kernels' dequantization follows too)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, cols // BLOCK_WEIGHTS[kind], BLOCK_BYTES[kind])

    def f16(a: np.ndarray) -> np.ndarray:
        return a.copy().view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # 16 bytes -> 32 values: low nibbles first, then high
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    def fifth(qh: np.ndarray) -> np.ndarray:
        return np.unpackbits(qh, axis=-1, bitorder="little")

    if kind in FLOATS:
        if kind == WeightType.F32:
            return np.ascontiguousarray(raw).view(np.float32).reshape(n, cols).copy()
        if kind == WeightType.F16:
            return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(n, cols)
        return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, cols)
    if kind == WeightType.Q4_0:
        out = f16(blocks[..., 0:2]) * (nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)
    elif kind == WeightType.IQ4_NL:
        out = f16(blocks[..., 0:2]) * IQ4_VALUES[nibbles(blocks[..., 2:])].astype(np.float32)
    elif kind == WeightType.Q5_1:
        q = (nibbles(blocks[..., 8:]) | (fifth(blocks[..., 4:8]) << 4)).astype(np.float32)
        out = f16(blocks[..., 0:2]) * q + f16(blocks[..., 2:4])
    elif kind == WeightType.Q5_K:
        sc, mn = q4k_scales(blocks[..., 4:16])
        dl = (f16(blocks[..., 0:2]) * sc.astype(np.float32))[..., None]  # [n, S, 8, 1]
        ml = (f16(blocks[..., 2:4]) * mn.astype(np.float32))[..., None]
        qs = blocks[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        qh = blocks[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = ((qs & 0x0F).reshape(n, -1, 8, 32) | ((qh & 1) << 4)).astype(np.float32)
        out = dl * q - ml
    elif kind == WeightType.IQ4_XS:
        dl = (f16(blocks[..., 0:2]) * iq4xs_scales(blocks[..., 2:8]).astype(np.float32))[..., None]  # [n, S, 8, 1]
        q = IQ4_VALUES[nibbles(blocks[..., 8:].reshape(n, -1, 8, 16))].astype(np.float32)
        out = dl * q
    elif kind == WeightType.Q8_0:
        out = f16(blocks[..., 0:2]) * blocks[..., 2:].view(np.int8).astype(np.float32)
    elif kind == WeightType.Q4_1:
        out = f16(blocks[..., 0:2]) * nibbles(blocks[..., 4:]).astype(np.float32) + f16(blocks[..., 2:4])
    elif kind == WeightType.Q5_0:
        q = (nibbles(blocks[..., 6:]) | (fifth(blocks[..., 2:6]) << 4)).astype(np.int8) - np.int8(16)
        out = f16(blocks[..., 0:2]) * q.astype(np.float32)
    elif kind == WeightType.Q4_K:
        sc, mn = q4k_scales(blocks[..., 4:16])
        dl = (f16(blocks[..., 0:2]) * sc.astype(np.float32))[..., None]  # [n, S, 8, 1]
        ml = (f16(blocks[..., 2:4]) * mn.astype(np.float32))[..., None]
        qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, -1, 8, 32).astype(np.float32)
        out = dl * q - ml
    elif kind == WeightType.Q6_K:
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        dl = (f16(blocks[..., 208:210]) * blocks[..., 192:208].view(np.int8).astype(np.float32))[..., None]
        shifted = ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        low = (shifted & 0x0F).reshape(n, -1, 2, 4, 32)  # [n, S, half, quarter, 32]
        high = qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        q = ((low | ((high & 3) << 4)).astype(np.int8) - np.int8(32)).reshape(n, -1, 16, 16).astype(np.float32)
        out = dl * q
    else:
        raise ValueError(f"cannot dequantize {kind.name}")
    return np.ascontiguousarray(out.reshape(n, cols), dtype=np.float32)


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """``rows`` x ``cols`` weights in one block format, stored packed for the kernels (``pack_rows``); or (kind
    ``PARTS``, made by ``join_rows``) the rows of ``parts`` one after the other, each in its own format, ``data``
    then the kernels' description of them (per part: its data's address, format, bytes per group, rows)."""

    kind: WeightType
    data: torch.Tensor  # uint8 [ceil(rows / 8), blocks * RECORD_BYTES[kind]], contiguous (PARTS: int64 [1 + 4n])
    rows: int
    cols: int
    parts: tuple[QuantMatrix, ...] = field(default=())  # PARTS only: they hold the memory data points to

    @classmethod
    def from_rows(cls, kind: WeightType, rows: np.ndarray | torch.Tensor, cols: int) -> QuantMatrix:
        """From GGUF-layout rows ``[n, blocks * BLOCK_BYTES[kind]]`` (e.g. a GGUF tensor's data)."""
        raw = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        if kind not in BLOCK_BYTES:
            raise ValueError(f"no block layout for {kind.name}")
        per = BLOCK_WEIGHTS[kind]
        if cols % per:
            raise ValueError(f"a {kind.name} row needs a multiple of {per} weights, got {cols}")
        want = cols // per * BLOCK_BYTES[kind]
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != want:
            raise ValueError(f"{kind.name} rows must be uint8 [n, {want}], got {raw.dtype} {tuple(raw.shape)}")
        return cls(kind, torch.from_numpy(pack_rows(kind, raw)), int(raw.shape[0]), cols)

    @property
    def group_bytes(self) -> int:
        """Bytes of one group of 8 packed rows (0 for a parts matrix: each part has its own)."""
        return 0 if self.kind == WeightType.PARTS else int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        """The weights' bytes as served (a parts matrix: its parts')."""
        return sum(p.nbytes for p in self.parts) if self.kind == WeightType.PARTS else self.data.numel()

    @property
    def kinds(self) -> frozenset[WeightType]:
        """The block formats this matrix holds."""
        return frozenset(p.kind for p in self.parts) if self.kind == WeightType.PARTS else frozenset({self.kind})

    def row_data(self) -> np.ndarray:
        """The GGUF layout: uint8 ``[rows, blocks * BLOCK_BYTES[kind]]``."""
        if self.kind == WeightType.PARTS:
            raise ValueError("a parts matrix has no one GGUF layout: read its parts")
        return unpack_rows(self.kind, self.data.numpy(), self.rows, self.cols)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, cols]`` in GGUF's own arithmetic (``dequantize_rows``), as the kernels dequantize."""
        if self.kind == WeightType.PARTS:
            return torch.cat([p.dequantize() for p in self.parts])
        return torch.from_numpy(dequantize_rows(self.kind, self.row_data(), self.cols))

    def select_rows(self, index: torch.Tensor | np.ndarray) -> QuantMatrix:
        """Rows in a new order (blocks run along a row, so any row permutation keeps them intact)."""
        return QuantMatrix.from_rows(self.kind, self.row_data()[np.asarray(index)], self.cols)


def stack_rows(parts: list[QuantMatrix]) -> QuantMatrix:
    """One matrix of the rows of ``parts`` in order (e.g. q, k, v projections fused into one), one format."""
    kinds = {p.kind for p in parts}
    cols = {p.cols for p in parts}
    if len(kinds) != 1 or len(cols) != 1 or WeightType.PARTS in kinds:
        raise ValueError("fused matrices need one weight type and one width")
    if len(parts) == 1:
        return parts[0]
    return QuantMatrix.from_rows(parts[0].kind, np.concatenate([p.row_data() for p in parts]), parts[0].cols)


def join_rows(parts: list[QuantMatrix]) -> QuantMatrix:
    """The rows of ``parts`` in order as one matrix, each kept in its own format: ``stack_rows`` where they share
    one, else a ``PARTS`` matrix of the runs of neighbours that share one (the kernels compute each run as a
    matrix of its own on the same quantized activations, writing its columns of the output)."""
    flat = [q for p in parts for q in (p.parts if p.kind == WeightType.PARTS else (p,))]
    if len({p.cols for p in flat}) != 1:
        raise ValueError("joined matrices need one width")
    runs: list[list[QuantMatrix]] = []
    for p in flat:
        if runs and runs[-1][0].kind == p.kind:
            runs[-1].append(p)
        else:
            runs.append([p])
    stacked = tuple(stack_rows(run) for run in runs)
    if len(stacked) == 1:
        return stacked[0]
    desc = [len(stacked)]
    for p in stacked:
        desc += [int(p.data.data_ptr()), int(p.kind), p.group_bytes, p.rows]
    return QuantMatrix(WeightType.PARTS, torch.tensor(desc, dtype=torch.int64), sum(p.rows for p in stacked),
                       flat[0].cols, stacked)


def quantize(weight: torch.Tensor, kind: WeightType) -> QuantMatrix:
    """Quantize an fp32/fp16/bf16 ``[rows, cols]`` matrix per 32-weight block (round to nearest) to Q8_0 or Q4_1,
    or keep it as F32 (the other formats are only read from GGUF files)."""
    if kind not in (WeightType.Q8_0, WeightType.Q4_1, WeightType.F32):
        raise ValueError(f"quantize makes Q8_0, Q4_1 or F32, not {kind.name} (the others: read from GGUF files)")
    w = weight.detach().to(torch.float32).cpu().numpy()
    rows, cols = w.shape
    if kind == WeightType.F32:
        return QuantMatrix.from_rows(kind, np.ascontiguousarray(w).view(np.uint8), cols)
    if cols % QK:
        raise ValueError(f"cannot quantize rows of {cols} weights: not a multiple of {QK}")
    blocks = w.reshape(rows, cols // QK, QK)
    if kind == WeightType.Q8_0:
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        d = amax / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
        raw = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)
    else:
        lo = blocks.min(axis=-1, keepdims=True)
        hi = blocks.max(axis=-1, keepdims=True)
        d = (hi - lo) / 15.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.floor((blocks - lo) * inv + 0.5), 0, 15).astype(np.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        raw = np.concatenate(
            [d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8), packed], axis=-1
        )
    return QuantMatrix.from_rows(kind, raw.reshape(rows, -1), cols)
