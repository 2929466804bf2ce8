"""The kernels' one thread (``run_on_kernel_thread``): every forward of the quantized runtime runs there."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")


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
