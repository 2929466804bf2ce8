"""GGUF's weight formats read as stored (every format of ``decoding.runtime.formats``, a new one included: the K-quants
Q2_K to Q6_K; Q5_0, Q4_0, Q5_1; IQ4_NL, IQ4_XS, MXFP4; F16, BF16, F32; Q8_0 / Q4_1 have tests of their own in
test_kernels), against gguf-py as the oracle: the packed layout gives back the file's bytes and gguf-py's
``quants.dequantize`` bit for bit (in Python and in the kernels), the kernels' matmul equals the float product of the
dequantized weights and the same activations (quantized as the kernels quantize them, or fp32 for the float formats)
within fp32 rounding, a row alone equals the same row among 64 shuffled ones bit for bit on every ISA path this CPU
has (and every path gives the avx2 path's bits), a fused matrix of mixed formats computes each part in its own, and
tiny Llamas written as GGUFs of llama.cpp's mixes (Q4_K_M, Q5_K_M, IQ4_XS, Q2_K, an MXFP4 MLP, F16) load with those
types as stored, match transformers on the same weights and decode speculatively exactly as greedily; a type the
kernels lack is refused by name.

gguf-py quantizes Q4_0, Q5_0, Q5_1, MXFP4 and the float formats but not the K-quants or IQ4: their blocks here are
random bytes (every bit pattern the format has, scales and mins included, with finite fp16 fields) or made by the
small reference quantizers below, which only need to give sensible weights (gguf-py's dequantize is what every value
is checked against)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, LlamaForCausalLM

from decoding.errors import ModelFileError
from decoding.runtime import kernels
from decoding.runtime.formats import FORMATS as REGISTRY
from decoding.runtime.formats.iq4_nl import IQ4_VALUES
from decoding.runtime.formats.iq4_xs import iq4xs_pack_scales
from decoding.runtime.formats.q3_k import q3k_pack_scales
from decoding.runtime.formats.q4_k import q4k_pack_scales
from decoding.runtime.kernels import available_isas
from decoding.runtime.quant import QuantMatrix, WeightType, join_rows, quantize
from decoding.runtime.quantized import QuantizedModel
from decoding.runtime.weights import weights_from_gguf
from decoding.speculative.engine import Engine
from tests.decoding.conftest import (
    PROMPT,
    RandomTreeDrafter,
    TinyTarget,
    TinyTokenizer,
    fake_quantized_activations,
    gguf_writer,
    load_dequantized,
    permute,
    run,
)

OWN_TESTS = (WeightType.Q8_0, WeightType.Q4_1)  # made at load too: test_kernels tests them
FORMATS = [kind for kind in REGISTRY if kind not in OWN_TESTS]  # every other registered format, a new one too
BLOCKS = [kind for kind in FORMATS if not REGISTRY[kind].is_float]  # the quantized ones
FLOATS = frozenset(kind for kind, f in REGISTRY.items() if f.is_float)
GGML = {kind: GGMLQuantizationType[kind.name] for kind in REGISTRY}
HERE = [isa for isa in kernels.ISAS if isa in available_isas()]  # the paths this CPU runs


def block_weights(kind: WeightType) -> int:
    return REGISTRY[kind].block_weights


def block_bytes(kind: WeightType) -> int:
    return REGISTRY[kind].block_bytes


@pytest.fixture(scope="module")
def libraries() -> dict[str, object]:
    """Every ISA path this CPU runs, loaded from the usual kernel cache (built there once)."""
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    return {isa: kernels.library(isa) for isa in HERE}


def random_blocks(kind: WeightType, rows: int, cols: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """GGUF rows of random bytes (every bit pattern of the quants, scales and mins) with finite fp16 scales; for the
    float formats, random weights of about ``scale`` x 10 as the file stores them."""
    rng = np.random.default_rng(seed)
    if kind in FLOATS:
        w = (rng.standard_normal((rows, cols)) * scale * 10).astype(np.float32)
        return np.asarray(gguf.quants.quantize(w, GGML[kind])).view(np.uint8).reshape(rows, -1)
    nb = cols // block_weights(kind)
    raw = rng.integers(0, 256, (rows, nb, block_bytes(kind)), dtype=np.uint8)
    for off in REGISTRY[kind].fp16_fields:
        d = (rng.standard_normal((rows, nb)) * scale).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    for off in REGISTRY[kind].e8m0_fields:  # powers of two around scale / 10 (the values reach 12)
        raw[..., off] = rng.integers(118, 124, (rows, nb))
    return raw.reshape(rows, -1)


def quantize_q45_k(w: np.ndarray, fifth: bool = False) -> np.ndarray:
    """A simple Q4_K (``fifth``: Q5_K) quantizer (per sub-block min / max, 6-bit scales and mins per super-block):
    GGUF rows."""
    n, cols = w.shape
    levels = 31 if fifth else 15
    x = w.astype(np.float32).reshape(n, cols // 256, 8, 32)
    mn_f = np.maximum(-x.min(-1), 0.0)
    sc_f = (x.max(-1) + mn_f) / levels
    d = (sc_f.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mn_f.max(-1, keepdims=True) / 63).astype(np.float16)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(np.divide(sc_f, df, out=np.zeros_like(sc_f), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mn_f, dmf, out=np.zeros_like(mn_f), where=dmf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(x + (dmf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.rint(q), 0, levels).astype(np.uint8)  # [n, S, 8 sub-blocks, 32]
    low = (q & 0x0F).reshape(n, -1, 4, 2, 32)  # [n, S, 64-chunk, half, 32]
    qs = (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(n, -1, 128)
    fields = [d.view(np.uint8), dmin.view(np.uint8), q4k_pack_scales(sc, m)]
    if fifth:  # bit s of qh byte l: sub-block s's weight l
        fields.append(((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2).astype(np.uint8))
    return np.concatenate([*fields, qs], axis=-1).reshape(n, -1)


def _signed_sub_blocks(w: np.ndarray, reach: int, q_min: int, q_max: int,
                       sc_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K's and Q3_K's scheme: per 16 weights a signed integer scale (at most ``sc_max``) of the super-block's
    fp16 ``d``, the sub-block's largest |w| at q = ``reach``, q in ``q_min..q_max``. Returns d [n, S, 1] (fp16),
    the scales [n, S, 16] (int8) and q [n, S, 16, 16] (float, whole numbers)."""
    n, cols = w.shape
    x = w.astype(np.float32).reshape(n, cols // 256, 16, 16)
    sub = np.abs(x).max(-1) / reach
    d = (sub.max(-1, keepdims=True) / sc_max).astype(np.float16)
    df = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(sub, df, out=np.zeros_like(sub), where=df > 0)), -sc_max - 1, sc_max)
    step = (df * sc.astype(np.int8))[..., None]
    q = np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), q_min, q_max)
    return d, sc.astype(np.int8), q


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A simple Q6_K quantizer (per 16 an int8 scale of d, q in -32..31): GGUF rows."""
    n = w.shape[0]
    d, sc, q = _signed_sub_blocks(w, 31, -32, 31, 127)
    q = (q + 32).astype(np.uint8).reshape(n, -1, 2, 4, 32)  # [n, S, half, quarter, 32]: weight 128h + 32r + l
    ql = ((q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)).reshape(n, -1, 128)
    qh = sum(((q[:, :, :, r] >> 4) << (2 * r)) for r in range(4)).astype(np.uint8).reshape(n, -1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=-1)
    return blocks.reshape(n, -1)


def _iq4_nearest(y: np.ndarray) -> np.ndarray:
    """The index of the IQ4 value nearest each of ``y`` (in units of the block's scale)."""
    return np.abs(y[..., None] - IQ4_VALUES.astype(np.float32)).argmin(-1).astype(np.uint8)


def _iq4_nibbles(q: np.ndarray) -> np.ndarray:
    """Indices ``[..., 32]`` -> 16 bytes: weight t in the low nibble of byte t, weight 16 + t in its high nibble."""
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """A simple IQ4_NL quantizer (the block's largest magnitude on the table's end): GGUF rows."""
    n, cols = w.shape
    x = w.astype(np.float32).reshape(n, cols // 32, 32)
    d = (np.abs(x).max(-1, keepdims=True) / 127).astype(np.float16)
    df = d.astype(np.float32)
    q = _iq4_nearest(np.divide(x, df, out=np.zeros_like(x), where=df > 0))
    return np.concatenate([d.view(np.uint8), _iq4_nibbles(q)], axis=-1).reshape(n, -1)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """A simple IQ4_XS quantizer (a 6-bit scale per 32 of a super-block's d): GGUF rows."""
    n, cols = w.shape
    x = w.astype(np.float32).reshape(n, cols // 256, 8, 32)
    sub = np.abs(x).max(-1) / 127  # each sub-block's own step
    d = (sub.max(-1, keepdims=True) / 31).astype(np.float16)
    df = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(sub, df, out=np.zeros_like(sub), where=df > 0)), -32, 31).astype(np.int8)
    step = (df * sc)[..., None]
    q = _iq4_nearest(np.divide(x, step, out=np.zeros_like(x), where=step > 0))
    blocks = np.concatenate([d.view(np.uint8), iq4xs_pack_scales(sc), _iq4_nibbles(q).reshape(n, -1, 128)], axis=-1)
    return blocks.reshape(n, -1)


def _two_bit_bytes(q: np.ndarray) -> np.ndarray:
    """2-bit quants ``[n, S, 256]`` -> Q2_K's / Q3_K's 64 bytes ``[n, S, 64]`` (in each 128 weights, byte l: weights
    l, 32 + l, 64 + l, 96 + l in bits 0-1, 2-3, 4-5, 6-7)."""
    n = q.shape[0]
    parts = q.reshape(n, -1, 2, 4, 32)
    return sum(parts[:, :, :, j] << (2 * j) for j in range(4)).astype(np.uint8).reshape(n, -1, 64)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """A simple Q2_K quantizer (per 16 min / max, 4-bit scales and mins of a super-block's d, dmin): GGUF rows."""
    n, cols = w.shape
    x = w.astype(np.float32).reshape(n, cols // 256, 16, 16)
    mn_f = np.maximum(-x.min(-1), 0.0)
    sc_f = (x.max(-1) + mn_f) / 3
    d = (sc_f.max(-1, keepdims=True) / 15).astype(np.float16)
    dmin = (mn_f.max(-1, keepdims=True) / 15).astype(np.float16)
    df, dmf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(np.divide(sc_f, df, out=np.zeros_like(sc_f), where=df > 0)), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mn_f, dmf, out=np.zeros_like(mn_f), where=dmf > 0)), 0, 15).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(x + (dmf * m)[..., None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.rint(q), 0, 3).astype(np.uint8).reshape(n, -1, 256)
    blocks = np.concatenate([sc | (m << 4), _two_bit_bytes(q), d.view(np.uint8), dmin.view(np.uint8)], axis=-1)
    return blocks.reshape(n, -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """A simple Q3_K quantizer (per 16 a 6-bit signed scale of a super-block's d, q in -4..3): GGUF rows."""
    n = w.shape[0]
    d, sc, q = _signed_sub_blocks(w, 4, -4, 3, 31)
    q = q.astype(np.int8).reshape(n, -1, 256)
    high = (q >= 0).astype(np.uint8)  # the bit set: no offset; clear: q = low bits - 4
    low = (q + 4 * (1 - high.astype(np.int8))).astype(np.uint8)
    hmask = sum(high.reshape(n, -1, 8, 32)[:, :, b] << b for b in range(8)).astype(np.uint8)
    blocks = np.concatenate([hmask, _two_bit_bytes(low), q3k_pack_scales(sc), d.view(np.uint8)], axis=-1)
    return blocks.reshape(n, -1)


TEST_QUANTIZERS = {WeightType.Q4_K: quantize_q45_k, WeightType.Q5_K: lambda w: quantize_q45_k(w, fifth=True),
                   WeightType.Q6_K: quantize_q6_k, WeightType.IQ4_NL: quantize_iq4_nl,
                   WeightType.IQ4_XS: quantize_iq4_xs, WeightType.Q2_K: quantize_q2_k, WeightType.Q3_K: quantize_q3_k}


def to_blocks(w: np.ndarray, kind: WeightType) -> np.ndarray:
    """GGUF rows ``[n, bytes]`` of ``w`` in ``kind`` (gguf-py's quantizer where it has one)."""
    if kind in TEST_QUANTIZERS:
        return TEST_QUANTIZERS[kind](w)
    out = np.asarray(gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), GGML[kind]))
    return out.view(np.uint8).reshape(w.shape[0], -1)


