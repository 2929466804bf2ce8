"""The generation queue: one job at a time, bounded waiting, cancellation frees the slot, errors reach
the caller. Jobs here are small generator functions driven by threading events (no sleeps, no timing)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from app.errors import Overloaded, PayloadTooLarge
from app.serving.scheduler import GenerationScheduler, Queued


def gated(gate: threading.Event, started: threading.Event, steps: int = 3):  # type: ignore[no-untyped-def]
    """A job that yields ``steps`` events, each after ``gate`` opens, stopping early on cancel."""

    def run(cancel: threading.Event) -> Iterator[str]:
        started.set()
        for i in range(steps):
            while not gate.wait(0.01):
                if cancel.is_set():
                    yield "cancelled"
                    return
            yield f"e{i}"

    return run


def instant(label: str):  # type: ignore[no-untyped-def]
    def run(cancel: threading.Event) -> Iterator[str]:
        yield label

    return run


async def collect(handle) -> list[str]:  # type: ignore[no-untyped-def]
    return [e async for e in handle.events()]


def test_runs_jobs_in_order_and_rejects_past_the_queue() -> None:
    async def main() -> None:
        sched = GenerationScheduler(queue_size=1)
        try:
            gate, started = threading.Event(), threading.Event()
            first = sched.submit(gated(gate, started))
            await asyncio.to_thread(started.wait, 5)
            second = sched.submit(instant("second"))  # waits: the queue holds one
            assert sched.waiting == 1 and sched.running
            with pytest.raises(Overloaded) as info:
                sched.submit(instant("third"))
            assert info.value.status == 429 and int(info.value.headers["Retry-After"]) >= 1
            gate.set()
            assert await collect(first) == ["e0", "e1", "e2"]
            assert await collect(second) == [Queued(1), "second"]  # it waited, first in line
            assert sched.rejected == 1 and sched.completed == 2
        finally:
            sched.stop()

    asyncio.run(main())


def test_cancel_running_job_frees_the_slot() -> None:
    async def main() -> None:
        sched = GenerationScheduler(queue_size=0)
        try:
            gate, started = threading.Event(), threading.Event()
            handle = sched.submit(gated(gate, started))
            await asyncio.to_thread(started.wait, 5)
            with pytest.raises(Overloaded):
                sched.submit(instant("blocked"))
            handle.cancel()
            assert await collect(handle) == ["cancelled"]
            # the worker has finished the cancelled job once its stream ended: the slot is free
            assert await collect(sched.submit(instant("next"))) == ["next"]
        finally:
            sched.stop()

    asyncio.run(main())


def test_cancel_waiting_job_leaves_the_queue_at_once() -> None:
    async def main() -> None:
        sched = GenerationScheduler(queue_size=1)
        try:
            gate, started = threading.Event(), threading.Event()
            running = sched.submit(gated(gate, started))
            await asyncio.to_thread(started.wait, 5)
            waiting = sched.submit(instant("never"))
            waiting.cancel()
            assert sched.waiting == 0
            assert await collect(waiting) == [Queued(1)]  # where it stood, then the end: it never ran
            queued = sched.submit(instant("after"))  # the freed place is usable while job 1 still runs
            gate.set()
            assert await collect(running) == ["e0", "e1", "e2"]
            assert await collect(queued) == [Queued(1), "after"]
        finally:
            sched.stop()

    asyncio.run(main())


def test_waiting_jobs_hear_their_place_in_the_queue() -> None:
    """A job submitted to an idle engine starts without a ``Queued`` event; one that waits hears its place
    at once, and again each time a job ahead of it starts or leaves the queue, until it runs."""

    async def main() -> None:
        sched = GenerationScheduler(queue_size=3)
        try:
            gate, started = threading.Event(), threading.Event()
            first = sched.submit(gated(gate, started, steps=1))
            await asyncio.to_thread(started.wait, 5)
            gate2, started2 = threading.Event(), threading.Event()
            second = sched.submit(gated(gate2, started2, steps=1))
            third = sched.submit(instant("third"))
            fourth = sched.submit(instant("fourth"))
            third.cancel()  # leaves the queue: the fourth moves up
            gate.set()  # the first ends; the second starts: the fourth moves up again
            assert await collect(first) == ["e0"]
            await asyncio.to_thread(started2.wait, 5)
            gate2.set()
            assert await collect(second) == [Queued(1), "e0"]
            assert await collect(third) == [Queued(2)]
            events = await collect(fourth)  # the first's end was timed: later places carry an estimate
            assert [e.position if isinstance(e, Queued) else e for e in events] == [3, 2, 1, "fourth"]
        finally:
            sched.stop()

    asyncio.run(main())


def test_abandoned_iteration_cancels_the_job() -> None:
    async def main() -> None:
        sched = GenerationScheduler(queue_size=0)
        try:
            def run(cancel: threading.Event) -> Iterator[str]:
                yield "e0"
                while not cancel.wait(0.01):  # runs until cancelled (a job that ends first cancels nothing)
                    pass

            handle = sched.submit(run)
            events = handle.events()
            assert await events.__anext__() == "e0"
            await events.aclose()  # what a disconnected client's stream does
            assert handle.cancel_event.is_set()
        finally:
            sched.stop()

    asyncio.run(main())


def test_job_error_reaches_the_caller_and_the_worker_survives() -> None:
    def failing(cancel: threading.Event) -> Iterator[str]:
        yield "partial"
        raise RuntimeError("boom")

    async def main() -> None:
        sched = GenerationScheduler(queue_size=0)
        try:
            got: list[str] = []
            with pytest.raises(RuntimeError, match="boom"):
                async for e in sched.submit(failing).events():
                    got.append(e)
            assert got == ["partial"]
            assert await collect(sched.submit(instant("ok"))) == ["ok"]
        finally:
            sched.stop()

    asyncio.run(main())


def test_background_job_runs_when_idle_and_yields_to_generations() -> None:
    async def main() -> None:
        sched = GenerationScheduler(queue_size=0)
        try:
            ran: list[str] = []
            warm_started, warm_cancelled = threading.Event(), threading.Event()

            def warm(cancel: threading.Event) -> Iterator[str]:
                warm_started.set()
                while not cancel.wait(0.01):
                    pass
                warm_cancelled.set()
                ran.append("warm")
                return
                yield ""

            assert sched.submit_background(warm, key="doc-a")
            assert not sched.submit_background(warm, key="doc-a")  # de-duplicated while running
            await asyncio.to_thread(warm_started.wait, 5)
            # a generation for another prefix asks the warm-up to stop and is not refused
            assert await collect(sched.submit(instant("answer"), key="doc-b")) == ["answer"]
            assert warm_cancelled.is_set() and ran == ["warm"]
        finally:
            sched.stop()

    asyncio.run(main())


def test_slots_run_jobs_at_once_within_the_memory_pool() -> None:
    """Two slots and a pool of 10 bytes: two jobs of 4 run together; a job of 8 waits at the head of the queue
    for a slot, then for room in the pool, and the small job behind it does not overtake it; a job of 11 could
    never fit: refused at once (413); the start hook hears every wait."""

    async def main() -> None:
        waits: list[float] = []
        sched = GenerationScheduler(queue_size=4, slots=2, pool_bytes=10, on_start=waits.append)
        try:
            gates = [threading.Event() for _ in range(4)]
            starts = [threading.Event() for _ in range(4)]
            a = sched.submit(gated(gates[0], starts[0], steps=1), kv_bytes=4)
            b = sched.submit(gated(gates[1], starts[1], steps=1), kv_bytes=4)
            assert await asyncio.to_thread(starts[0].wait, 5) and await asyncio.to_thread(starts[1].wait, 5)
            assert sched.running_count == 2
            big = sched.submit(gated(gates[2], starts[2], steps=1), kv_bytes=8)  # no slot now
            small = sched.submit(instant("small"), kv_bytes=1)  # fits, but never overtakes the head
            with pytest.raises(PayloadTooLarge) as info:
                sched.submit(instant("never"), kv_bytes=11)
            assert info.value.status == 413
            gates[0].set()
            assert await collect(a) == ["e0"]
            assert not starts[2].is_set() and sched.waiting == 2  # a slot is free, the pool is not: 4 + 8 > 10
            gates[1].set()
            assert await collect(b) == ["e0"]
            assert await asyncio.to_thread(starts[2].wait, 5)  # alone now: it starts
            assert await collect(small) == [Queued(2), "small"]  # then it fits beside the big one: no wait left
            gates[2].set()
            assert await collect(big) == [Queued(1), "e0"]
            assert len(waits) == 4 and sched.completed == 4
        finally:
            sched.stop()

    asyncio.run(main())
