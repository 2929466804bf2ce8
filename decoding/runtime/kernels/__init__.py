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

- ``quant_kernels.c``: the quantized CPU runtime's building blocks (``decoding.runtime.cpu_llama``): linear layers
  on Q8_0 / Q4_1 weights with int8 activations, RMSNorm, RoPE + KV store, SiLU, and one call per decoder
  layer;
- ``cpu_kernels.c``: attention over the cached prefix plus each query's tree path (fp32, fp16, bf16 or int8 KV),
  used by both CPU runtimes, and fp32 small-batch linear layers for the torch fallback (``cpu_quant="none"``);
- ``kquant_kernels.c``: the linear layers on GGUF's Q4_K / Q6_K / Q5_0 weights and on matrices whose parts are of
  several formats (called by ``quant_kernels.c``).

Where they cannot be used (no compiler, a CPU without AVX2, ``configure(enabled=False)``) the target runs on
transformers with fp32 weights: same results up to rounding, slower.

Exactness: each output element is computed by the same operation sequence whatever the batch shape (see
the C files), so a token's logits inside a verify pass equal its logits in a plain decode step bit for bit.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import queue
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from decoding.errors import DecodingError
from decoding.runtime.quant import QuantMatrix

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

SOURCES = (Path(__file__).with_name("cpu_kernels.c"), Path(__file__).with_name("quant_kernels.c"),
           Path(__file__).with_name("kquant_kernels.c"), Path(__file__).with_name("float_kernels.c"))
HEADERS = (Path(__file__).with_name("simd.h"),)  # included by both: part of the build's identity
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
ISAS = ("avx2", "avx512", "amx")  # the paths, in order of preference; "auto" picks the best one built and present
ISA_FLAGS: dict[str, tuple[str, ...]] = {  # added to FLAGS
    "avx2": (),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "amx": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8",
            "-mamx-bf16"),
}
ISA_CPU_FLAGS: dict[str, frozenset[str]] = {  # what /proc/cpuinfo must list for a path
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "amx": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                      "amx_tile", "amx_int8", "amx_bf16"}),
}
MAX_ROWS = 96  # forwards over more tokens (prefill chunks) use torch's kernels: BLAS is good at large M
TILE_ROWS = 16  # the AMX path reads quantized activations a whole tile of rows at a time


def tile_rows(rows: int) -> int:
    """Rows the quantized-activation scratch needs for ``rows`` rows (whole tiles; the rest never read back)."""
    return -(-rows // TILE_ROWS) * TILE_ROWS


KERNEL_FLAG = "_ragspec_cpu_kernels"  # set on every module of a switched model; the attention layers read it

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


class KernelUnavailable(DecodingError):  # noqa: N818  (what the caller is told)
    """An ISA path that is unknown or that this CPU (or its kernel) cannot run."""


@dataclass(frozen=True)
class KernelConfig:
    """Where and how the kernels are built, whether they are used, and the ISA path (never "auto" here)."""

    enabled: bool = True
    cache_dir: Path | None = None  # None: ~/.cache/ragspec/kernels
    compiler: str | None = None  # None: cc (or gcc) found on the PATH
    isa: str = "avx2"


def cpu_flags() -> frozenset[str]:
    """The feature flags the CPU reports (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def tiles_permitted() -> bool:
    """Whether Linux grants this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA; Linux
    5.16 and later). Asked once; granting is process-wide and what the amx kernels need before they run."""
    global _tiles
    if _tiles is None and platform.machine() not in ("x86_64", "AMD64"):
        _tiles = False
    if _tiles is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _tiles = libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023), ctypes.c_long(18)) == 0  # arch_prctl
        except (OSError, AttributeError):
            _tiles = False
    return _tiles


_tiles: bool | None = None


def available_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The built ISA paths this CPU can run, best first (the real CPU's amx also needs ``tiles_permitted``;
    given ``flags`` are taken as they are)."""
    real = flags is None
    flags = cpu_flags() if flags is None else flags
    runnable = [isa for isa in reversed(ISAS) if ISA_CPU_FLAGS[isa] <= flags]
    return [isa for isa in runnable if not (real and isa == "amx" and not tiles_permitted())]


