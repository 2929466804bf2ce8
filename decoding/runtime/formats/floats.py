"""The float formats F16, BF16, F32 (a "block" is one weight): rows kept as they are, 8 rows one after the other in
a record (nothing interleaved: the kernels read a row's values in order), multiplied by fp32 activations."""

from __future__ import annotations

import numpy as np

from decoding.runtime.formats.base import GROUP, Format, WeightType


def pack(g: np.ndarray) -> np.ndarray:
    return g.reshape(g.shape[0], -1)


def unpack(rec: np.ndarray) -> np.ndarray:
    return rec.reshape(rec.shape[0], GROUP, rec.shape[1], -1)


def _f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32).copy()


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


F16 = Format(WeightType.F16, 1, 2, 16, pack, unpack, _f16, "formats_float.c", is_float=True)
BF16 = Format(WeightType.BF16, 1, 2, 16, pack, unpack, _bf16, "formats_float.c", is_float=True)
F32 = Format(WeightType.F32, 1, 4, 32, pack, unpack, _f32, "formats_float.c", is_float=True)
