"""Loading the kernels: ``configure`` (which forgets an earlier decision), the one decision whether this process
uses them (``load``, ``loaded``, ``unavailable_reason``), any path's library (``library``), each checked on the way
in: its ISA path, its structs' layout (``abi.check_layout``) and its weight formats (``formats.check_library``)."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

import torch

from decoding.runtime.formats import check_library
from decoding.runtime.kernels import abi, configuration
from decoding.runtime.kernels.building import build
from decoding.runtime.kernels.configuration import KernelConfig
from decoding.runtime.kernels.cpu import resolve_isa, tiles_permitted

logger = logging.getLogger("decoding.runtime.kernels")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""
_paths: dict[str, ctypes.CDLL] = {}


def configure(
    enabled: bool = True, cache_dir: Path | str | None = None, compiler: str | None = None, isa: str = "auto"
) -> None:
    """Set the kernels' configuration; a change forgets an earlier load decision (the next ``load`` decides
    again). Call it before loading a model: a model switched to the kernels keeps the library it found.
    Raises ``KernelUnavailable`` for an ISA path this CPU cannot run (``resolve_isa``)."""
    global _lib, _tried, _why_not
    new = KernelConfig(enabled, None if cache_dir is None else Path(cache_dir), compiler or None, resolve_isa(isa))
    with _lock:
        if new != configuration._config:
            configuration._config = new  # its one writer
            _lib, _tried, _why_not = None, False, ""


def _cpu_supported() -> str:
    """'' when this machine can run the kernels, else the reason."""
    if not configuration.config().enabled:
        return "disabled by configuration (cpu_kernels off)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux x86-64 (this is {platform.system()} {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2 + FMA (torch reports {capability})"
    return ""


def _open(isa: str) -> ctypes.CDLL:
    """Build (if needed) and load the library of path ``isa``, checked to be that path and ready to run."""
    path = build(isa=isa)
    # its own OpenMP runtime (``private_openmp``): looked up before the one torch loaded globally
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND)
    abi.declare(lib)
    abi.check_layout(lib)  # the structs as Python writes them, or no library
    check_library(lib)  # the weight formats as Python packs them, or no library
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
                _lib = _open(configuration.config().isa)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _why_not = str(exc)
        if _lib is None:
            logger.warning("CPU kernels unavailable, using torch's: %s", _why_not)
        return _lib


def library(isa: str) -> ctypes.CDLL:
    """The library of one ISA path whatever the configured one (benchmarks and tests compare paths on one
    model: ``QuantizedModel.lib`` may be swapped). Raises ``KernelUnavailable`` for a path this CPU cannot run and
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