def resolve_isa(isa: str = "auto", flags: frozenset[str] | None = None) -> str:
    """``isa`` checked against this CPU (``auto``: the best path it can run; ``avx2`` where it can run none, which
    ``load`` then reports as unavailable). Raises ``KernelUnavailable`` for an unknown path or one the CPU
    lacks."""
    real = flags is None
    flags = cpu_flags() if flags is None else flags
    if isa == "auto":
        found = available_isas(None if real else flags)
        return found[0] if found else "avx2"
    if isa not in ISAS:
        raise KernelUnavailable(f"unknown CPU kernel path {isa!r}; use auto or one of {', '.join(ISAS)}")
    missing = sorted(ISA_CPU_FLAGS[isa] - flags)
    if missing:
        raise KernelUnavailable(f"CPU kernel path {isa!r} needs {', '.join(missing)}, which this CPU does not "
                                f"report (it can run: {', '.join(available_isas(None if real else flags)) or 'none'})")
    if real and isa == "amx" and not tiles_permitted():
        raise KernelUnavailable("CPU kernel path 'amx': Linux refuses this process the AMX tile state "
                                "(arch_prctl XTILEDATA needs Linux 5.16 or later)")
    return isa


_config = KernelConfig(isa=resolve_isa())


def configure(
    enabled: bool = True, cache_dir: Path | str | None = None, compiler: str | None = None, isa: str = "auto"
) -> None:
    """Set the kernels' configuration; a change forgets an earlier load decision (the next ``load`` decides
    again). Call it before loading a model: a model switched to the kernels keeps the library it found.
    Raises ``KernelUnavailable`` for an ISA path this CPU cannot run (``resolve_isa``)."""
    global _config, _lib, _tried, _why_not
    new = KernelConfig(enabled, None if cache_dir is None else Path(cache_dir), compiler or None, resolve_isa(isa))
    with _lock:
        if new != _config:
            _config = new
            _lib, _tried, _why_not = None, False, ""


def config() -> KernelConfig:
    return _config


def cache_dir() -> Path:
    return _config.cache_dir or Path.home() / ".cache" / "ragspec" / "kernels"


def _flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *ISA_FLAGS[isa])


def _link(openmp: Path | None) -> tuple[str, ...]:
    """After the sources: the private OpenMP runtime ``openmp`` (in the library's own folder's ``openmp/``, found
    through ``$ORIGIN`` wherever the cache moves) when there is one; then the compiler's ``-lgomp`` goes unused."""
    return ("-Wl,--as-needed", str(openmp), "-Wl,-rpath,$ORIGIN/openmp") if openmp is not None else ()


PRIVATE_OPENMP = "librsmp.so.1"  # as long as "libgomp.so.1": the copy's name is patched in place


def private_openmp(compiler: str) -> Path | None:
    """A copy of the compiler's OpenMP runtime under another name, for the kernels alone (None: none found).

    libgomp throttles every team's spin-waiting as soon as the process holds more OpenMP threads than CPUs,
    counting the idle pools of every thread that ever ran a parallel region: one torch op in another thread
    (an embedder, a request's sampling) then makes each of the kernels' barriers a futex sleep and wake (the
    measurement: docs/benchmarks.md, "Many people at once"). With a runtime of their own (and one thread calling
    them, ``run_on_kernel_thread``) the kernels' team stays the only one it counts."""
    try:
        found = subprocess.run([compiler, "-print-file-name=libgomp.so"], capture_output=True, text=True,
                               timeout=60).stdout.strip()
        source = Path(os.path.realpath(found))
        data = source.read_bytes() if found and source.is_file() else b""
    except (OSError, subprocess.SubprocessError):
        return None
    patched = _rename_soname(data, b"libgomp.so.1", PRIVATE_OPENMP.encode())
    if patched is None:
        return None
    out = cache_dir() / "openmp" / PRIVATE_OPENMP
    if out.is_file() and out.read_bytes() == patched:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(patched)
    os.replace(tmp, out)
    return out


