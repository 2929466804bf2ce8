"""An estimate of how long a waiting generation waits before it starts, from the scheduler's own timings.

A question that waits for the engine is told its place in the queue (``Queued``); a place alone does not
say whether the wait is seconds or minutes, so the scheduler adds this estimate: what is left of the running
generation (a typical generation's duration less what it has run so far, never below zero) plus one typical
duration for each generation ahead in the queue. "Typical" is the median of the recent foreground
generations' durations: a median, not a mean, so that one very long answer (or one cut short) does not
swing every estimate. With nothing measured yet there is no estimate (``None``) rather than a guess.

Pure functions over the durations and the running job's elapsed time (no clock here), so they are tested
on literal sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median


def typical_duration_s(durations: Sequence[float]) -> float | None:
    """The median of the measured generation durations, or ``None`` when there are none."""
    return float(median(durations)) if durations else None


def wait_estimate_s(durations: Sequence[float], position: int, running_elapsed_s: float | None) -> float | None:
    """Seconds until the generation at ``position`` (1 runs next) starts, or ``None`` with nothing measured.

    ``running_elapsed_s`` is how long the generation now on the engine has run (``None`` when none runs,
    e.g. a background warm-up that gives way to questions). A running generation past the typical duration
    counts as about to end (0 s left): how much longer it takes is not knowable from the durations alone.
    """
    typical = typical_duration_s(durations)
    if typical is None:
        return None
    left = 0.0 if running_elapsed_s is None else max(typical - running_elapsed_s, 0.0)
    return left + typical * max(position - 1, 0)
