"""Many generations, one forward: concurrent generations' target forwards run as one batched forward.

Every generation keeps its own thread and its own code path (``Engine.generate`` is unchanged at batch 1): it
calls the target forward as it would alone, and ``ForwardBatcher.forward`` holds the call until every generation
that is *present* (running engine code, not handing an event to its reader) waits on a forward too, then one of
the waiting threads runs all of them in one ``forward_batch`` and each takes its own logits. Sequences join and
leave at forward boundaries; a sequence busy elsewhere (drafting, a slow reader) never blocks the others beyond
its own host work, and a finished, failed or cancelled one simply stops being present.

Rows stay what they are alone: the CPU runtime's row math is batch-invariant, so a sequence's logits do not
depend on its neighbours, and greedy or seeded answers are the same at any batch size.

A causal forward of many rows (a prompt chunk) goes in slices: alone it takes up to ``solo_rows`` rows a batch;
beside others at most ``prefill_rows``, so a newcomer's prompt adds a bounded number of rows to everyone's step
and its tokens interleave with theirs. A tree forward (a step's root and draft nodes) goes whole.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from decoding.runtime.interface import BatchItem

RunBatch = Callable[[Sequence[BatchItem]], list[torch.Tensor]]


@dataclass(eq=False)
class _Call:
    """One waiting forward: its item, the rows already run (causal slices) and, once done, its logits or error."""

    item: BatchItem
    rows: int
    keep: int  # rows whose logits are returned (the last ``keep``)
    done_rows: int = 0
    kept: list[torch.Tensor] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False
    batch_size: int = 0  # sequences in the last batch this call rode in


@dataclass
class BatchStats:
    """Counters for metrics: batched forwards run, the sequences and rows in them, and prefill rows among them."""

    forwards: int = 0
    sequences: int = 0
    rows: int = 0
    prefill_rows: int = 0
    last_sequences: int = 0
    last_rows: int = 0
    last_s: float = 0.0  # wall time of the last batched forward
    seconds: float = 0.0  # wall time of all of them


class ForwardBatcher:
    """Runs the forwards of the generations present at once as one batch (``run_batch``: ``forward_batch``)."""

    def __init__(self, run_batch: RunBatch, solo_rows: int = 128, prefill_rows: int = 64) -> None:
        if solo_rows < 1 or prefill_rows < 1:
            raise ValueError("solo_rows and prefill_rows must be >= 1")
        self._run_batch = run_batch
        self.solo_rows = solo_rows
        self.prefill_rows = prefill_rows
        self._cond = threading.Condition()
        self._present = 0  # threads running engine code (joined and not away)
        self._pending: list[_Call] = []
        self._busy = False  # a batch is running
        self._local = threading.local()
        self.stats = BatchStats()

    # ---- presence -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """The calling thread takes part in batches (nested joins count once)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            self._arrive()
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                self._leave()

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """The calling thread steps out (e.g. to hand an event to its reader): batches no longer wait for it."""
        if not getattr(self._local, "depth", 0):
            yield
            return
        self._leave()
        try:
            yield
        finally:
            self._arrive()

    def _arrive(self) -> None:
        with self._cond:
            self._present += 1

    def _leave(self) -> None:
        with self._cond:
            self._present -= 1
            self._cond.notify_all()  # the others may all be waiting now

    @property
    def present(self) -> int:
        with self._cond:
            return self._present

    def last_batch_size(self) -> int:
        """Sequences in the last batch the calling thread's forward rode in (1: it ran alone)."""
        return int(getattr(self._local, "batch_size", 1))

    # ---- forwards -----------------------------------------------------------------------------------------

    def forward(self, item: BatchItem) -> torch.Tensor:
        """``item``'s kept logits ``[keep, V]``, computed in a batch with whatever else is waiting."""
        rows = int(item.input_ids.numel())
        keep = rows if not item.logits_to_keep else min(int(item.logits_to_keep), rows)
        call = _Call(item, rows, keep)
        with self.joined(), self._cond:
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                if not self._busy and len(self._pending) >= self._present:
                    self._lead_locked()
                else:
                    self._cond.wait()
        self._local.batch_size = call.batch_size
        if call.error is not None:
            raise call.error
        return call.kept[0] if len(call.kept) == 1 else torch.cat(call.kept)

    def _lead_locked(self) -> None:
        """Run one batch of the pending calls (the lock is released while it computes)."""
        self._busy = True
        calls = list(self._pending)
        items = [self._slice(call, len(calls)) for call in calls]
        self._cond.release()
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            logits = self._run_batch([item for item, _ in items])
        except BaseException as exc:  # every call of the batch fails with it; the batcher keeps serving
            error, logits = exc, []
        finally:
            self._cond.acquire()
        try:
            self._record(calls, items, time.perf_counter() - t0)
            for i, (call, (item, kept_rows)) in enumerate(zip(calls, items, strict=True)):
                call.batch_size = len(calls)
                if error is not None:
                    call.error = error
                else:
                    call.done_rows += int(item.input_ids.numel())
                    if kept_rows:
                        call.kept.append(logits[i][-kept_rows:])
                if error is not None or call.done_rows == call.rows:
                    call.done = True
                    self._pending.remove(call)
        finally:
            self._busy = False
            self._cond.notify_all()

    def _slice(self, call: _Call, batch: int) -> tuple[BatchItem, int]:
        """The part of ``call`` this batch runs, and how many of its rows' logits are kept."""
        item, left = call.item, call.rows - call.done_rows
        if item.attention_mask is not None:  # a tree goes whole
            return item, call.keep
        cap = self.solo_rows if batch == 1 else self.prefill_rows
        take = min(left, cap)
        if take == call.rows:
            return item, call.keep
        a, b = call.done_rows, call.done_rows + take
        ids = item.input_ids.reshape(-1)[a:b]
        pos = None if item.position_ids is None else item.position_ids.reshape(-1)[a:b]
        kept = max(0, b - (call.rows - call.keep))  # rows of this slice among the last ``keep``
        return BatchItem(ids, item.cache, pos, None, kept or 1), kept

    def _record(self, calls: list[_Call], items: list[tuple[BatchItem, int]], seconds: float) -> None:
        s = self.stats
        rows = [int(item.input_ids.numel()) for item, _ in items]
        s.forwards += 1
        s.sequences += len(calls)
        s.rows += sum(rows)
        s.prefill_rows += sum(r for (item, _), r in zip(items, rows, strict=True)
                              if item.attention_mask is None and r > 1)
        s.last_sequences, s.last_rows, s.last_s = len(calls), sum(rows), seconds
        s.seconds += seconds