def _rename_soname(data: bytes, old: bytes, new: bytes) -> bytes | None:
    """An ELF64 shared library with its name ``old`` replaced by ``new`` (same length) in its dynamic string table
    (its SONAME and version base); None if it is not one or does not hold that name."""
    if len(old) != len(new) or data[:5] != b"\x7fELF\x02":
        return None
    out = bytearray(data)
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * entsize)
        return name, offset, size

    strtab = section(names)[1]
    for i in range(count):
        name, offset, size = section(i)
        if data[strtab + name : data.index(b"\0", strtab + name)] == b".dynstr":
            table = data[offset : offset + size]
            if old + b"\0" not in table:
                return None
            out[offset : offset + size] = table.replace(old + b"\0", new + b"\0")
            return bytes(out)
    return None


class _KernelThread:
    """One thread that runs every forward of the quantized runtime (``run_on_kernel_thread``): OpenMP keeps a
    pool of workers per thread that starts parallel regions, and more pools than CPUs throttle them all."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if threading.current_thread() is self._thread:
            return fn(*args)
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="ragspec-kernels", daemon=True)
                self._thread.start()
        done = threading.Event()
        box: list[Any] = []
        self._jobs.put((fn, args, torch.is_inference_mode_enabled(), torch.get_num_threads(), box, done))
        done.wait()
        if box[0]:
            raise box[1]
        return box[1]  # type: ignore[no-any-return]

    def _serve(self) -> None:
        while True:
            fn, args, inference, threads, box, done = self._jobs.get()
            try:
                if torch.get_num_threads() != threads:  # the caller's thread count (OpenMP's is per thread)
                    torch.set_num_threads(threads)
                with torch.inference_mode(inference):
                    box[:] = [False, fn(*args)]
            except BaseException as exc:  # handed to the caller
                box[:] = [True, exc]
            done.set()


_kernel_thread = _KernelThread()


def run_on_kernel_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on the kernels' one thread (directly when called there); its result or its exception."""
    return _kernel_thread.run(fn, *args)


def _library_path(compiler: str, isa: str) -> Path:
    h = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    h.update(" ".join((compiler, *_flags(isa), *_link(Path(PRIVATE_OPENMP)), platform.machine())).encode())
    return cache_dir() / f"libragspec_cpu-{isa}-{h.hexdigest()[:16]}.so"


def _cpu_supported() -> str:
    """'' when this machine can run the kernels, else the reason."""
    if not _config.enabled:
        return "disabled by configuration (cpu_kernels off)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux x86-64 (this is {platform.system()} {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2 + FMA (torch reports {capability})"
    return ""


def built_isas() -> list[str]:
    """Every ISA path there are kernels for, the configured one last (what an image builds ahead: the CPU it
    will run on may differ from the one it is built on)."""
    return [*(isa for isa in ISAS if isa != _config.isa), _config.isa]


def build(force: bool = False, isa: str | None = None) -> Path:
    """Compile the kernels for ``isa`` (default: the configured path) into the cache dir (atomically) and return
    the library path. Compiling needs no CPU support for the path; loading does."""
    return build_all([_config.isa if isa is None else isa], force=force)[0]


