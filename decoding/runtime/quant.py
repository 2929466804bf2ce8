"""Quantized weight matrices in GGUF's formats, kept as stored (the formats themselves, one module each:
``decoding.runtime.formats``).

A matrix is ``rows`` weight rows (output features) of ``cols`` weights (input features), each row a run of blocks.
These are the exact block layouts of GGUF (ggml-common.h), so a GGUF tensor is used without changing a value: its
bytes are only rearranged, 8 rows interleaved into records (``pack_rows``, by each format's ``pack``; the float
formats' rows stay as they are), into what ``decoding/runtime/kernels`` reads (the K-quants' and IQ4_XS's 6-bit
scales unpacked, the one growth: at most 1.036x). ``quantize`` makes Q8_0 / Q4_1 from fp32 weights at load (a
safetensors model on the CPU), the way llama.cpp's reference quantizers do; the other formats come only from GGUF
files. ``dequantize`` is the fp32 reference (tests), GGUF's own arithmetic. ``join_rows`` keeps rows of several
formats together as one "parts" matrix (a fused q/k/v whose parts a file stores in different types), each part
computed in its own format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from decoding.runtime.formats import FORMATS, QK, QK_K, WeightType, format_of
from decoding.runtime.formats.base import GROUP

__all__ = ["QK", "QK_K", "QuantMatrix", "WeightType", "dequantize_rows", "join_rows", "pack_rows", "quantize",
           "stack_rows", "unpack_rows"]

NAMES = {"q8_0": WeightType.Q8_0, "q4_1": WeightType.Q4_1}  # what ``quantize`` makes (settings' cpu_quant)


PACK_CHUNK_BYTES = 8 << 20  # source bytes packed at a time: a format's temporaries stay this size, not a tensor's


def pack_rows(kind: WeightType, rows: np.ndarray, packed: Callable[[int, int], None] | None = None) -> np.ndarray:
    """GGUF rows ``[n, blocks * block_bytes]`` -> the kernels' layout ``[ceil(n / 8), blocks * record_bytes]``: rows
    in groups of 8 (the last one padded with zero rows), per group and block one record holding the 8 blocks' bytes
    rearranged, nothing recomputed (each format's module says how). Packed a chunk of groups at a time into the one
    output array, so loading a large tensor (a stack of experts, a vocabulary's head) holds the packed copy and one
    chunk's temporaries beside the file's bytes, not several whole-tensor intermediates (docs/models.md has the load's
    measured peaks). ``packed(r0, r1)`` is told when
    source rows ``[r0, r1)`` are packed (a GGUF load drops their file pages then)."""
    fmt = format_of(kind)
    n, width = rows.shape
    nb = width // fmt.block_bytes
    groups = (n + GROUP - 1) // GROUP
    out = np.empty((groups, nb * fmt.record_bytes), dtype=np.uint8)
    step = max(1, PACK_CHUNK_BYTES // max(1, GROUP * width))  # groups a chunk
    for g0 in range(0, groups, step):
        part = rows[g0 * GROUP : (g0 + step) * GROUP]
        if part.shape[0] % GROUP:  # the last group padded with zero rows
            part = np.concatenate([part, np.zeros((GROUP - part.shape[0] % GROUP, width), dtype=np.uint8)])
        rec = fmt.pack(part.reshape(-1, GROUP, nb, fmt.block_bytes))  # [G, j, b, bytes] -> [G, b, record]
        out[g0 : g0 + rec.shape[0]] = rec.reshape(rec.shape[0], -1)
        if packed is not None:
            packed(g0 * GROUP, min(n, (g0 + step) * GROUP))
    return out


def unpack_rows(kind: WeightType, packed: np.ndarray, n: int, cols: int) -> np.ndarray:
    """The inverse of ``pack_rows``: GGUF rows ``[n, blocks * block_bytes]``."""
    fmt = format_of(kind)
    nb = cols // fmt.block_weights
    rows = fmt.unpack(packed.reshape(-1, nb, fmt.record_bytes))  # [G, 8, nb, block_bytes]
    return np.ascontiguousarray(rows.reshape(-1, nb * fmt.block_bytes)[:n])


def dequantize_rows(kind: WeightType, raw: np.ndarray, cols: int) -> np.ndarray:
    """fp32 ``[n, cols]`` of GGUF rows ``[n, blocks * block_bytes]``, in GGUF's own fp32 arithmetic (gguf-py's
    ``quants.dequantize`` order of operations, which the kernels' dequantization follows too)."""
    fmt = format_of(kind)
    n = raw.shape[0]
    out = fmt.dequantize(raw.reshape(n, cols // fmt.block_weights, fmt.block_bytes))
    return np.ascontiguousarray(out.reshape(n, cols), dtype=np.float32)


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """``rows`` x ``cols`` weights in one block format, stored packed for the kernels (``pack_rows``); or (kind
    ``PARTS``, made by ``join_rows``) the rows of ``parts`` one after the other, each in its own format, ``data``
    then the kernels' description of them (per part: its data's address, format, bytes per group, rows)."""

    kind: WeightType
    data: torch.Tensor  # uint8 [ceil(rows / 8), blocks * record_bytes], contiguous (PARTS: int64 [1 + 4n])
    rows: int
    cols: int
    parts: tuple[QuantMatrix, ...] = field(default=())  # PARTS only: they hold the memory data points to

    @classmethod
    def from_rows(cls, kind: WeightType, rows: np.ndarray | torch.Tensor, cols: int,
                  packed: Callable[[int, int], None] | None = None) -> QuantMatrix:
        """From GGUF-layout rows ``[n, blocks * block_bytes]`` (e.g. a GGUF tensor's data); ``packed``: as
        ``pack_rows``'s."""
        raw = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        if kind not in FORMATS:
            raise ValueError(f"no block layout for {kind.name}")
        per = FORMATS[kind].block_weights
        if cols % per:
            raise ValueError(f"a {kind.name} row needs a multiple of {per} weights, got {cols}")
        want = cols // per * FORMATS[kind].block_bytes
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != want:
            raise ValueError(f"{kind.name} rows must be uint8 [n, {want}], got {raw.dtype} {tuple(raw.shape)}")
        return cls(kind, torch.from_numpy(pack_rows(kind, raw, packed)), int(raw.shape[0]), cols)

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
        """The GGUF layout: uint8 ``[rows, blocks * block_bytes]``."""
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
