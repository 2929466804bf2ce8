"""Generations on the engine, ``slots`` at once, behind a bounded queue, bridged from worker threads to asyncio.

The engine's ``generate`` is a synchronous generator; a worker thread iterates it and hands every event to the
request's event loop (``call_soon_threadsafe`` into an ``asyncio.Queue``). Up to ``slots`` generations run at
once, each in its own worker: on the CPU runtime their forwards share one batched forward
(``decoding.speculative.batching``). A generation starts when a slot is free and its KV (``kv_bytes``) fits the
working pool (``pool_bytes``) beside the running ones; in arrival order, so a large request is not overtaken
for ever. One that could never fit the pool is refused at once (``Overloaded`` would only make it retry).
Past ``queue_size`` waiting generations, ``submit`` raises ``Overloaded`` (429 with Retry-After). A request
that goes away sets its cancel event: a waiting job leaves the queue at once, a running one stops within one
decode step. A job that has to wait gets a ``Queued`` event first and another each time its place in the queue
changes, so a stream can tell its client where it stands before the first token, with an estimate of the wait
(``app.serving.queue_wait``) once a generation has been timed: only foreground generations that ran to their end are
timed (not warm-ups or calibrations, nor jobs cut short or failed), on the injectable ``clock``.

Background jobs (warming a document's KV prefix, calibrating) run alone: only when no generation runs or waits,
never count against the queue, and a running one is asked to stop when a generation for another prefix arrives.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from app.errors import Overloaded, PayloadTooLarge
from app.serving.queue_wait import wait_estimate_s

logger = logging.getLogger(__name__)

RunFn = Callable[[threading.Event], Iterator[Any]]


class _End:
    """Marks the end of a job's event stream (after its last event, or when it never ran)."""


@dataclass(frozen=True)
class Queued:
    """A waiting generation's place in the queue (``position`` 1 runs next) and the estimated seconds until
    it starts (``eta_s``; ``None`` until a generation has been timed)."""

    position: int
    eta_s: float | None = None


@dataclass
class _Failure:
    exc: BaseException


@dataclass(eq=False)
class Job:
    run: RunFn
    key: str | None
    background: bool
    loop: asyncio.AbstractEventLoop | None
    cancel: threading.Event = field(default_factory=threading.Event)
    queue: asyncio.Queue[Any] | None = None
    finished: bool = False
    kv_bytes: int = 0  # the working memory it holds while it runs
    submitted_at: float = 0.0
    started_at: float = 0.0

    def push(self, item: Any) -> None:
        if self.loop is None or self.queue is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the request's loop is closed: nobody is listening any more
            self.cancel.set()


class JobHandle:
    """What ``submit`` returns: iterate ``events()``; ``cancel()`` is idempotent and safe after the end."""

    def __init__(self, job: Job, scheduler: GenerationScheduler) -> None:
        self._job = job
        self._scheduler = scheduler

    @property
    def cancel_event(self) -> threading.Event:
        return self._job.cancel

    def cancel(self) -> None:
        self._scheduler.cancel(self._job)

    async def events(self) -> AsyncGenerator[Any, None]:
        assert self._job.queue is not None
        try:
            while True:
                item = await self._job.queue.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            if not self._job.finished:
                self.cancel()


