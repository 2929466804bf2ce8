"""The wait estimate a queued generation hears: the pure estimator on literal durations, then the
scheduler's use of it on a hand-moved clock (jobs driven by threading events; no sleeps, no timing)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from app.serving.queue_wait import typical_duration_s, wait_estimate_s
from app.serving.scheduler import GenerationScheduler, Queued
from tests.app.test_scheduler import collect, gated, instant


def test_typical_duration_is_the_median_of_the_measured_ones() -> None:
    assert typical_duration_s([]) is None
    assert typical_duration_s([7.0]) == 7.0
    assert typical_duration_s([4.0, 60.0, 5.0]) == 5.0  # one long answer does not move it
    assert typical_duration_s([4.0, 5.0]) == 4.5


@pytest.mark.parametrize(("durations", "position", "elapsed", "expected"), [
    ([], 1, 2.0, None),  # nothing measured yet: no estimate
    ([], 3, None, None),
    ([4.0, 60.0, 5.0], 1, 2.0, 3.0),  # next in line: what is left of the running one
    ([4.0, 60.0, 5.0], 3, 2.0, 13.0),  # plus one typical generation per generation ahead
    ([4.0, 60.0, 5.0], 2, 9.0, 5.0),  # the running one is overdue: counted as about to end
    ([4.0, 60.0, 5.0], 2, None, 5.0),  # nothing (or only a warm-up) runs
    ([4.0, 5.0], 1, 0.0, 4.5),  # the running one has just started
])
def test_wait_estimate(durations: list[float], position: int, elapsed: float | None,
                       expected: float | None) -> None:
    assert wait_estimate_s(durations, position, elapsed) == expected


class Clock:
    """A clock the test moves by hand (the scheduler reads it from its worker thread)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_queued_events_carry_the_estimate_once_a_generation_has_been_timed() -> None:
    async def main() -> None:
        clock = Clock()
        sched = GenerationScheduler(queue_size=3, clock=clock)
        try:
            gate1, started1 = threading.Event(), threading.Event()
            first = sched.submit(gated(gate1, started1, steps=1))  # starts at 0
            await asyncio.to_thread(started1.wait, 5)
            gate2, started2 = threading.Event(), threading.Event()
            second = sched.submit(gated(gate2, started2, steps=1))  # nothing timed yet: no estimate
            clock.now = 4.0
            gate1.set()  # the first took 4 s; the second starts at 4
            assert await collect(first) == ["e0"]
            await asyncio.to_thread(started2.wait, 5)
            clock.now = 5.0
            third = sched.submit(instant("third"))  # 4 - 1 s left of the second
            fourth = sched.submit(instant("fourth"))  # and one 4 s generation ahead
            clock.now = 9.0
            third.cancel()  # the fourth moves up; the second (5 s so far) is overdue: about to end
            gate2.set()  # the second took 5 s: the median is now 4.5
            assert await collect(second) == [Queued(1, None), "e0"]
            assert await collect(third) == [Queued(1, 3.0)]
            assert await collect(fourth) == [Queued(2, 7.0), Queued(1, 0.0), "fourth"]
            assert sched.completed == 3
            gate3, started3 = threading.Event(), threading.Event()
            fifth = sched.submit(gated(gate3, started3, steps=1))  # starts at 9
            await asyncio.to_thread(started3.wait, 5)
            clock.now = 10.0
            sixth = sched.submit(instant("sixth"))  # timed so far: 4, 5 and the fourth's 0 s: median 4
            gate3.set()
            assert await collect(fifth) == ["e0"]
            assert await collect(sixth) == [Queued(1, 3.0), "sixth"]
        finally:
            sched.stop()

    asyncio.run(main())


def test_warm_ups_and_generations_cut_short_are_not_timed() -> None:
    """A background job (KV warm-up, calibration) and a cancelled generation leave no duration behind:
    the next question to wait still has no estimate."""

    async def main() -> None:
        clock = Clock()
        sched = GenerationScheduler(queue_size=2, clock=clock)
        try:
            warmed = threading.Event()

            def warm(cancel: threading.Event) -> Iterator[None]:
                clock.now += 30.0  # a long warm-up
                warmed.set()
                yield None

            assert sched.submit_background(warm, key="doc")
            await asyncio.to_thread(warmed.wait, 5)
            gate, started = threading.Event(), threading.Event()
            cut = sched.submit(gated(gate, started))
            await asyncio.to_thread(started.wait, 5)
            clock.now += 2.0
            cut.cancel()
            assert await collect(cut) == ["cancelled"]
            gate2, started2 = threading.Event(), threading.Event()
            running = sched.submit(gated(gate2, started2, steps=1))
            await asyncio.to_thread(started2.wait, 5)
            waiting = sched.submit(instant("waiting"))
            gate2.set()
            assert await collect(running) == ["e0"]
            assert await collect(waiting) == [Queued(1, None), "waiting"]
        finally:
            sched.stop()

    asyncio.run(main())
