"""Quantized weight matrices in GGUF's block formats, kept as stored: Q8_0 and Q4_1.

A matrix is ``rows`` weight rows (output features) of ``cols`` weights (input features, a multiple of 32),
each row a run of 32-weight blocks:

- ``Q8_0`` (34 bytes a block): fp16 scale ``d``, 32 int8 ``q``; ``w = d * q``.
- ``Q4_1`` (20 bytes a block): fp16 scale ``d``, fp16 minimum ``m``, 16 bytes holding weight ``t`` in the low
  nibble of byte ``t`` and weight ``t + 16`` in its high nibble; ``w = d * q + m``.

These are the exact byte layouts of GGUF (so a GGUF tensor is used without conversion) and what
``decoding/kernels/quant_kernels.c`` reads. ``quantize`` makes them from fp32 weights at load (a safetensors
model on the CPU), the way llama.cpp's reference quantizers do; ``dequantize`` is the fp32 reference
(tests, and the torch fallback of the quantized runtime).
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


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    kind: WeightType
    data: torch.Tensor  # uint8 [rows, blocks * BLOCK_BYTES[kind]], contiguous
    cols: int

    def __post_init__(self) -> None:
        if self.cols % QK:
            raise ValueError(f"a quantized row needs a multiple of {QK} weights, got {self.cols}")
        want = self.cols // QK * BLOCK_BYTES[self.kind]
        if self.data.dtype != torch.uint8 or self.data.ndim != 2 or self.data.shape[1] != want:
            raise ValueError(f"{self.kind.name} data must be uint8 [rows, {want}], got {tuple(self.data.shape)}")

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def row_bytes(self) -> int:
        return int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[rows, cols]``, computed as the kernels do (``d * q`` or ``d * q + m`` in fp32)."""
        raw = self.data.numpy().reshape(self.rows, self.cols // QK, BLOCK_BYTES[self.kind])
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
        idx = torch.as_tensor(np.asarray(index), dtype=torch.long)
        return QuantMatrix(self.kind, self.data.index_select(0, idx).contiguous(), self.cols)


def stack_rows(parts: list[QuantMatrix]) -> QuantMatrix:
    """One matrix of the rows of ``parts`` in order (e.g. q, k, v projections fused into one)."""
    kinds = {p.kind for p in parts}
    cols = {p.cols for p in parts}
    if len(kinds) != 1 or len(cols) != 1:
        raise ValueError("fused matrices need one weight type and one width")
    return QuantMatrix(parts[0].kind, torch.cat([p.data for p in parts]).contiguous(), parts[0].cols)


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
    data = torch.from_numpy(np.ascontiguousarray(raw.reshape(rows, -1)))
    return QuantMatrix(kind, data, cols)
