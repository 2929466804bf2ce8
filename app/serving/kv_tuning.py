"""Fitting the KV cache tiers and the verify-cost calibration to the device the service runs on.

The measurements live here (free device memory, available RAM, the device's kind); the arithmetic is in
``decoding.cache.memory`` and the calibration itself in ``decoding.speculative.calibration``.

- Device tier (``RAGSPEC_KV_CACHE_BYTES``, ``auto``): on CUDA, what ``decoding.cache.memory.device_kv_budget``
  leaves of the device memory free once every model is loaded; on a CPU 2 GiB (the models and
  the working caches share that RAM with everything else on the machine, so a fixed, modest share).
- Host tier (``RAGSPEC_KV_HOST_BYTES``, ``auto``): on CUDA, ``HOST_FRACTION`` of the RAM available at
  start-up less one full-window entry (the disk writer's host copy); on a CPU none (the device is the host).
- Window check: on CUDA the start stops (``check_window_fits``) when one generation's KV at the window does
  not fit the free device memory, naming the largest window that does; on a CPU (``fit_cpu_window``) the model's
  own window is capped to what the RAM holds (one log line), a window asked for that does not fit stops the start.
- Calibration: at start-up 256 and 2048 tokens (cheap on a CPU), and on a GPU also longer caches
  up to the window; on a GPU, once requests run on caches well beyond the longest calibrated one, a
  calibration at that length is queued as a background job between requests (``schedule_recalibration``);
  one cut short by a request is not queued again for ``RECALIBRATE_BACKOFF`` generations (``RecalibrationBackoff``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from decoding.cache.memory import (
    DEVICE_MARGIN_BYTES,
    device_kv_budget,
    host_kv_budget,
    largest_window,
)
from decoding.errors import ModelLoadError
from decoding.runtime.loader import LoadedModel
from decoding.speculative.calibration import calibrate
from decoding.speculative.engine import Engine

if TYPE_CHECKING:  # annotations only: the GPU checks import this module where fastapi / pydantic are absent
    from app.serving.scheduler import GenerationScheduler

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 2 << 30
HOST_FRACTION = 0.4  # of the RAM available at start-up, for the host tier on CUDA
START_CONTEXTS = (256, 2048)
RECALIBRATE_RATIO = 1.5  # served caches this much longer than the longest calibrated one: calibrate there
CALIBRATION_KEY = "calibrate"  # one calibration job at a time on the scheduler
RECALIBRATE_BACKOFF = 32  # generations after a cancelled recalibration before its length is queued again


def available_ram_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """RAM this process could still be given without swapping or being killed: the kernel's MemAvailable (else
    the free pages' bytes), and no more than what the container's memory limit leaves (cgroup v2
    ``memory.max`` - ``memory.current``, or v1 ``memory/memory.limit_in_bytes`` - ``usage_in_bytes``): inside
    a container ``/proc/meminfo`` describes the whole host."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    left = cgroup_memory_left(cgroup)
    return available if left is None else min(available, left)


