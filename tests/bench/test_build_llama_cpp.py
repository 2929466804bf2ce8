"""scripts/build-llama-cpp's choice of the `best` llama.cpp build from a CPU's flags (its --print mode: nothing is
downloaded or built), on /proc/cpuinfo-like files written in the test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "build-llama-cpp"
SAPPHIRE = "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16"
ZEN4 = "avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_vbmi"
SKYLAKE = "avx2 fma f16c avx512f avx512bw avx512vl avx512cd avx512dq"
HASWELL = "avx2 fma f16c"


def resolve(tmp_path: Path, flags: str, name: str = "best") -> subprocess.CompletedProcess[str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse sse2 {flags}\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")  # the first processor's flags are read
    return subprocess.run(["bash", str(SCRIPT), name, "--print"], env={**os.environ, "CPUINFO": str(cpuinfo)},
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize(("flags", "variant", "on", "off"), [
    (SAPPHIRE, "avx512-amx", {"AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"}, set()),
    (ZEN4, "avx512", {"AVX512", "AVX512_VNNI", "AVX512_BF16"}, {"AMX_TILE", "AMX_INT8"}),
    (SKYLAKE, "avx512", {"AVX512"}, {"AVX512_VNNI", "AVX512_BF16", "AMX_TILE"}),
    (HASWELL, "avx2", {"AVX2", "FMA", "F16C"}, {"AVX512", "AMX_TILE"}),
    ("avx2 fma f16c avx512f amx_tile amx_int8", "avx2", {"AVX2"}, {"AVX512", "AMX_TILE"}),  # no avx512bw/vl
])  # fmt: skip
def test_best_is_chosen_from_the_cpu_flags(tmp_path: Path, flags: str, variant: str, on: set[str],
                                           off: set[str]) -> None:
    done = resolve(tmp_path, flags)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"variant: {variant}"
    assert lines[1].startswith(f"best -> {variant}: ") and "cpu flags: " in lines[1]  # why, and from what
    cmake = set(lines[2].split())
    assert "-DGGML_NATIVE=OFF" in cmake and "-DGGML_OPENMP=OFF" in cmake
    assert {f"-DGGML_{f}=ON" for f in on} <= cmake
    assert not any(f"-DGGML_{f}=ON" in cmake for f in off)


def test_the_avx512_variant_needs_avx512(tmp_path: Path) -> None:
    done = resolve(tmp_path, HASWELL, "avx512")
    assert done.returncode == 2 and "lacks avx512f/bw/vl" in done.stderr
    assert resolve(tmp_path, HASWELL, "avx2").stdout.splitlines()[0] == "variant: avx2"  # named variants stay as named
