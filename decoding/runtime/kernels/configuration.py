"""The kernels' configuration: whether they are used, where and with what they are built, the ISA path.

It lives here, read by the build and the loader; ``loading.configure`` is the one writer (a change also forgets the
loader's decision)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from decoding.runtime.kernels.cpu import resolve_isa


@dataclass(frozen=True)
class KernelConfig:
    """Where and how the kernels are built, whether they are used, and the ISA path (never "auto" here)."""

    enabled: bool = True
    cache_dir: Path | None = None  # None: ~/.cache/ragspec/kernels
    compiler: str | None = None  # None: cc (or gcc) found on the PATH
    isa: str = "avx2"


_config = KernelConfig(isa=resolve_isa())


def config() -> KernelConfig:
    return _config


def cache_dir() -> Path:
    return _config.cache_dir or Path.home() / ".cache" / "ragspec" / "kernels"
