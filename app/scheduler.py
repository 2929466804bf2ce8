"""One generation at a time per engine, behind a bounded queue, bridged from a worker thread to asyncio.

The engine's ``generate`` is a synchronous generator; the worker thread iterates it and hands every event
to the request's event loop (``call_soon_threadsafe`` into an ``asyncio.Queue``). Past ``queue_size``
waiting generations, ``submit`` raises ``Overloaded`` (429 with Retry-After). A request that goes away
sets its cancel event: a waiting job leaves the queue at once, a running one stops within one decode step.
A job that has to wait gets a ``Queued`` event first and another each time its place in the queue changes,
so a stream can tell its client where it stands before the first token, with an estimate of the wait
(``app.queue_wait``) once a generation has been timed: only foreground generations that ran to their end
are timed (not warm-ups or calibrations, nor jobs cut short or failed), on the injectable ``clock``.

Background jobs (warming a document's KV prefix) run only when no generation waits, never count against
the queue, and a running one is asked to stop when a generation for another prefix arrives.
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

from app.errors import Overloaded
from app.queue_wait import wait_estimate_s

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
    def __init__(self, queue_size: int, name: str = "generation",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queue_size = queue_size
        self._clock = clock
        self._started_at = 0.0  # when the running job started, on ``clock``
        self._waiting: deque[Job] = deque()
        self._background: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._durations: deque[float] = deque(maxlen=32)
        self.completed = 0
        self.rejected = 0
        self._thread = threading.Thread(target=self._work, name=f"ragspec-{name}", daemon=True)
        self._thread.start()

    # --- observation -------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> bool:
        with self._cond:
            return self._running is not None and not self._running.background

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # --- submission --------------------------------------------------------------------------------
    def submit(self, run: RunFn, key: str | None = None) -> JobHandle:
        """Queue a generation (call from the event loop). Raises ``Overloaded`` when the queue is full."""
        loop = asyncio.get_running_loop()
        job = Job(run=run, key=key, background=False, loop=loop, queue=asyncio.Queue())
        with self._cond:
            self._refuse_if_full_locked()
            running = self._running
            if self._waiting or (running is not None and not running.background):  # it has to wait
                job.push(self._queued_locked(len(self._waiting) + 1, self._running_elapsed_locked()))
            self._waiting.append(job)
            if running is not None and running.background and running.key != key:
                running.cancel.set()  # a warm-up never holds up a question on another document
            self._cond.notify_all()
        return JobHandle(job, self)

    def ensure_room(self) -> None:
        """Raise ``Overloaded`` now if ``submit`` would refuse (a cheap check before preparing a request)."""
        with self._cond:
            self._refuse_if_full_locked()

    def _refuse_if_full_locked(self) -> None:
        if self._stopping:
            raise Overloaded("the service is shutting down", retry_after_s=5)
        busy = self._running is not None and not self._running.background
        if len(self._waiting) + (1 if busy else 0) >= self.queue_size + 1:
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
            if any(j.key == key for j in self._background) or (
                self._running is not None and self._running.background and self._running.key == key
            ):
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
        """How long the running generation has run; ``None`` when none runs (or only a background job)."""
        running = self._running
        if running is None or running.background:
            return None
        return max(self._clock() - self._started_at, 0.0)

    def _queued_locked(self, position: int, running_elapsed_s: float | None) -> Queued:
        eta = wait_estimate_s(self._durations, position, running_elapsed_s)
        return Queued(position, None if eta is None else round(eta, 1))

    def _announce_locked(self, start: int, running_elapsed_s: float | None) -> None:
        """Tell the waiting jobs from index ``start`` on their new places (one ahead of them left)."""
        for place in range(start, len(self._waiting)):
            self._waiting[place].push(self._queued_locked(place + 1, running_elapsed_s))

    def _next_locked(self) -> Job | None:
        """Take the next job and mark it running (started now); the waiting jobs hear their new places."""
        job = self._waiting.popleft() if self._waiting else self._background.popleft() if self._background else None
        if job is not None:
            self._running, self._started_at = job, self._clock()
            if not job.background:
                self._announce_locked(0, 0.0)
        return job

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
                self._running = None
                if not job.background:
                    if failure is None and not job.cancel.is_set():  # a whole generation: it times the next
                        self._durations.append(self._clock() - self._started_at)
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
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        self._thread.join(timeout)