def build_jobs() -> int:
    """How many compiler processes ``build_all`` runs at once: one per CPU this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def build_all(isas: Sequence[str] | None = None, force: bool = False, jobs: int | None = None) -> list[Path]:
    """Compile the kernels of every path in ``isas`` (default: ``built_isas()``) into the cache dir and return their
    libraries, in the order asked (one already there is kept unless ``force``).

    Each source of each path is one compiler process, ``jobs`` of them at once (default ``build_jobs()``), the
    longest first; a path's objects are then linked into its library, which is moved into place atomically (no
    temporary file is left behind, whatever fails). Raises ``RuntimeError`` if compiling fails (the command and the
    end of its output)."""
    isas = built_isas() if isas is None else list(isas)
    for isa in isas:
        if isa not in ISAS:
            raise KernelUnavailable(f"unknown CPU kernel path {isa!r}; use one of {', '.join(ISAS)}")
    compiler = _config.compiler or shutil.which("cc") or shutil.which("gcc") or ""
    if not compiler:
        raise RuntimeError("no C compiler (cc/gcc) found; install gcc to enable the CPU kernels")
    outs = {isa: _library_path(compiler, isa) for isa in isas}
    if not force and all(out.is_file() for out in outs.values()):
        return [outs[isa] for isa in isas]
    cache_dir().mkdir(parents=True, exist_ok=True)
    with _building(cache_dir()):  # another process building here: wait, then take what it built
        todo = [isa for isa in dict.fromkeys(isas) if force or not outs[isa].is_file()]
        if todo:
            openmp = private_openmp(compiler)
            work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir()))
            try:
                _compile(compiler, todo, openmp, work, jobs or build_jobs(), outs)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            for isa in todo:
                logger.info("built CPU kernels at %s", outs[isa])
    return [outs[isa] for isa in isas]


@contextmanager
def _building(directory: Path) -> Iterator[None]:
    """Held while building into ``directory``, across processes (an flock on the directory itself: no lock file
    is left in the cache): workers or replicas starting at once on an empty cache compile a library once, not each
    their own copy. Where the file system has no locks, builds go on unlocked (each still atomic)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(compiler: str, isas: list[str], openmp: Path | None, work: Path, jobs: int, outs: dict[str, Path]) -> None:
    """The compiler processes of ``build_all``: objects in ``work``, each path linked once its objects are built."""

    def run(cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")

    # the wider paths' big source first: the longest jobs start at once, the short ones fill in behind them
    order = sorted(((isa, src) for isa in isas for src in SOURCES),
                   key=lambda job: (-job[1].stat().st_size, -ISAS.index(job[0])))
    obj = {(isa, src): work / f"{isa}-{src.stem}.o" for isa, src in order}
    compile_flags = [f for f in FLAGS if f != "-shared"]
    commands = [[compiler, *compile_flags, *ISA_FLAGS[isa], "-c", str(src), "-o", str(obj[isa, src])]
                for isa, src in order]
    with ThreadPoolExecutor(max_workers=min(jobs, len(commands))) as pool:  # threads: the work is in the processes
        futures = [pool.submit(run, cmd) for cmd in commands]
        for future in futures:
            error = future.exception()
            if error is not None:
                for pending in futures:
                    pending.cancel()
                raise error
    for isa in isas:
        library = work / f"{isa}.so"
        run([compiler, *_flags(isa), *(str(obj[isa, src]) for src in SOURCES), *_link(openmp), "-o", str(library)])
        os.replace(library, outs[isa])


def _open(isa: str) -> ctypes.CDLL:
    """Build (if needed) and load the library of path ``isa``, checked to be that path and ready to run."""
    path = build(isa=isa)
    # its own OpenMP runtime (``private_openmp``): looked up before the one torch loaded globally
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND)
    _declare(lib)
    built = lib.rs_isa().decode()
    if built != isa:  # the compiler ignored the path's flags: never run another path quietly
        raise RuntimeError(f"the kernels were built for {built}, not for {isa}")
    if built == "amx" and not tiles_permitted():  # the request is process-wide: asked once, before any tile runs
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl XTILEDATA)")
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, building it on first use; None (with the reason logged once) if unavailable."""
    global _lib, _tried, _why_not
    with _lock:
        if _tried:
            return _lib
        _tried = True
        _why_not = _cpu_supported()
        if not _why_not:
            try:
                _lib = _open(_config.isa)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _why_not = str(exc)
        if _lib is None:
            logger.warning("CPU kernels unavailable, using torch's: %s", _why_not)
        return _lib


_paths: dict[str, ctypes.CDLL] = {}


def library(isa: str) -> ctypes.CDLL:
    """The library of one ISA path whatever the configured one (benchmarks and tests compare paths on one
    model: ``CpuLlama.lib`` may be swapped). Raises ``KernelUnavailable`` for a path this CPU cannot run and
    ``RuntimeError`` if it does not build."""
    resolve_isa(isa)
    with _lock:
        if isa not in _paths:
            _paths[isa] = _open(isa)
        return _paths[isa]


def loaded() -> ctypes.CDLL | None:
    """The library if ``load`` succeeded already (no building, no locking: for hot paths)."""
    return _lib


def unavailable_reason() -> str:
    load()
    return _why_not


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.rs_linear_f32.argtypes = [p, i, i, p, i, p, p, i]
    lib.rs_linear_f32.restype = None
    lib.rs_attention.argtypes = [p, lg, lg, i, i, i, p, p, lg, lg, i, i, p, p, f, p, lg, lg, p, i, i]
    lib.rs_attention.restype = None
    lib.rs_qlinear.argtypes = [p, i, i, p, i, lg, i, p, p, p, p, p, p, i]
    lib.rs_qlinear.restype = None
    lib.rs_dequant_rows.argtypes = [p, i, lg, i, p, i, p, i]
    lib.rs_dequant_rows.restype = None
    lib.rs_forward.argtypes = [p, i, p, p, i, p, p, p, i, p, i]
    lib.rs_forward.restype = None
    lib.rs_tile_keys.argtypes = []
    lib.rs_tile_keys.restype = i
    lib.rs_attention_tiles.argtypes = []
    lib.rs_attention_tiles.restype = i
    lib.rs_attention_bf16.argtypes = []
    lib.rs_attention_bf16.restype = i
    lib.rs_tile_block_elems.argtypes = [i]
    lib.rs_tile_block_elems.restype = lg
    lib.rs_head.argtypes = [p, i, i, i, p, f, p, i, lg, i, p, p, i]
    lib.rs_head.restype = None
    lib.rs_isa.argtypes = []
    lib.rs_isa.restype = ctypes.c_char_p


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 CPU tensors (weight and bias contiguous)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    n = weight.shape[0]
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    lib.rs_linear_f32(_ptr(rows), rows.shape[0], k, _ptr(weight), n, _ptr(bias), _ptr(y), torch.get_num_threads())
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
    lib.rs_qlinear(
        _ptr(rows), m, k, _ptr(weight.data), int(weight.kind), weight.group_bytes, n, _ptr(bias), _ptr(res),
        _ptr(y), _ptr(xq), _ptr(scales[0]), _ptr(scales[1]), torch.get_num_threads(),
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)


def dequant_rows(lib: ctypes.CDLL, weight: QuantMatrix, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``[len(rows), K]``: the given rows of ``weight`` (e.g. token embeddings) dequantized."""
    idx = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), weight.cols, dtype=torch.float32)
    lib.rs_dequant_rows(
        _ptr(weight.data), int(weight.kind), weight.group_bytes, weight.cols, _ptr(idx), idx.numel(), _ptr(out),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


KV_MODES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2, torch.bfloat16: 3}  # how the kernels read a cached row


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
    lib.rs_attention(
        _ptr(q), q.stride(1), q.stride(2), h, n, d,
        _ptr(key), _ptr(value), key.stride(1), key.stride(2), g,
        past, _ptr(path), _ptr(path_off), float(scale),
        _ptr(out), out.stride(1), out.stride(2), _ptr(work), kv_mode(key.dtype), threads,
    )  # fmt: skip
    return out


