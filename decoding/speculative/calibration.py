"""Measuring what a verify forward costs on this hardware, for the budget policy (``decoding.speculative.budget``).

Kept apart from the engine: calibration runs the engine's forwards on random caches, it does not decode.
On a CPU the random cache is a prefill of random tokens (the quantized runtime writes its own cache layout);
on any other device it is random key/value rows written straight into the cache (``fill_random``): a GPU's
attention kernels are dense, so a verify costs the same whatever the rows hold, and a 128K-token prefill
would take seconds for nothing.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from decoding.cache.slot import SlotCache, fill_random
from decoding.runtime.interface import RowKernels
from decoding.speculative.metadata import SamplingMetadata
from decoding.speculative.prefill import drain
from decoding.speculative.tree import DraftTree

if TYPE_CHECKING:
    from decoding.speculative.engine import Engine

logger = logging.getLogger(__name__)


def calibrate(
    engine: Engine,
    contexts: Sequence[int] = (256, 2048),
    repeats: int = 3,
    cancel: threading.Event | None = None,
    fill: bool | None = None,
) -> dict[int, float]:
    """Measure the verify cost per budget bucket of ``engine.policy`` on random caches of each length in
    ``contexts`` and hand them to the policy (which then follows a request's cache length between and
    beyond them). Returns the costs at the longest context measured.

    On a CPU, attention makes a verify's cost relative to a plain step grow with the context. Buckets are
    measured round-robin, ``repeats`` times each, and the median kept, so a burst of load from elsewhere on
    the machine hits every bucket alike instead of skewing one. ``cancel`` (set when a request arrives)
    stops it between prefill chunks and between measurements; a length cut short teaches the policy nothing.
    ``fill``: random rows instead of a prefill (see the module); None decides by the engine's device.
    The first calibration of an engine first picks the runtime's row kernels (``choose_row_kernels``).
    """
    costs: dict[int, float] = {}
    if not engine.policy.calibrated_contexts():  # the first calibration: the kernels first, the costs on them
        choose_row_kernels(engine, repeats, cancel)
    for context_tokens in contexts:
        measured = _verify_costs(engine, context_tokens, engine.policy.buckets, repeats, cancel, fill)
        if measured is None:
            logger.info("verify cost calibration at a %d-token cache cancelled", context_tokens)
            break
        base, medians = measured
        costs = engine.policy.calibrate(medians.__getitem__, context=base)
        logger.info("verify cost by draft nodes at a %d-token cache (s): %s", base,
                    {k: round(v, 4) for k, v in medians.items()})
    return costs


ROW_KERNEL_CONTEXT = 64  # cache tokens while the row kernels are timed: the matrix products differ, not attention


def choose_row_kernels(engine: Engine, repeats: int = 3, cancel: threading.Event | None = None) -> list[bool] | None:
    """Where the runtime has two interchangeable kernels for its matrix products (``RowKernels``: the same bits,
    which is faster depends on the CPU and the row count: docs/benchmarks.md#decoding), time a verify of every row
    count the choice keys under each, round-robin, ``repeats`` rounds with the two alternating first, and keep the
    faster median per row count. Returns the choice set, or None where there is none or ``cancel`` was set (the
    choice is then as it was)."""
    model = engine.model
    if not isinstance(model, RowKernels):
        return None
    start = model.row_kernels()
    n = len(start)
    if not n:
        return None
    last = max(engine.policy.buckets[-1], n - 2)  # the last entry's (that many rows or more): the widest verify
    sizes = [*range(n - 2), last]  # draft nodes: rows 1 .. n - 2, then the last entry's
    times: dict[bool, dict[int, list[float]]] = {False: {s: [] for s in sizes}, True: {s: [] for s in sizes}}
    vocab = model.vocab_size
    context = max(1, min(ROW_KERNEL_CONTEXT, engine.max_context - last - 2))  # a small window holds the widest too
    gen = torch.Generator().manual_seed(ROW_KERNEL_CONTEXT)
    ctx = torch.randint(0, vocab, (context,), generator=gen).tolist()
    with torch.inference_mode():
        cache = model.new_cache(context + last + 2)
        engine.prefill(ctx, cache)
        for round_ in range(repeats):
            for pairs in (round_ % 2 == 0, round_ % 2 == 1):
                model.row_kernels([pairs] * n)
                got = time_verifies(engine, cache, ctx[-1], sizes, 1, gen, cancel)
                if got is None:
                    model.row_kernels(start)
                    return None
                for size, seconds in got.items():
                    times[pairs][size].append(seconds)
    faster = {size: statistics.median(times[True][size]) < statistics.median(times[False][size]) for size in sizes}
    choice = [start[0], *(faster[size] for size in sizes[:-1]), faster[last]]
    model.row_kernels(choice)
    logger.info("row kernels: pairs of weight groups for %s of %d rows (+ = or more)",
                [m if m < n - 1 else f"{m}+" for m in range(1, n) if choice[m]] or "none", n - 1)
    return choice


def verify_costs(
    engine: Engine, context_tokens: int, sizes: Sequence[int], repeats: int = 3, fill: bool | None = None
) -> tuple[int, dict[int, float]]:
    """Median seconds of a verify forward over a chain of each size in ``sizes`` (0: a plain decoding step)
    on a random ``context_tokens``-token cache (clamped to the window; ``fill`` as in ``calibrate``), sizes
    measured round-robin. Returns (the cache length used, {size: seconds})."""
    measured = _verify_costs(engine, context_tokens, sizes, repeats, None, fill)
    assert measured is not None  # nothing to cancel it
    return measured


def _verify_costs(
    engine: Engine,
    context_tokens: int,
    sizes: Sequence[int],
    repeats: int,
    cancel: threading.Event | None,
    fill: bool | None,
) -> tuple[int, dict[int, float]] | None:
    """``verify_costs``, or None if ``cancel`` was set on the way."""
    vocab = engine.model.vocab_size
    longest = engine.max_context - max(sizes) - 2
    context_tokens = max(1, min(context_tokens, longest))
    if fill is None:
        fill = engine.device.type != "cpu"
    gen = torch.Generator().manual_seed(context_tokens)
    with torch.inference_mode():
        cache = engine.model.new_cache(context_tokens + max(sizes) + 2)
        if fill:
            rows = torch.Generator(engine.device).manual_seed(context_tokens)
            fill_random(cache, engine.model.config, context_tokens, engine.model.dtype, engine.device, rows)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)  # the writes are not part of the first verify's time
            root = int(torch.randint(0, vocab, (1,), generator=gen))
        else:
            ctx = torch.randint(0, vocab, (context_tokens,), generator=gen).tolist()
            root = int(ctx[-1])
            if cancel is None:
                engine.prefill(ctx, cache)
            elif drain(engine.reader.read(ctx, [], None, cache, cancel)).last is None:
                return None  # cancelled during the prefill (no prefix key: nothing is cached)
        costs = time_verifies(engine, cache, root, sizes, repeats, gen, cancel)
    return None if costs is None else (cache.length, costs)


def time_verifies(
    engine: Engine,
    cache: SlotCache,
    root: int,
    sizes: Sequence[int],
    repeats: int,
    gen: torch.Generator,
    cancel: threading.Event | None = None,
) -> dict[int, float] | None:
    """Median seconds of a verify forward over a random chain of each size in ``sizes`` after ``root`` on
    ``cache`` (left as it was), sizes round-robin after one untimed round (a size's first forward touches its
    cache rows and scratch memory for the first time: timed cold, a size looks dearer than it is);
    None if ``cancel`` was set on the way."""
    vocab = engine.model.vocab_size
    base = cache.length
    times: dict[int, list[float]] = {b: [] for b in sizes}
    with torch.inference_mode():
        for round_ in range(repeats + 1):
            for nodes, seen in times.items():
                if cancel is not None and cancel.is_set():
                    return None
                chain = DraftTree.chain(torch.randint(0, vocab, (nodes,), generator=gen).tolist(), "calibration")
                t = time.perf_counter()
                engine.verify(root, chain, cache, SamplingMetadata())  # a greedy step
                if round_:
                    seen.append(time.perf_counter() - t)
                cache.truncate(base)
    return {b: statistics.median(v) for b, v in times.items()}
