"""Q6_K (210 bytes a super-block of 256): 128 bytes of low 4 bits, 64 bytes of high 2 bits (``q6k_fields``), 16
int8 scales (one per 16 weights), fp16 ``d``; ``w = d * sc * (q - 32)``.

Packed (1680 bytes a record): the 8 d, then per block of 32 weights b (208 bytes): each row's int8 scale pair
(sc[2b], sc[2b+1]), 4 chunks of low bits (chunk p: the low 4 bits of weights 32b + 4p + t, low nibble, and
32b + 16 + 4p + t, high nibble), 2 chunks of high bits (chunk k: bits 2u, 2u + 1 the high 2 bits of weight
32b + 16k + 4u + t): the file's 4-bit and 2-bit fields regrouped by block, so the kernel reads every byte once, in
order."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import GROUP, QK_K, Format, WeightType, apart, f16, side_by_side


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


def pack(g: np.ndarray) -> np.ndarray:
    nb = g.shape[2]
    low, high = q6k_fields(g[..., :128], g[..., 128:192])  # [G, j, S, 256] each
    low = low.reshape(-1, GROUP, nb, 8, 2, 4, 4)  # [G, j, S, b, half, p, t]
    ql = low[..., 0, :, :] | (low[..., 1, :, :] << 4)  # [G, j, S, b, p, t]
    high = high.reshape(-1, GROUP, nb, 8, 2, 4, 4)  # [G, j, S, b, k, u, t]
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)  # [.., k, t]
    pairs = g[..., 192:208].reshape(-1, GROUP, nb, 8, 2)  # [G, j, S, b, 2]
    blocks = np.concatenate([pairs.transpose(0, 2, 3, 1, 4).reshape(-1, nb, 8, 16),
                             ql.transpose(0, 2, 3, 4, 1, 5).reshape(-1, nb, 8, 128),
                             qh.transpose(0, 2, 3, 4, 1, 5).reshape(-1, nb, 8, 64)], axis=-1)
    return np.concatenate([side_by_side(g[..., 208:210]), blocks.reshape(-1, nb, 8 * 208)], axis=-1)


def unpack(rec: np.ndarray) -> np.ndarray:
    nb = rec.shape[1]
    blocks = rec[..., 16:].reshape(-1, nb, 8, 208)  # [G, S, b, bytes]
    pairs = blocks[..., :16].reshape(-1, nb, 8, GROUP, 2).transpose(0, 3, 1, 2, 4).reshape(-1, GROUP, nb, 16)
    ql = blocks[..., 16:144].reshape(-1, nb, 8, 4, GROUP, 4).transpose(0, 4, 1, 2, 3, 5)  # [G, j, S, b, p, t]
    qh = blocks[..., 144:].reshape(-1, nb, 8, 2, GROUP, 4).transpose(0, 4, 1, 2, 3, 5)  # [G, j, S, b, k, t]
    low = np.stack([ql & 0x0F, ql >> 4], axis=-3)  # [G, j, S, b, half, p, t]
    high = np.stack([(qh >> (2 * u)) & 3 for u in range(4)], axis=-2)  # [G, j, S, b, k, u, t]
    gql, gqh = q6k_bytes(low.reshape(-1, GROUP, nb, 256), high.reshape(-1, GROUP, nb, 256))
    return np.concatenate([gql, gqh, pairs, apart(rec[..., :16], 2)], axis=-1)


def dequantize(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[..., :128], b[..., 128:192]
    dl = (f16(b[..., 208:210]) * b[..., 192:208].view(np.int8).astype(np.float32))[..., None]
    shifted = ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (shifted & 0x0F).reshape(n, -1, 2, 4, 32)  # [n, S, half, quarter, 32]
    high = qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q = ((low | ((high & 3) << 4)).astype(np.int8) - np.int8(32)).reshape(n, -1, 16, 16).astype(np.float32)
    return dl * q


FORMAT = Format(WeightType.Q6_K, QK_K, 210, 1680, pack, unpack, dequantize, "formats_int.c", fp16_fields=(208,))