class GenerationScheduler:
    def __init__(self, queue_size: int, name: str = "generation", clock: Callable[[], float] = time.monotonic,
                 slots: int = 1, pool_bytes: int | None = None,
                 on_start: Callable[[float], None] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.queue_size = queue_size
        self.slots = slots
        self.pool_bytes = pool_bytes
        self._on_start = on_start  # told each generation's wait in the queue (seconds) as it starts
        self._clock = clock
        self._waiting: deque[Job] = deque()
        self._background: deque[Job] = deque()
        self._running: list[Job] = []  # foreground generations, oldest first
        self._running_background: Job | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._durations: deque[float] = deque(maxlen=32)
        self.completed = 0
        self.rejected = 0
        self._threads = [threading.Thread(target=self._work, name=f"ragspec-{name}-{i}", daemon=True)
                         for i in range(slots)]
        for thread in self._threads:
            thread.start()

    # --- observation -------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> bool:
        with self._cond:
            return bool(self._running)

    @property
    def running_count(self) -> int:
        with self._cond:
            return len(self._running)

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and not self._stopping

    # --- submission --------------------------------------------------------------------------------
    def submit(self, run: RunFn, key: str | None = None, kv_bytes: int = 0) -> JobHandle:
        """Queue a generation holding ``kv_bytes`` of working memory while it runs (call from the event loop).
        Raises ``Overloaded`` when the queue is full, ``PayloadTooLarge`` when it could never fit the pool."""
        loop = asyncio.get_running_loop()
        self.check_fits(kv_bytes)
        job = Job(run=run, key=key, background=False, loop=loop, queue=asyncio.Queue(), kv_bytes=kv_bytes,
                  submitted_at=self._clock())
        with self._cond:
            self._refuse_if_full_locked()
            self._waiting.append(job)
            if not self._starts_now_locked(job):  # it has to wait
                job.push(self._queued_locked(len(self._waiting), self._running_elapsed_locked()))
            background = self._running_background
            if background is not None and background.key != key:
                background.cancel.set()  # a warm-up never holds up a question on another document
            self._cond.notify_all()
        return JobHandle(job, self)

    def check_fits(self, kv_bytes: int) -> None:
        """Raise ``PayloadTooLarge`` if a generation holding ``kv_bytes`` could never run in the pool."""
        if self.pool_bytes is not None and kv_bytes > self.pool_bytes:
            raise PayloadTooLarge(
                f"this request needs {kv_bytes / 2**20:.0f} MiB of KV cache, more than the working pool's "
                f"{self.pool_bytes / 2**20:.0f} MiB (RAGSPEC_KV_POOL_BYTES): ask for fewer tokens or a shorter context"
            )

    def ensure_room(self) -> None:
        """Raise ``Overloaded`` now if ``submit`` would refuse (a cheap check before preparing a request)."""
        with self._cond:
            self._refuse_if_full_locked()

    def _refuse_if_full_locked(self) -> None:
        if self._stopping:
            raise Overloaded("the service is shutting down", retry_after_s=5)
        free = max(self.slots - len(self._running), 0)
        if len(self._waiting) >= self.queue_size + free:
            self.rejected += 1
            raise Overloaded(
                f"{len(self._waiting)} generations wait (queue size {self.queue_size}); retry later",
                retry_after_s=self._retry_after_locked(),
            )

    def _retry_after_locked(self) -> int:
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return min(120, max(1, math.ceil(mean * (len(self._waiting) + 1))))

    def submit_background(self, run: RunFn, key: str) -> bool:
        """Queue a background job (KV warm-up) unless one with the same key is queued or running."""
        with self._cond:
            if self._stopping:
                return False
            running = self._running_background
            if any(j.key == key for j in self._background) or (running is not None and running.key == key):
                return False
            self._background.append(Job(run=run, key=key, background=True, loop=None))
            self._cond.notify_all()
        return True

    def cancel(self, job: Job) -> None:
        job.cancel.set()
        with self._cond:
            if job in self._waiting:  # never started: leave the queue now and free the slot
                place = self._waiting.index(job)
                self._waiting.remove(job)
                job.finished = True
                job.push(_End())
                self._announce_locked(place, self._running_elapsed_locked())

    # --- worker ------------------------------------------------------------------------------------
    def _running_elapsed_locked(self) -> float | None:
        """How long the oldest running generation has run; ``None`` when none runs (or only a background job)."""
        if not self._running:
            return None
        return max(self._clock() - self._running[0].started_at, 0.0)

    def _queued_locked(self, position: int, running_elapsed_s: float | None) -> Queued:
        # ``slots`` generations leave the queue per typical duration
        eta = wait_estimate_s(self._durations, math.ceil(position / self.slots), running_elapsed_s)
        return Queued(position, None if eta is None else round(eta, 1))

    def _announce_locked(self, start: int, running_elapsed_s: float | None) -> None:
        """Tell the waiting jobs from index ``start`` on their new places (one ahead of them left)."""
        for place in range(start, len(self._waiting)):
            job = self._waiting[place]
            if not self._starts_now_locked(job):  # one about to be taken by a free worker hears nothing
                job.push(self._queued_locked(place + 1, running_elapsed_s))

    def _fits_locked(self, job: Job, running: int, used: int) -> bool:
        """Whether ``job`` may start beside ``running`` generations holding ``used`` bytes: a free slot and room in
        the pool (a job alone always starts: ``submit`` refused what could never fit)."""
        if running >= self.slots:
            return False
        return self.pool_bytes is None or not running or used + job.kv_bytes <= self.pool_bytes

    def _starts_now_locked(self, job: Job) -> bool:
        """Whether ``job`` starts as soon as the workers take the queue in order (a warm-up gives way at once)."""
        running, used = len(self._running), sum(j.kv_bytes for j in self._running)
        for ahead in self._waiting:
            if not self._fits_locked(ahead, running, used):
                return False
            if ahead is job:
                return True
            running, used = running + 1, used + ahead.kv_bytes
        return False

    def _next_locked(self) -> Job | None:
        """Take the next job that may start and mark it running (started now); the waiting jobs hear their new
        places. Background jobs only when nothing runs or waits."""
        if self._waiting:
            job = self._waiting[0]
            if self._running_background is not None or not self._starts_now_locked(job):
                return None
            self._waiting.popleft()
            job.started_at = self._clock()
            self._running.append(job)
            if self._on_start is not None:
                self._on_start(job.started_at - job.submitted_at)
            self._announce_locked(0, self._running_elapsed_locked())
            return job
        if self._background and not self._running and self._running_background is None:
            job = self._background.popleft()
            self._running_background = job
            return job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next_locked()
                while job is None and not self._stopping:
                    self._cond.wait()
                    job = self._next_locked()
                if job is None:
                    return
            self._execute(job)

    def _execute(self, job: Job) -> None:
        failure: _Failure | None = None
        try:
            if not (job.background and job.cancel.is_set()):
                for event in job.run(job.cancel):
                    job.push(event)
        except BaseException as exc:  # reported to the request; the worker keeps serving
            if job.background:
                logger.warning("background job %s failed: %s", job.key, exc, exc_info=True)
            failure = _Failure(exc)
        finally:
            with self._cond:  # free the slot before the caller learns the job ended (or failed)
                if job.background:
                    self._running_background = None
                else:
                    self._running.remove(job)
                    if failure is None and not job.cancel.is_set():  # a whole generation: it times the next
                        self._durations.append(self._clock() - job.started_at)
                    self.completed += 1
                self._cond.notify_all()
            job.finished = True
            if failure is not None:
                job.push(failure)
            job.push(_End())

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for job in list(self._waiting):
                job.cancel.set()
                job.finished = True
                job.push(_End())
            self._waiting.clear()
            self._background.clear()
            for job in [*self._running, *filter(None, [self._running_background])]:
                job.cancel.set()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)
