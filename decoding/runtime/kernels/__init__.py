"""Batch-invariant CPU kernels for the target's forwards (decode steps and draft-tree verification).

The C files (AVX2 + FMA + F16C, OpenMP) compiled once with a C compiler (default ``cc`` on the PATH) into a
cache dir (default ``~/.cache/ragspec/kernels``) and loaded with ctypes. Both, whether the kernels are used
at all and the ISA path are plain configuration (``configure``, called by the service from its settings
before it loads a model): this package reads no environment variables.

ISA paths, one build each (the cache file is keyed by the path and its flags): ``avx2``, the baseline;
``avx512`` (AVX-512 VNNI: a block's int8 products summed by one ``dpbusd``; attention on 16 lanes); ``amx``
(also linear layers of 8 rows and more on the int8 tiles, after asking Linux for the tile state, and, with a
bf16 KV cache, its default, attention on the bf16 tiles). All give the same bits on the same cache except the
attention on the bf16 tiles, which has its own (bf16 queries and numerators; see the C file). ``auto`` takes the
best path the CPU reports; asking for a path the CPU lacks raises ``KernelUnavailable`` at ``configure``, before a
model loads. ``build`` compiles any path (compiling needs no CPU support: an image builds every path,
``built_isas``; ``build_all`` compiles several paths at once, one compiler process per source and path on every
CPU); ``load`` loads the configured one.

The C files (every ``*.c`` here is compiled for each path and linked into its library; the library's cache key
hashes them and every ``*.h``):

- ``forward.c``: the quantized runtime's forward (``decoding.runtime.quantized``), one call for every layer, and
  the LM head; ``forward.h`` its structs;
- ``rows.c``: the row operations between the matrix products (activation quantization, RMSNorm, RoPE + KV store,
  the gated MLP's activation, post-norms, soft-capping);
- ``matmul.c``: the one dispatch by weight format (``formats.h``: every format's id and sizes, checked against
  ``decoding.runtime.formats`` at load) to the format files: ``formats_q8_0_q4_1.c`` (Q8_0 / Q4_1, with the AMX
  tiles), ``formats_int.c`` (the other block formats, one header each: ``q4_k.h`` Q4_K / Q5_K, ``q6_k.h``,
  ``q32.h`` Q5_0 / Q4_0 / Q5_1 / IQ4_NL, ``iq4_xs.h``; ``kq_lanes.h`` their vector layer; and parts matrices),
  ``formats_float.c`` (F16 / BF16 / F32 on the fp32 activations);
- ``attention.c``: attention over the cached prefix plus each query's tree path (fp32, fp16, bf16 or int8 KV),
  used by both CPU runtimes; ``linear_f32.c``: fp32 small-batch linear layers for the torch path
  (``cpu_quant="none"``);
- ``api.h``: every entry point Python calls; ``abi.c``: the structs' layout for the load-time check; ``formats.c``:
  the formats' table as the check reads it; ``simd.h``: the vector helpers they share.

The Python modules, one concern each (this package re-exports their public names; the mutable state lives in
the module named, so read or patch it there):

- ``cpu``: the CPU's flags, the ISA paths and what each needs of the compiler and of the CPU, the AMX tile
  permission (state: ``_tiles``), ``resolve_isa`` / ``available_isas``, ``KernelUnavailable``;
- ``configuration``: ``KernelConfig``, ``config``, ``cache_dir`` (state: ``_config``, written by ``configure``);
- ``building``: the sources and headers, compiler flags, the library's cache key and path, the private OpenMP
  runtime, ``build`` / ``build_all`` / ``build_jobs`` / ``built_isas`` (an flock on the cache dir);
- ``loading``: ``configure``, ``load`` / ``loaded`` / ``unavailable_reason`` / ``library``, each library checked as
  it loads (state: ``_lib``, ``_tried``, ``_why_not``, ``_paths``);
- ``abi``: the structs and entry points crossing into C, declared once (checked at load; ``call`` by name);
- ``kernel_thread``: ``run_on_kernel_thread``, the one thread every quantized forward runs on;
- ``ops``: the Python wrappers of the C entry points (``linear``, ``qlinear``, ``dequant_rows``, ``attention`` and
  its workspace), the kernels' choice by rows (``pair_table``) and the KV storage helpers;
- ``patching``: a transformers model's ``nn.Linear`` layers switched to ``KernelLinear`` (``use_cpu_kernels``,
  ``kernels_active``, ``disable``, ``KERNEL_FLAG``).

Where they cannot be used (no compiler, a CPU without AVX2, ``configure(enabled=False)``) the target runs on
transformers with fp32 weights: same results up to rounding, slower.

Exactness: each output element is computed by the same operation sequence whatever the batch shape (see
the C files), so a token's logits inside a verify pass equal its logits in a plain decode step bit for bit.
"""

from __future__ import annotations

from decoding.runtime.kernels.building import (
    FLAGS,
    HEADERS,
    PRIVATE_OPENMP,
    SOURCES,
    build,
    build_all,
    build_jobs,
    built_isas,
    private_openmp,
)
from decoding.runtime.kernels.configuration import KernelConfig, cache_dir, config
from decoding.runtime.kernels.cpu import (
    ISA_CPU_FLAGS,
    ISA_FLAGS,
    ISAS,
    KernelUnavailable,
    available_isas,
    cpu_flags,
    resolve_isa,
    tiles_permitted,
)
from decoding.runtime.kernels.kernel_thread import run_on_kernel_thread
from decoding.runtime.kernels.loading import configure, library, load, loaded, unavailable_reason
from decoding.runtime.kernels.ops import (
    KV_MODES,
    MAX_ROWS,
    TILE_ROWS,
    attention,
    attention_bf16,
    attention_work_floats,
    default_kv_dtype,
    dequant_rows,
    kv_mode,
    kv_row_width,
    linear,
    pair_table,
    qlinear,
    tile_rows,
)
from decoding.runtime.kernels.patching import KERNEL_FLAG, KernelLinear, disable, kernels_active, use_cpu_kernels

__all__ = [
    "FLAGS",
    "HEADERS",
    "ISAS",
    "ISA_CPU_FLAGS",
    "ISA_FLAGS",
    "KERNEL_FLAG",
    "KV_MODES",
    "MAX_ROWS",
    "PRIVATE_OPENMP",
    "SOURCES",
    "TILE_ROWS",
    "KernelConfig",
    "KernelLinear",
    "KernelUnavailable",
    "attention",
    "attention_bf16",
    "attention_work_floats",
    "available_isas",
    "build",
    "build_all",
    "build_jobs",
    "built_isas",
    "cache_dir",
    "config",
    "configure",
    "cpu_flags",
    "default_kv_dtype",
    "dequant_rows",
    "disable",
    "kernels_active",
    "kv_mode",
    "kv_row_width",
    "library",
    "linear",
    "load",
    "loaded",
    "pair_table",
    "private_openmp",
    "qlinear",
    "resolve_isa",
    "run_on_kernel_thread",
    "tile_rows",
    "tiles_permitted",
    "unavailable_reason",
    "use_cpu_kernels",
]
