"""What this CPU can run: its feature flags, the ISA paths and what each needs (of the compiler and of the CPU),
the AMX tile state Linux grants, and the choice of a path (``resolve_isa``)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

from decoding.errors import DecodingError

ISAS = ("avx2", "avx512", "amx")  # the paths, in order of preference; "auto" picks the best one built and present
ISA_FLAGS: dict[str, tuple[str, ...]] = {  # added to building.FLAGS
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


class KernelUnavailable(DecodingError):  # noqa: N818  (what the caller is told)
    """An ISA path that is unknown or that this CPU (or its kernel) cannot run."""


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
