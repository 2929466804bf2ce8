"""The Python side of the C entry points: ``linear`` (fp32), ``qlinear`` and ``dequant_rows`` (quantized weights),
``attention`` and its workspace, and what a KV cache's storage means to the kernels (``kv_mode``,
``default_kv_dtype``, ``kv_row_width``). Each takes the library to call (``load``, ``library``)."""

from __future__ import annotations

import ctypes
import threading

import torch

from decoding.runtime.kernels.abi import call
from decoding.runtime.quant import QuantMatrix

MAX_ROWS = 96  # forwards over more tokens (prefill chunks) use torch's kernels: BLAS is good at large M
TILE_ROWS = 16  # the AMX path reads quantized activations a whole tile of rows at a time


def tile_rows(rows: int) -> int:
    """Rows the quantized-activation scratch needs for ``rows`` rows (whole tiles; the rest never read back)."""
    return -(-rows // TILE_ROWS) * TILE_ROWS


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 CPU tensors (weight and bias contiguous)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    n = weight.shape[0]
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    call(lib, "rs_linear_f32", x=_ptr(rows), M=rows.shape[0], K=k, w=_ptr(weight), N=n, bias=_ptr(bias), y=_ptr(y),
         threads=torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def qlinear(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # fp32 [..., K]
    weight: QuantMatrix,  # [N, K]
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,  # [..., N]: added to the result
) -> torch.Tensor:
    """``residual + x @ dequant(weight).T + bias`` with the activations quantized per row and 32-block."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    m, n = rows.shape[0], weight.rows
    y = torch.empty(m, n, dtype=torch.float32)
    res = None if residual is None else residual.reshape(m, n).contiguous()
    xq = torch.empty(tile_rows(m) * k, dtype=torch.int8)
    scales = torch.empty(2, m * k // 32, dtype=torch.float32)
    call(lib, "rs_qlinear", x=_ptr(rows), M=m, K=k, w=_ptr(weight.data), wtype=int(weight.kind),
         ldg=weight.group_bytes, N=n, bias=_ptr(bias), res=_ptr(res), y=_ptr(y), xq=_ptr(xq), xd=_ptr(scales[0]),
         xs=_ptr(scales[1]), threads=torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def dequant_rows(lib: ctypes.CDLL, weight: QuantMatrix, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``[len(rows), K]``: the given rows of ``weight`` (e.g. token embeddings) dequantized."""
    idx = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), weight.cols, dtype=torch.float32)
    call(lib, "rs_dequant_rows", w=_ptr(weight.data), wtype=int(weight.kind), ldg=weight.group_bytes, K=weight.cols,
         rows=_ptr(idx), R=idx.numel(), out=_ptr(out), threads=torch.get_num_threads())
    return out


KV_MODES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2, torch.bfloat16: 3}  # how the kernels read a cached row


def pair_table(lib: ctypes.CDLL, pairs: list[bool] | None = None) -> list[bool]:
    """The library's choice between pairs of weight groups and one group at a time by a matrix product's rows
    (formats.h): entry ``m`` for ``m`` rows, the last for that many or more (entry 0 unused); set to ``pairs`` first
    where given. Empty where the library has no pairs of groups (the choice does not exist). The two give the same
    bits, so setting it never changes a result."""
    n = int(lib.rs_pair_table(None, None))
    if not n:
        return []
    if pairs is not None:
        if len(pairs) != n:
            raise ValueError(f"the pair table has {n} entries, not {len(pairs)}")
        wanted = (ctypes.c_uint8 * n)(*(int(bool(p)) for p in pairs))
        lib.rs_pair_table(ctypes.addressof(wanted), None)
    got = (ctypes.c_uint8 * n)()
    lib.rs_pair_table(None, ctypes.addressof(got))
    return [bool(v) for v in got]


def kv_mode(dtype: torch.dtype) -> int:
    """The kernels' code for keys / values stored as ``dtype`` (uint8: int8 rows, each D values quantized per 32
    then its D / 32 fp32 scales)."""
    if dtype not in KV_MODES:
        raise ValueError(f"the CPU kernels read fp32, fp16, bf16 or int8 (uint8 rows) keys / values, not {dtype}")
    return KV_MODES[dtype]


def default_kv_dtype(lib: ctypes.CDLL) -> torch.dtype:
    """The KV storage a model on ``lib`` gets unless told otherwise: bf16 where its attention multiplies bf16
    operands (amx's tiles; avx512's dot products on a CPU with AVX-512 BF16), reading each block laid out once and
    kept in the cache; fp16 elsewhere (every path reads every storage)."""
    return torch.bfloat16 if attention_bf16(lib) else torch.float16


def attention_bf16(lib: ctypes.CDLL) -> bool:
    """Whether ``lib`` runs a bf16 cache's attention on bf16 products (tiles or vector dot products): its own
    rounding, not the fp32 arithmetic every path shares for the other storages."""
    return bool(lib.rs_attention_bf16())


def kv_row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of ``dtype`` one cached key or value row takes (int8 rows carry their scales)."""
    return head_dim + head_dim // 8 if dtype == torch.uint8 else head_dim


_work = threading.local()


def attention_work_floats(heads: int, rows: int, head_dim: int, longest: int) -> int:
    """Scratch the attention kernel needs: per row and block of 64 visible keys, a partial of head_dim + 2; then
    (the tiles' path) every query row once more in bf16, in whole tiles of 16 per key head."""
    return heads * rows * ((longest + 63) // 64) * (head_dim + 2) + (heads * rows + 16 * heads) * head_dim // 2 + 16


def _workspace(floats: int) -> torch.Tensor:
    buf: torch.Tensor | None = getattr(_work, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = torch.empty(max(floats, 1 << 16), dtype=torch.float32)
        _work.buf = buf
    return buf


def attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,  # [1, H, n, D]
    key: torch.Tensor,  # [1, G, L, D] fp32 / fp16 or [1, G, L, D + D/8] uint8 (int8 rows), rows contiguous
    value: torch.Tensor,  # same shape, strides and dtype as key
    past: int,
    path: torch.Tensor,  # int32 [total]: visible rows beyond the prefix, per query, ascending
    path_off: torch.Tensor,  # int32 [n + 1]
    scale: float,
) -> torch.Tensor:
    """Attention output ``[1, n, H, D]`` (the layout transformers expects back)."""
    _, h, n, d = query.shape
    g = key.shape[1]
    q = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(1, n, h, d, dtype=torch.float32)
    max_path = int((path_off[1:] - path_off[:-1]).max()) if n else 0
    threads = torch.get_num_threads()
    work = _workspace(attention_work_floats(h, n, d, past + max_path))
    call(lib, "rs_attention", q=_ptr(q), q_sh=q.stride(1), q_sn=q.stride(2), H=h, n=n, D=d, k=_ptr(key),
         v=_ptr(value), kv_sh=key.stride(1), kv_sn=key.stride(2), G=g, past=past, path=_ptr(path),
         path_off=_ptr(path_off), scale=float(scale), out=_ptr(out), o_sn=out.stride(1), o_sh=out.stride(2),
         work=_ptr(work), kvm=kv_mode(key.dtype), threads=threads)
    return out
