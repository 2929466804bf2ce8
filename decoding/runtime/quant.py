"""Quantized weight matrices in GGUF's block formats, kept as stored: Q8_0 and Q4_1.

A matrix is ``rows`` weight rows (output features) of ``cols`` weights (input features, a multiple of 32),
each row a run of 32-weight blocks:

- ``Q8_0`` (34 bytes a block): fp16 scale ``d``, 32 int8 ``q``; ``w = d * q``.
- ``Q4_1`` (20 bytes a block): fp16 scale ``d``, fp16 minimum ``m``, 16 bytes holding weight ``t`` in the low
  nibble of byte ``t`` and weight ``t + 16`` in its high nibble; ``w = d * q + m``.

These are the exact block layouts of GGUF, so a GGUF tensor is used without changing a value: its bytes
are only rearranged, 8 rows interleaved (``pack_rows``), into what ``decoding/runtime/kernels/quant_kernels.c``
reads. ``quantize`` makes them from fp32 weights at load (a safetensors model on the CPU), the way
llama.cpp's reference quantizers do; ``dequantize`` is the fp32 reference (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

QK = 32  # weights per block


class WeightType(IntEnum):
    Q8_0 = 1  # the values quant_kernels.c knows them by
    Q4_1 = 2


BLOCK_BYTES = {WeightType.Q8_0: 34, WeightType.Q4_1: 20}
NAMES = {"q8_0": WeightType.Q8_0, "q4_1": WeightType.Q4_1}


RECORD_BYTES = {WeightType.Q8_0: 272, WeightType.Q4_1: 160}  # one block of 8 rows, packed (see pack_rows)
GROUP = 8


def pack_rows(kind: WeightType, rows: np.ndarray) -> np.ndarray:
    """GGUF rows ``[n, blocks * BLOCK_BYTES]`` -> the kernels' layout ``[ceil(n / 8), blocks * RECORD_BYTES]``.

    Rows go in groups of 8 (the last one padded with zero rows); per group and block one record holding the
    8 blocks' bytes rearranged, nothing recomputed: the 8 fp16 scales (Q4_1: then the 8 fp16 minimums), then
    chunks of 32 bytes with 4 bytes of each row in turn (Q4_1: GGUF bytes 4cc..4cc+3 of the nibble array,
    i.e. weights 4cc..4cc+3 and 16+4cc..16+4cc+3; Q8_0: weights 4c..4c+3), so one integer instruction on a
    chunk works on all 8 rows.
    """
    n, width = rows.shape
    bb = BLOCK_BYTES[kind]
    nb = width // bb
    padded = np.zeros(((n + GROUP - 1) // GROUP * GROUP, width), dtype=np.uint8)
    padded[:n] = rows
    g = padded.reshape(-1, GROUP, nb, bb)  # [G, j, b, bytes]
    scales = g[..., :2].transpose(0, 2, 1, 3).reshape(-1, nb, 2 * GROUP)  # [G, b, d of the 8 rows]
    if kind == WeightType.Q4_1:
        mins = g[..., 2:4].transpose(0, 2, 1, 3).reshape(-1, nb, 2 * GROUP)
        qs = g[..., 4:].reshape(-1, GROUP, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(-1, nb, 128)
        rec = np.concatenate([scales, mins, qs], axis=-1)
    else:
        qs = g[..., 2:].reshape(-1, GROUP, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(-1, nb, 256)
        rec = np.concatenate([scales, qs], axis=-1)
    return np.ascontiguousarray(rec.reshape(rec.shape[0], -1))


def unpack_rows(kind: WeightType, packed: np.ndarray, n: int, cols: int) -> np.ndarray:
    """The inverse of ``pack_rows``: GGUF rows ``[n, blocks * BLOCK_BYTES]``."""
    nb = cols // QK
    rec = packed.reshape(-1, nb, RECORD_BYTES[kind])
    scales = rec[..., :16].reshape(-1, nb, GROUP, 2).transpose(0, 2, 1, 3)  # [G, j, b, 2]
    if kind == WeightType.Q4_1:
        mins = rec[..., 16:32].reshape(-1, nb, GROUP, 2).transpose(0, 2, 1, 3)
        qs = rec[..., 32:].reshape(-1, nb, 4, GROUP, 4).transpose(0, 3, 1, 2, 4).reshape(-1, GROUP, nb, 16)
        rows = np.concatenate([scales, mins, qs], axis=-1)
    else:
        qs = rec[..., 16:].reshape(-1, nb, 8, GROUP, 4).transpose(0, 3, 1, 2, 4).reshape(-1, GROUP, nb, 32)
        rows = np.concatenate([scales, qs], axis=-1)
    return np.ascontiguousarray(rows.reshape(-1, nb * BLOCK_BYTES[kind])[:n])


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """``rows`` x ``cols`` weights in one block format, stored packed for the kernels (``pack_rows``)."""

    kind: WeightType
    data: torch.Tensor  # uint8 [ceil(rows / 8), blocks * RECORD_BYTES[kind]], contiguous
    rows: int
    cols: int

    @classmethod
    def from_rows(cls, kind: WeightType, rows: np.ndarray | torch.Tensor, cols: int) -> QuantMatrix:
        """From GGUF-layout rows ``[n, blocks * BLOCK_BYTES[kind]]`` (e.g. a GGUF tensor's data)."""
        raw = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        if cols % QK:
            raise ValueError(f"a quantized row needs a multiple of {QK} weights, got {cols}")
        want = cols // QK * BLOCK_BYTES[kind]
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != want:
            raise ValueError(f"{kind.name} rows must be uint8 [n, {want}], got {raw.dtype} {tuple(raw.shape)}")
        return cls(kind, torch.from_numpy(pack_rows(kind, raw)), int(raw.shape[0]), cols)

    @property
    def group_bytes(self) -> int:
        """Bytes of one group of 8 packed rows."""
        return int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def row_data(self) -> np.ndarray:
        """The GGUF layout: uint8 ``[rows, blocks * BLOCK_BYTES[kind]]``."""
        return unpack_rows(self.kind, self.data.numpy(), self.rows, self.cols)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, cols]``, computed as the kernels do (``d * q`` or ``d * q + m`` in fp32)."""
        raw = self.row_data().reshape(self.rows, self.cols // QK, BLOCK_BYTES[self.kind])
        d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1]
        if self.kind == WeightType.Q8_0:
            q = raw[..., 2:].view(np.int8).astype(np.float32)
            out = d * q
        else:
            m = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
            qs = raw[..., 4:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
            out = d * q + m
        return torch.from_numpy(np.ascontiguousarray(out.reshape(self.rows, self.cols), dtype=np.float32))

    def select_rows(self, index: torch.Tensor | np.ndarray) -> QuantMatrix:
        """Rows in a new order (blocks run along a row, so any row permutation keeps them intact)."""
        return QuantMatrix.from_rows(self.kind, self.row_data()[np.asarray(index)], self.cols)


def stack_rows(parts: list[QuantMatrix]) -> QuantMatrix:
    """One matrix of the rows of ``parts`` in order (e.g. q, k, v projections fused into one)."""
    kinds = {p.kind for p in parts}
    cols = {p.cols for p in parts}
    if len(kinds) != 1 or len(cols) != 1:
        raise ValueError("fused matrices need one weight type and one width")
    return QuantMatrix.from_rows(parts[0].kind, np.concatenate([p.row_data() for p in parts]), parts[0].cols)


def quantize(weight: torch.Tensor, kind: WeightType) -> QuantMatrix:
    """Quantize an fp32/fp16/bf16 ``[rows, cols]`` matrix per 32-weight block (round to nearest)."""
    w = weight.detach().to(torch.float32).cpu().numpy()
    rows, cols = w.shape
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