def cgroup_memory_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the memory cgroup's limit still leaves (limit - usage + reclaimable page cache), or None without
    a limit. The usage counts the page cache (reading the weights fills it up to the limit), which the kernel
    drops under pressure: its inactive part is subtracted, as ``docker stats`` does."""
    for limit_file, usage_file, stat_file, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
         "total_inactive_file"),
    ):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None  # no limit (v1 writes a huge number for none)
        usage -= min(usage, _stat_value(root / stat_file, inactive_key))
        return max(0, int(limit_text) - usage)
    return None


def _stat_value(path: Path, key: str) -> int:
    """The value of ``key`` in a cgroup ``memory.stat`` file (lines ``name value``); 0 if absent or unreadable."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def free_device_bytes(device: torch.device) -> int:
    """Free memory of a CUDA ``device`` now, as the driver reports it."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def kv_budgets(
    target: LoadedModel, kv_cache_bytes: int | Literal["auto"], kv_host_bytes: int | Literal["auto"]
) -> tuple[int, int]:
    """(device tier bytes, host tier bytes) of the prefix cache: the given byte counts, or for ``"auto"``
    sized from the target's device as the module says. Call once every model is loaded: on CUDA it raises
    ``ModelLoadError`` when the window does not fit the device (``check_window_fits``)."""
    on_cuda = target.device.type == "cuda"
    per_token = target.model.kv_bytes_per_token() if on_cuda else 0
    free = check_window_fits(target) if on_cuda else 0
    device_bytes = kv_cache_bytes
    if device_bytes == "auto":
        device_bytes = device_kv_budget(free, per_token, target.max_context) if on_cuda else CPU_KV_BYTES
    host_bytes = kv_host_bytes
    if not on_cuda:
        host_bytes = 0
    elif host_bytes == "auto":
        host_bytes = host_kv_budget(available_ram_bytes(), per_token, target.max_context, HOST_FRACTION)
    logger.info("prefix KV cache: %.1f GiB on %s, %.1f GiB in host memory", device_bytes / 2**30,
                target.device, host_bytes / 2**30)
    return device_bytes, host_bytes


def check_window_fits(target: LoadedModel) -> int:
    """The free memory of the target's CUDA device (bytes), once checked to hold one generation's KV at the
    full window plus ``DEVICE_MARGIN_BYTES``. Raises ``ModelLoadError`` otherwise, naming the largest window that
    fits: without this check the start succeeds and the first long request runs out of device memory."""
    free = free_device_bytes(target.device)
    per_token = target.model.kv_bytes_per_token()
    needed = per_token * target.max_context + DEVICE_MARGIN_BYTES
    if free < needed:
        gib, fits = 2**30, largest_window(free, per_token)
        shorter = f"set RAGSPEC_MAX_CONTEXT={fits} (the largest window that fits), or " if fits else ""
        raise ModelLoadError(
            f"the context window does not fit {target.device}: one generation at {target.max_context} tokens "
            f"needs {per_token * target.max_context / gib:.1f} GiB of KV ({per_token} bytes a token) and "
            f"{DEVICE_MARGIN_BYTES / gib:.1f} GiB of working room, but {free / gib:.1f} GiB is free once the "
            f"models are loaded: {shorter}use a smaller model, or a GPU with more memory"
        )
    return free


WEIGHTS_GROWTH = 1.04  # served weights over a GGUF's bytes at most (the unpacked 6-bit scales: 1.036x)


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a model spec names (the file, or the one in a directory), None for anything else."""
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def check_weights_fit(spec: str, available: int | None = None) -> None:
    """Before loading a GGUF on the CPU: ``ModelLoadError`` in one line saying how much RAM it needs if its weights
    as served (``WEIGHTS_GROWTH`` x the file at most) and ``DEVICE_MARGIN_BYTES`` do not fit the RAM available, rather
    than the machine swapping or the process being killed half way through the load."""
    path = gguf_file(spec)
    if path is None:
        return
    available = available_ram_bytes() if available is None else available
    need = int(path.stat().st_size * WEIGHTS_GROWTH) + DEVICE_MARGIN_BYTES
    if need > available:
        gib, file_gib = 1 << 30, path.stat().st_size / (1 << 30)
        raise ModelLoadError(f"{path.name} needs about {need / gib:.1f} GiB of RAM to load (its {file_gib:.1f} GiB of "
                             f"weights as served, and room to run), {available / gib:.1f} GiB is available: use a "
                             "smaller quantization of it (e.g. Q3_K_M or Q2_K) or a machine with more RAM")


def fit_cpu_window(target: LoadedModel, explicit: bool, available: int | None = None) -> LoadedModel:
    """A CPU target with the window its RAM holds: one generation's KV at the window, the CPU prefix tier
    (``CPU_KV_BYTES``) and ``DEVICE_MARGIN_BYTES`` must fit the RAM available once the models are loaded. The
    model's own window that does not fit is capped to the largest that does, with one log line saying why; a
    window asked for (``explicit``, RAGSPEC_MAX_CONTEXT) that does not fit stops the start naming the largest."""
    from decoding.runtime.loader import with_context_window

    if target.device.type != "cpu":
        return target
    available = available_ram_bytes() if available is None else available
    per_token = target.model.kv_bytes_per_token()
    room = available - CPU_KV_BYTES
    if per_token * target.max_context + DEVICE_MARGIN_BYTES <= room:
        return target
    gib, fits = 2**30, largest_window(room, per_token)
    need = f"one generation at {target.max_context} tokens needs {per_token * target.max_context / gib:.1f} GiB of KV"
    have = f"{available / gib:.1f} GiB of RAM is available ({CPU_KV_BYTES / gib:.0f} GiB of it for the prefix cache)"
    if explicit or not fits:
        shorter = f"set RAGSPEC_MAX_CONTEXT={fits} or less, or " if fits else ""
        raise ModelLoadError(f"the context window does not fit this machine's memory: {need}, {have}: {shorter}"
                             "use a smaller model")
    logger.warning("context window capped to %d tokens (the model's is %d): %s, %s; RAGSPEC_MAX_CONTEXT sets it",
                   fits, target.max_context, need, have)
    return with_context_window(target, fits)