def oracle(raw: np.ndarray, kind: WeightType, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, GGML[kind]), dtype=np.float32).reshape(-1, cols))


# ---- the formats, against gguf-py -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 8, 13, 40])
def test_packing_gives_back_the_file_bytes_and_gguf_dequantize_bit_for_bit(kind: WeightType, rows: int) -> None:
    cols = 512
    raw = random_blocks(kind, rows, cols, seed=rows)
    qm = QuantMatrix.from_rows(kind, raw, cols)
    assert np.array_equal(qm.row_data(), raw)
    assert torch.equal(qm.dequantize(), oracle(raw, kind, cols))
    order = np.random.default_rng(1).permutation(rows)
    assert np.array_equal(qm.select_rows(order).row_data(), raw[order])


@pytest.mark.parametrize("kind", FORMATS)
def test_packing_a_chunk_at_a_time_gives_the_whole_tensors_layout(kind: WeightType, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """A large tensor is packed a chunk of groups at a time (the load's peak memory): chunks of one group, of three
    (the last one short, its rows padded), and the whole tensor at once lay out the same bytes, and each chunk's
    source rows are reported packed once, in order (a GGUF load drops their file pages then)."""
    import decoding.runtime.quant as quant

    cols, rows = 512, 45
    raw = random_blocks(kind, rows, cols, seed=7)
    width = raw.shape[1]
    layouts = []
    for chunk in (1, 3 * 8 * width, 1 << 40):
        monkeypatch.setattr(quant, "PACK_CHUNK_BYTES", chunk)
        done: list[tuple[int, int]] = []
        layouts.append(quant.pack_rows(kind, raw, lambda r0, r1: done.append((r0, r1))))  # noqa: B023
        ends = [0] + [r1 for _, r1 in done]
        assert [r0 for r0, _ in done] == ends[:-1] and ends[-1] == rows
    assert all(np.array_equal(layouts[-1], other) for other in layouts[:-1])
    assert np.array_equal(quant.unpack_rows(kind, layouts[0], rows, cols), raw)


@pytest.mark.parametrize("kind", FORMATS)
def test_the_kernels_dequantize_as_gguf_does(libraries: dict[str, object], kind: WeightType) -> None:
    raw = random_blocks(kind, 21, 768, seed=5)
    qm = QuantMatrix.from_rows(kind, raw, 768)
    rows = torch.tensor([20, 0, 7, 8, 8, 15])
    want = oracle(raw, kind, 768)[rows]
    for isa, lib in libraries.items():
        assert torch.equal(kernels.dequant_rows(lib, qm, rows), want), isa  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", FORMATS)
def test_served_bytes_stay_within_1_05x_of_the_file(kind: WeightType) -> None:
    """Whole groups of 8 rows: the packed weights are the file's bytes (the K-quants' and IQ4_XS's scales
    unpacked)."""
    raw = random_blocks(kind, 64, 2048, seed=3)
    ratio = QuantMatrix.from_rows(kind, raw, 2048).nbytes / raw.nbytes
    assert ratio == REGISTRY[kind].record_bytes / (8 * block_bytes(kind))
    assert ratio <= 1.05


def test_the_test_quantizers_make_close_weights() -> None:
    """The reference quantizers above: within a step of the weights (what gguf-py dequantizes them to)."""
    w = np.random.default_rng(2).standard_normal((16, 512)).astype(np.float32)
    for kind, tol in ((WeightType.Q4_K, 0.25), (WeightType.Q5_K, 0.12), (WeightType.Q6_K, 0.07),
                      (WeightType.Q5_0, 0.15), (WeightType.IQ4_NL, 0.25), (WeightType.IQ4_XS, 0.25),
                      (WeightType.Q2_K, 0.6), (WeightType.Q3_K, 0.4)):
        back = oracle(to_blocks(w, kind), kind, 512).numpy()
        assert np.abs(back - w).max() < tol * np.abs(w).max(), kind


def test_k_quants_need_whole_super_blocks_and_are_not_made_from_floats() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantMatrix.from_rows(WeightType.Q4_K, np.zeros((2, 72), dtype=np.uint8), 128)
    with pytest.raises(ValueError, match="Q6_K rows must be uint8"):
        QuantMatrix.from_rows(WeightType.Q6_K, np.zeros((2, 200), dtype=np.uint8), 256)
    with pytest.raises(ValueError, match="Q8_0, Q4_1 or F32"):
        quantize(torch.randn(4, 256), WeightType.Q4_K)


# ---- the kernels' matmul ------------------------------------------------------------------------------------------


def _reference(x: torch.Tensor, qm: QuantMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 product of the activations as the kernels read them (quantized, or fp32 for the float formats) and the
    weights as gguf-py dequantizes them, and the fp64 sum of |products| per output (the scale of fp32 rounding)."""
    xq = (x if qm.kinds <= FLOATS else fake_quantized_activations(x)).double()
    w = qm.dequantize().double()
    return xq @ w.T, xq.abs() @ w.abs().T


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 256, 8), (3, 512, 37), (5, 768, 130), (17, 256, 64), (64, 512, 24)])
def test_matmul_equals_the_float_product_within_fp32_rounding(
    libraries: dict[str, object], kind: WeightType, m: int, k: int, n: int
) -> None:
    """|kernel - exact| <= 1e-6 x sum |w x| per output: the integer block sums are exact, what remains is one fp32
    rounding per block and per sum step (observed: at most ~4e-8)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    qm = QuantMatrix.from_rows(kind, random_blocks(kind, n, k, seed=m + n), k)
    x, bias, res = torch.randn(m, k, generator=g) * 2, torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    want, scale = _reference(x, qm)
    for isa, lib in libraries.items():
        got = kernels.qlinear(lib, x, qm, bias, res)  # type: ignore[arg-type]
        err = (got.double() - (want + bias.double() + res.double())).abs()
        assert bool((err <= 1e-6 * scale + 1e-6).all()), (isa, float((err / scale).max()))
        plain = kernels.qlinear(lib, x, qm)  # type: ignore[arg-type]
        assert bool(((plain.double() - want).abs() <= 1e-6 * scale + 1e-6).all()), isa


@pytest.mark.parametrize("kind", BLOCKS)
def test_extreme_blocks_stay_exact(libraries: dict[str, object], kind: WeightType) -> None:
    """Every quant at its largest (all bits set; IQ4: also its most negative value, -127, on half the rows) against
    activations at +-127: the widest integer sums the kernels form (AVX2's int16 lanes at their bound) come out
    exact."""
    rows, cols = 16, 512
    raw = np.full((rows, cols // block_weights(kind) * block_bytes(kind)), 0xFF, dtype=np.uint8)
    nb = cols // block_weights(kind)
    blocks = raw.reshape(rows, nb, -1)
    for off in REGISTRY[kind].fp16_fields:
        blocks[..., off : off + 2] = np.full((rows, nb), 0.001, dtype=np.float16).view(np.uint8).reshape(rows, nb, 2)
    for off in REGISTRY[kind].e8m0_fields:
        blocks[..., off] = 118  # 2^-10
    if kind == WeightType.MXFP4:
        blocks[::2, :, 1:] = 0x77  # value 12 on half the rows (-12, all bits set, on the others)
    if kind == WeightType.Q6_K:
        blocks[::2, :, 192:208] = 0x80  # int8 scales of -128 on half the rows, -1 on the others
    if kind in (WeightType.IQ4_NL, WeightType.IQ4_XS):
        blocks[::2, :, block_bytes(kind) - block_weights(kind) // 2 :] = 0x00  # index 0: -127
    if kind == WeightType.Q3_K:
        blocks[::2, :, :96] = 0x00  # q = -4 on half the rows (high bits clear, low bits 0)
        blocks[1::4, :, 96:108] = 0x00  # and scales of -32 on a quarter
    qm = QuantMatrix.from_rows(kind, raw, cols)
    x = torch.ones(3, cols)
    x[1] = -1.0
    x[2, 1::2] = -1.0  # +-127 after quantization
    want, scale = _reference(x, qm)
    for isa, lib in libraries.items():
        got = kernels.qlinear(lib, x, qm)  # type: ignore[arg-type]
        assert bool(((got.double() - want).abs() <= 1e-6 * scale).all()), isa


@pytest.mark.parametrize("kind", FORMATS)
def test_rows_alone_equal_rows_among_64_shuffled_on_every_path(libraries: dict[str, object], kind: WeightType) -> None:
    """Batch invariance bit for bit: 64 rows in one call, the same rows shuffled, some alone, at 1 and 2 threads,
    with bias and residual, on a matrix whose 200 rows fill neither a pair of groups nor a task; every path gives
    the avx2 path's bits."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 512, generator=g) * 3
    qm = QuantMatrix.from_rows(kind, random_blocks(kind, 200, 512, seed=9), 512)
    bias, res = torch.randn(200, generator=g), torch.randn(64, 200, generator=g)
    perm = torch.randperm(64, generator=g)
    before = torch.get_num_threads()
    outputs = {}
    try:
        for isa, lib in libraries.items():
            torch.set_num_threads(2)
            whole = kernels.qlinear(lib, x, qm, bias, res)  # type: ignore[arg-type]
            assert torch.equal(kernels.qlinear(lib, x[perm], qm, bias, res[perm]), whole[perm]), isa  # type: ignore[arg-type]
            for i in (0, 1, 17, 62, 63):
                alone = kernels.qlinear(lib, x[i : i + 1], qm, bias, res[i : i + 1])  # type: ignore[arg-type]
                assert torch.equal(alone, whole[i : i + 1]), (isa, i)
            for m in (2, 3, 4, 5, 7, 8, 9, 13, 17):  # every tile size, remainder and split into even tiles
                assert torch.equal(kernels.qlinear(lib, x[:m], qm, bias, res[:m]), whole[:m]), (isa, m)  # type: ignore[arg-type]
            torch.set_num_threads(1)
            assert torch.equal(kernels.qlinear(lib, x, qm, bias, res), whole), isa  # type: ignore[arg-type]
            outputs[isa] = whole
    finally:
        torch.set_num_threads(before)
    for isa, whole in outputs.items():
        assert torch.equal(whole, outputs["avx2"]), f"{isa} differs from avx2"


@pytest.mark.parametrize("kind", [k for k in REGISTRY if k not in FLOATS])
def test_pairs_of_groups_and_groups_alone_give_the_same_bits(libraries: dict[str, object], kind: WeightType) -> None:
    """The two kernels the pair table chooses between (formats.h; measured per CPU at calibration) at every row count
    it keys and beyond, on a matrix whose 200 rows end in a lone group: all pairs, no pairs and the library's start
    table give the same bits, and so does the avx2 path (which has no pairs: its table is empty)."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(20, 512, generator=g) * 3
    qm = QuantMatrix.from_rows(kind, random_blocks(kind, 200, 512, seed=5), 512)
    bias, res = torch.randn(200, generator=g), torch.randn(20, 200, generator=g)
    assert kernels.pair_table(libraries["avx2"]) == []  # type: ignore[arg-type]
    tables = [lib for isa, lib in libraries.items() if isa != "avx2"]
    if not tables:
        pytest.skip("no AVX-512 path on this CPU: no pairs of groups to choose")
    for m in range(1, 21):
        want = kernels.qlinear(libraries["avx2"], x[:m], qm, bias, res[:m])  # type: ignore[arg-type]
        for lib in tables:
            start = kernels.pair_table(lib)  # type: ignore[arg-type]
            assert len(start) == 18 and start[5] and not start[1]  # the library's own: pairs from 5 rows
            try:
                for pairs in (True, False):
                    assert kernels.pair_table(lib, [pairs] * len(start))[1:] == [pairs] * (len(start) - 1)  # type: ignore[arg-type]
                    assert torch.equal(kernels.qlinear(lib, x[:m], qm, bias, res[:m]), want), (kind, m, pairs)  # type: ignore[arg-type]
            finally:
                kernels.pair_table(lib, start)  # type: ignore[arg-type]


def test_a_matrix_of_mixed_formats_computes_each_part_in_its_own(libraries: dict[str, object]) -> None:
    """q / k / v of three formats (and a Q8_0 part): one call equals each part alone, bit for bit, bias and
    residual included; its bytes are its parts'; neighbours of one format are stacked into one part."""
    g = torch.Generator().manual_seed(4)
    k = 512
    parts = [QuantMatrix.from_rows(kind, random_blocks(kind, n, k, seed=n), k)
             for kind, n in ((WeightType.Q4_K, 20), (WeightType.Q4_K, 12), (WeightType.Q6_K, 13),
                             (WeightType.Q8_0, 8), (WeightType.Q5_0, 3))]
    parts += [QuantMatrix.from_rows(kind, random_blocks(kind, 5, k, seed=21), k)
              for kind in (WeightType.F16, WeightType.IQ4_XS)]  # a float part reads the fp32 activations
    joined = join_rows(parts)
    assert joined.kind == WeightType.PARTS and joined.rows == 66
    assert [p.kind for p in joined.parts] == [WeightType.Q4_K, WeightType.Q6_K, WeightType.Q8_0, WeightType.Q5_0,
                                              WeightType.F16, WeightType.IQ4_XS]
    assert joined.nbytes == sum(p.nbytes for p in joined.parts)
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert join_rows(parts[:2]).kind == WeightType.Q4_K  # one format: one plain matrix
    x, bias, res = torch.randn(9, k, generator=g), torch.randn(66, generator=g), torch.randn(9, 66, generator=g)
    for isa, lib in libraries.items():
        got = kernels.qlinear(lib, x, joined, bias, res)  # type: ignore[arg-type]
        want, at = [], 0
        for p in joined.parts:
            want.append(kernels.qlinear(lib, x, p, bias[at : at + p.rows], res[:, at : at + p.rows]))  # type: ignore[arg-type]
            at += p.rows
        assert torch.equal(got, torch.cat(want, dim=1)), isa


# ---- tiny Llamas stored in llama.cpp's mixes -------------------------------------------------------------------

W = WeightType
Layout = dict[str, WeightType | tuple[WeightType, WeightType]]
# per tensor the GGUF type (a tuple: per layer), as llama.cpp's mixes hold them: a Q4_K_M puts Q6_K on v and down in
# one layer of two and on the output, and Q5_0 where rows are not whole super-blocks (here in layer 1's o and up);
# a Q5_K_M the same with Q5_K / Q5_1 (and Q8_0 for Q6_K); an IQ4_XS falls back on IQ4_NL (and Q4_0 here); an F16 /
# BF16 file may hold F32 tensors too; a Q2_K file keeps Q3_K / Q4_K on the tensors that matter most (here also the
# embedding and the gate: rows of so few levels put activations exactly halfway between two int8 steps, where the
# reference's rounding of a last bit picks the other step). Each mix: its layout and the runtime tag it loads as.
LAYOUTS: dict[str, tuple[Layout, str]] = {
    "Q4_K_M": ({"token_embd": W.Q4_K, "output": W.Q6_K, "attn_q": W.Q4_K, "attn_k": W.Q4_K,
                "attn_v": (W.Q6_K, W.Q4_K), "attn_output": (W.Q4_K, W.Q5_0), "ffn_gate": W.Q4_K,
                "ffn_up": (W.Q4_K, W.Q5_0), "ffn_down": (W.Q4_K, W.Q6_K)}, "Q4_K+Q5_0+Q6_K"),
    "Q5_K_M": ({"token_embd": W.Q5_K, "output": W.Q6_K, "attn_q": W.Q5_K, "attn_k": W.Q5_K,
                "attn_v": (W.Q6_K, W.Q5_K), "attn_output": (W.Q5_K, W.Q5_1), "ffn_gate": W.Q5_K,
                "ffn_up": (W.Q5_K, W.Q5_1), "ffn_down": (W.Q6_K, W.Q8_0)}, "Q5_1+Q5_K+Q6_K+Q8_0"),
    "IQ4_XS": ({"token_embd": W.IQ4_XS, "output": W.Q6_K, "attn_q": W.IQ4_XS, "attn_k": W.IQ4_XS,
                "attn_v": (W.IQ4_NL, W.IQ4_XS), "attn_output": (W.IQ4_XS, W.Q4_0), "ffn_gate": W.IQ4_XS,
                "ffn_up": (W.IQ4_XS, W.IQ4_NL), "ffn_down": (W.Q4_0, W.IQ4_XS)}, "IQ4_NL+IQ4_XS+Q4_0+Q6_K"),
    "Q2_K": ({"token_embd": W.Q4_K, "output": W.Q6_K, "attn_q": W.Q2_K, "attn_k": W.Q2_K,
              "attn_v": (W.Q4_K, W.Q3_K), "attn_output": (W.Q3_K, W.Q5_0), "ffn_gate": W.Q3_K,
              "ffn_up": (W.Q2_K, W.Q5_0), "ffn_down": (W.Q3_K, W.Q4_K)}, "Q2_K+Q3_K+Q4_K+Q5_0+Q6_K"),
    "MXFP4": ({"token_embd": W.Q8_0, "output": W.Q6_K, "attn_q": W.Q8_0, "attn_k": W.Q8_0, "attn_v": W.Q8_0,
               "attn_output": W.Q8_0, "ffn_gate": W.MXFP4, "ffn_up": W.MXFP4, "ffn_down": (W.MXFP4, W.Q8_0)},
              "MXFP4+Q6_K+Q8_0"),
    "F16": ({"token_embd": W.F16, "output": W.BF16, "attn_q": W.F16, "attn_k": W.BF16, "attn_v": W.F32,
             "attn_output": (W.F16, W.BF16), "ffn_gate": W.F16, "ffn_up": (W.F16, W.F32), "ffn_down": W.BF16},
            "BF16+F16+F32"),
}


def _kind(layout: Layout, name: str, layer: int) -> WeightType:
    kind = layout[name]
    return kind[layer % 2] if isinstance(kind, tuple) else kind


def _runs(kinds: list[WeightType]) -> list[WeightType]:
    """The formats of a fused matrix's parts: neighbours of one format are one part."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def write_kquant_gguf(path: Path, hf: torch.nn.Module, layout: Layout) -> dict[str, tuple[np.ndarray, WeightType]]:
    """The tiny Llama as a GGUF of ``layout``'s types (q / k rows permuted as llama.cpp's converter does); the blocks
    written."""
    c = hf.config
    w = gguf_writer(path, c)
    written: dict[str, tuple[np.ndarray, WeightType]] = {}

    def put(name: str, a: np.ndarray, kind: WeightType | None) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if kind is None:
            w.add_tensor(name, a)
            return
        blocks = to_blocks(a, kind)
        written[name] = (blocks, kind)
        w.add_tensor(name, blocks, raw_dtype=GGML[kind])

    put("token_embd.weight", hf.model.embed_tokens.weight.detach().numpy(), _kind(layout, "token_embd", 0))
    for i, layer in enumerate(hf.model.layers):
        at, mlp, b = layer.self_attn, layer.mlp, f"blk.{i}."
        put(b + "attn_norm.weight", layer.input_layernorm.weight.detach().numpy(), None)
        put(b + "ffn_norm.weight", layer.post_attention_layernorm.weight.detach().numpy(), None)
        put(b + "attn_q.weight", permute(at.q_proj.weight, c.num_attention_heads), _kind(layout, "attn_q", i))
        put(b + "attn_k.weight", permute(at.k_proj.weight, c.num_key_value_heads), _kind(layout, "attn_k", i))
        put(b + "attn_v.weight", at.v_proj.weight.detach().numpy(), _kind(layout, "attn_v", i))
        put(b + "attn_output.weight", at.o_proj.weight.detach().numpy(), _kind(layout, "attn_output", i))
        put(b + "ffn_gate.weight", mlp.gate_proj.weight.detach().numpy(), _kind(layout, "ffn_gate", i))
        put(b + "ffn_up.weight", mlp.up_proj.weight.detach().numpy(), _kind(layout, "ffn_up", i))
        put(b + "ffn_down.weight", mlp.down_proj.weight.detach().numpy(), _kind(layout, "ffn_down", i))
    put("output_norm.weight", hf.model.norm.weight.detach().numpy(), None)
    put("output.weight", hf.lm_head.weight.detach().numpy(), _kind(layout, "output", 0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def tiny_kquant_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random Llama whose rows are whole K-quant super-blocks: hidden 256, ffn 512, 4 heads of 64 on 2 KV heads."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # 4x transformers' init: a greedy path that wanders instead of repeating one token
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(scope="module", params=list(LAYOUTS))
def kquant_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Llama written as a GGUF of one of llama.cpp's mixes: (path, the HF model, the blocks, the layout, the
    runtime tag's formats)."""
    layout, tag = LAYOUTS[request.param]
    path = tmp_path_factory.mktemp("formats") / f"tiny-{request.param.lower()}.gguf"
    hf = tiny_kquant_llama(7)
    written = write_kquant_gguf(path, hf, layout)
    return path, hf, written, layout, tag


def test_a_gguf_loads_with_its_types_as_stored(kquant_file: Any) -> None:
    """Every tensor in the type the file gives it (a mixed q/k/v or gate/up: a parts matrix of its types), the rows
    gguf-py dequantizes (q / k un-permuted), the runtime tag naming the formats held, the served bytes within
    1.05x of the file's tensor bytes."""
    path, _, written, layout, tag = kquant_file
    weights = weights_from_gguf(path)
    assert weights.source == f"gguf:{tag}"
    c = weights.config
    h, g, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def dense(name: str, heads: int = 0) -> torch.Tensor:
        raw, kind = written[name]
        rows = oracle(raw, kind, int(raw.shape[1]) // block_bytes(kind) * block_weights(kind))
        if heads:
            rows = rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(rows.shape)
        return rows

    for i, lw in enumerate(weights.layers):
        b = f"blk.{i}."
        qkv = torch.cat([dense(b + "attn_q.weight", h), dense(b + "attn_k.weight", g), dense(b + "attn_v.weight")])
        assert torch.equal(lw.qkv.dequantize(), qkv) and lw.qkv.rows == (h + 2 * g) * d
        gu = torch.cat([dense(b + "ffn_gate.weight"), dense(b + "ffn_up.weight")])
        assert torch.equal(lw.gate_up.dequantize(), gu)
        for fused, names in ((lw.qkv, ("attn_q", "attn_k", "attn_v")), (lw.gate_up, ("ffn_gate", "ffn_up"))):
            kinds = _runs([_kind(layout, name, i) for name in names])  # e.g. a Q6_K v beside Q4_K q / k: two parts
            assert [p.kind for p in fused.parts] == kinds if len(kinds) > 1 else fused.kind == kinds[0]
        assert lw.o.kind == _kind(layout, "attn_output", i) and lw.down.kind == _kind(layout, "ffn_down", i)
        assert torch.equal(lw.o.dequantize(), dense(b + "attn_output.weight"))
        assert torch.equal(lw.down.dequantize(), dense(b + "ffn_down.weight"))
    assert weights.embed.kind == layout["token_embd"] and weights.head.kind == layout["output"]
    assert torch.equal(weights.head.dequantize(), dense("output.weight"))
    file_bytes = sum(raw.nbytes for raw, _ in written.values())
    norms = 4 * c.hidden_size * (2 * c.num_hidden_layers + 1)
    assert weights.nbytes - norms <= 1.05 * file_bytes


def test_a_type_the_kernels_lack_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """An IQ3_XXS tensor (no kernel reads it): one ModelFileError naming the file, the tensor, its type and the types
    read; nothing is requantized behind the user's back."""
    layout: Layout = {**LAYOUTS["Q4_K_M"][0], "ffn_down": (W.Q4_K, W.Q6_K)}
    path = tmp_path / "tiny-iq3_xxs.gguf"
    hf = tiny_kquant_llama(3)
    write_kquant_gguf(path, hf, layout)
    reader = gguf.GGUFReader(str(path))
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert down.tensor_type == GGMLQuantizationType.Q6_K  # rewrite its type in the header: IQ3_XXS blocks, 98 bytes
    raw = bytearray(path.read_bytes())
    # the tensor infos follow the metadata: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    name = b"blk.1.ffn_down.weight"
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    at += 4 + 8 * int.from_bytes(raw[at : at + 4], "little")
    assert int.from_bytes(raw[at : at + 4], "little") == int(GGMLQuantizationType.Q6_K)
    raw[at : at + 4] = int(GGMLQuantizationType.IQ3_XXS).to_bytes(4, "little")  # 98 bytes < Q6_K's 210: fits
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError) as caught:
        weights_from_gguf(path)
    message = str(caught.value)
    assert "blk.1.ffn_down.weight is IQ3_XXS" in message and "tiny-iq3_xxs.gguf" in message and "\n" not in message
    assert "Q4_K" in message and "IQ4_XS" in message  # the types it reads


def test_speculative_greedy_equals_plain_greedy_on_every_path(
    libraries: dict[str, object], kquant_file: Any
) -> None:
    """Each mix end to end (fp16 KV): speculative decoding gives the plain greedy tokens on each path, and every
    path the avx2 path's tokens and logits bit for bit."""
    path, _, _, _, tag = kquant_file
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tokens, logits = {}, {}
    try:
        for isa, lib in libraries.items():
            model = QuantizedModel(weights_from_gguf(path), torch.float16)
            assert model.runtime_tag == f"cpu-quantized:gguf:{tag}/kv-float16"
            model.lib = lib  # type: ignore[assignment]
            engine = Engine(TinyTarget(model, TinyTokenizer(), f"tiny-kquant-{isa}", torch.device("cpu"), (), 512))
            plain = run(engine, PROMPT, 40, [], None).token_ids
            assert len(set(plain)) > 10  # not a degenerate repetition
            assert run(engine, PROMPT, 40, [RandomTreeDrafter(plain, seed=1)], 16).token_ids == plain, isa
            tokens[isa] = plain
            with torch.inference_mode():
                logits[isa] = model(torch.tensor([PROMPT.ids])).logits
    finally:
        torch.set_num_threads(before)
    for isa in libraries:
        assert tokens[isa] == tokens["avx2"] and torch.equal(logits[isa], logits["avx2"]), isa


def test_the_forward_matches_transformers_on_the_dequantized_weights(kquant_file: Any) -> None:
    """transformers' Llama on the weights gguf-py dequantizes, every quantized linear layer's input quantized as the
    kernels quantize it (the float formats read fp32 inputs): what the runtime computes, up to fp32 summation
    order. That order moves an activation across a rounding boundary of its int8 quantization now and then (that
    position's logits then move by up to a few percent of their spread, and the later ones reading it too when it
    was in a cached key or value): the median position agrees to 1e-5 of the spread (observed ~1e-6), a long sequence
    loosely."""
    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable on this machine")
    path, hf, _, layout, _ = kquant_file
    weights = weights_from_gguf(path)
    ours = QuantizedModel(weights, torch.float32)
    load_dequantized(hf, weights)
    linears = [(hf.lm_head, _kind(layout, "output", 0))]
    for i, layer in enumerate(hf.model.layers):
        at, mlp = layer.self_attn, layer.mlp
        linears += [(at.q_proj, _kind(layout, "attn_q", i)), (at.k_proj, _kind(layout, "attn_k", i)),
                    (at.v_proj, _kind(layout, "attn_v", i)), (at.o_proj, _kind(layout, "attn_output", i)),
                    (mlp.gate_proj, _kind(layout, "ffn_gate", i)), (mlp.up_proj, _kind(layout, "ffn_up", i)),
                    (mlp.down_proj, _kind(layout, "ffn_down", i))]
    hooks = [m.register_forward_pre_hook(lambda _m, args: (fake_quantized_activations(args[0]),))
             for m, kind in linears if kind not in FLOATS]
    g = torch.Generator().manual_seed(4)
    try:
        with torch.inference_mode():
            per_position = []
            for _ in range(8):
                ids = torch.randint(0, 97, (1, 16), generator=g)
                want = hf(ids).logits[0]
                per_position.append((ours(ids).logits[0] - want).abs().amax(-1) / want.std())
            ids = torch.randint(0, 97, (1, 150), generator=g)
            want = hf(ids).logits[0]
            got = ours(ids).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    assert float(torch.cat(per_position).median()) < 1e-5
    diff, scale = (got - want).abs(), want.std()
    assert diff.mean() < 1e-2 * scale and diff.max() < 1e-1 * scale  # a flip: ~2-6% at the positions reading it
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.97
