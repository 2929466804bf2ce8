"""Compiling the kernels: the C sources and headers, the compiler flags, the library's cache key and path, the
private copy of the OpenMP runtime, and ``build`` / ``build_all`` (one compiler process per source and path, an
flock on the cache dir across processes)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

from decoding.runtime.kernels.configuration import cache_dir, config
from decoding.runtime.kernels.cpu import ISA_FLAGS, ISAS, KernelUnavailable

logger = logging.getLogger("decoding.runtime.kernels")

_HERE = Path(__file__).parent
SOURCES = tuple(sorted(_HERE.glob("*.c")))  # every C file here is compiled, for each path, and linked into its library
HEADERS = tuple(sorted(_HERE.glob("*.h")))  # included by the sources: part of the build's identity
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-Werror=switch", "-fopenmp", "-fPIC", "-shared")


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


def _library_path(compiler: str, isa: str) -> Path:
    h = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    h.update(" ".join((compiler, *_flags(isa), *_link(Path(PRIVATE_OPENMP)), platform.machine())).encode())
    return cache_dir() / f"libragspec_cpu-{isa}-{h.hexdigest()[:16]}.so"


def built_isas() -> list[str]:
    """Every ISA path there are kernels for, the configured one last (what an image builds ahead: the CPU it
    will run on may differ from the one it is built on)."""
    isa = config().isa
    return [*(other for other in ISAS if other != isa), isa]


def build(force: bool = False, isa: str | None = None) -> Path:
    """Compile the kernels for ``isa`` (default: the configured path) into the cache dir (atomically) and return
    the library path. Compiling needs no CPU support for the path; loading does."""
    return build_all([config().isa if isa is None else isa], force=force)[0]


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
    compiler = config().compiler or shutil.which("cc") or shutil.which("gcc") or ""
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