class KernelLinear(torch.nn.Linear):
    """``nn.Linear`` whose small-batch fp32 CPU forward runs on the batch-invariant kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        lib = _lib
        if (
            lib is not None
            and input.dtype == torch.float32
            and input.device.type == "cpu"
            and input.numel() <= MAX_ROWS * input.shape[-1]
            and not torch.is_grad_enabled()
        ):
            return linear(lib, input, self.weight, self.bias)
        return super().forward(input)


def use_cpu_kernels(model: torch.nn.Module) -> bool:
    """Switch an fp32 CPU model's ``nn.Linear`` layers to ``KernelLinear`` and let its attention layers use
    the attention kernel (``decoding.runtime.attention``, grouped SDPA models). True if switched."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or params[0].dtype != torch.float32:
        return False
    if load() is None:
        return False
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.is_contiguous():
            if module.bias is not None and not module.bias.is_contiguous():
                continue
            module.__class__ = KernelLinear
    for module in model.modules():
        setattr(module, KERNEL_FLAG, True)
    return True


def kernels_active(model: torch.nn.Module) -> bool:
    return any(isinstance(m, KernelLinear) for m in model.modules())


def disable(model: torch.nn.Module) -> None:
    """Undo ``use_cpu_kernels`` (benchmarks compare both)."""
    for module in model.modules():
        if type(module) is KernelLinear:
            module.__class__ = torch.nn.Linear  # type: ignore[assignment]
        if hasattr(module, KERNEL_FLAG):
            delattr(module, KERNEL_FLAG)