def calibration_contexts(window: int, device: torch.device) -> tuple[int, ...]:
    """Cache lengths to calibrate at start-up: ``START_CONTEXTS``, and on a GPU every fourfold longer one
    below the window and the window itself (``verify_costs`` clamps a length to what fits)."""
    contexts = list(START_CONTEXTS)
    if device.type == "cuda":
        length = contexts[-1] * 4
        while length < window:
            contexts.append(length)
            length *= 4
        if window > contexts[-1]:
            contexts.append(window)
    return tuple(contexts)


def start_calibration(engine: Engine, scheduler: GenerationScheduler) -> bool:
    """Queue the start-up calibration as a background job: the first two lengths always run to the end,
    the longer ones (a GPU's) stop when a request arrives and are caught up on by ``schedule_recalibration``."""
    contexts = calibration_contexts(engine.max_context, engine.device)

    def run(cancel: threading.Event) -> Iterator[Any]:
        calibrate(engine, contexts[: len(START_CONTEXTS)])
        calibrate(engine, contexts[len(START_CONTEXTS) :], cancel=cancel)
        yield from ()

    return scheduler.submit_background(run, key=CALIBRATION_KEY)


class RecalibrationBackoff:
    """Holds back a recalibration that a request cut short: its length stays uncalibrated, so it is due again
    after the very next generation, and under steady traffic each try would be cut short too, the device
    redoing part of the same measurement between every two requests. After a cancel, a due length up to
    ``ratio`` times the cancelled one waits ``generations`` generations (those that found it due), then gets
    another try; a much longer one is queued at once. Counted in generations, not seconds: idle time lets a
    try finish anyway, traffic is what cuts it short. Thread-safe (jobs record, requests ask)."""

    def __init__(self, generations: int = RECALIBRATE_BACKOFF) -> None:
        self.generations = generations
        self._lock = threading.Lock()
        self._length: int | None = None
        self._left = 0

    def cancelled(self, length: int) -> None:
        """A recalibration at ``length`` ended without recording it: hold that length back from now on."""
        with self._lock:
            self._length, self._left = length, self.generations

    def holds(self, length: int, ratio: float) -> bool:
        """After a generation that found ``length`` due: True if it is to wait (one generation of the wait
        is spent)."""
        with self._lock:
            if self._length is None or self._left <= 0 or length > ratio * self._length:
                return False
            self._left -= 1
            return True


def schedule_recalibration(engine: Engine, scheduler: GenerationScheduler, ratio: float = RECALIBRATE_RATIO,
                           backoff: RecalibrationBackoff | None = None) -> int | None:
    """After a generation: if requests have run on caches more than ``ratio`` times the longest calibrated
    one (``BudgetPolicy.calibration_due``), queue a calibration at that length as a background job (run when
    no generation waits, stopped when one arrives), unless ``backoff`` holds it back after a cancelled one
    (which the job then reports to it). Returns the length queued, None if none was."""
    length = engine.policy.calibration_due(ratio)
    if length is None or (backoff is not None and backoff.holds(length, ratio)):
        return None

    def run(cancel: threading.Event) -> Iterator[Any]:
        calibrate(engine, (length,), cancel=cancel)
        if backoff is not None and engine.policy.calibration_due(ratio) is not None:
            backoff.cancelled(length)  # cut short: still due
        yield from ()

    return length if scheduler.submit_background(run, key=CALIBRATION_KEY) else None
