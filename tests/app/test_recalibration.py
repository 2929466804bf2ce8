"""The served-length recalibration: only on CUDA (a CPU deploy never prefills a long cache between requests),
and held back for a number of generations after a request cut one short (counted, no clock)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.config import ServiceConfig
from app.services import Services
from app.serving.kv_tuning import RecalibrationBackoff, schedule_recalibration
from app.settings import Settings
from decoding.speculative.budget import BudgetPolicy
from decoding.speculative.calibration import calibrate
from decoding.speculative.engine import Engine
from tests.decoding.conftest import tiny_target


class JobList:
    """A scheduler that keeps the background jobs it is given; the test runs them when it wants."""

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def submit_background(self, run: Any, key: str) -> bool:
        self.jobs.append(run)
        return True


def due_engine(served: int = 300) -> Engine:
    """A CPU engine calibrated at 16 and 48 tokens whose requests ran on a ``served``-token cache."""
    engine = Engine(tiny_target(0, cpu_kernels=False), policy=BudgetPolicy(max_budget=4))
    calibrate(engine, contexts=(16, 48), repeats=1)
    engine.policy.observe_cost(0, 0.001, served)
    assert engine.policy.calibration_due() == served
    return engine


def run_job(job: Any, cancelled: bool) -> None:
    cancel = threading.Event()
    if cancelled:
        cancel.set()  # a request arrived
    events: Iterator[Any] = job(cancel)
    list(events)


def test_a_cancelled_recalibration_waits_some_generations_before_the_next_try() -> None:
    engine, scheduler = due_engine(), JobList()
    backoff = RecalibrationBackoff(generations=3)
    assert schedule_recalibration(engine, scheduler, backoff=backoff) == 300  # type: ignore[arg-type]
    run_job(scheduler.jobs.pop(), cancelled=True)
    assert 300 not in engine.policy.calibrated_contexts() and engine.policy.calibration_due() == 300
    for _ in range(3):  # due after each of the next generations, but held back
        assert schedule_recalibration(engine, scheduler, backoff=backoff) is None  # type: ignore[arg-type]
    assert not scheduler.jobs
    assert schedule_recalibration(engine, scheduler, backoff=backoff) == 300  # type: ignore[arg-type]
    run_job(scheduler.jobs.pop(), cancelled=False)
    assert 300 in engine.policy.calibrated_contexts()
    assert schedule_recalibration(engine, scheduler, backoff=backoff) is None  # type: ignore[arg-type]
    # without a backoff, a cut-short length is queued again after the very next generation
    again = due_engine()
    assert schedule_recalibration(again, scheduler) == 300  # type: ignore[arg-type]
    run_job(scheduler.jobs.pop(), cancelled=True)
    assert schedule_recalibration(again, scheduler) == 300  # type: ignore[arg-type]


def test_the_backoff_holds_back_only_lengths_near_the_cancelled_one() -> None:
    backoff = RecalibrationBackoff(generations=5)
    assert not backoff.holds(300, 1.5)  # nothing cancelled yet
    backoff.cancelled(300)
    assert backoff.holds(450, 1.5)  # within 1.5x: the same measurement, held back
    assert not backoff.holds(451, 1.5)  # much longer: a new one, queued at once (spends no wait)
    assert [backoff.holds(300, 1.5) for _ in range(5)] == [True, True, True, True, False]


@pytest.mark.parametrize(("device", "calibrate_setting", "queued"),
                         [("cpu", True, False), ("cuda", True, True), ("cuda", False, False)])
def test_recalibrate_if_due_runs_only_on_cuda(device: str, calibrate_setting: bool, queued: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    engine, scheduler = due_engine(), JobList()
    if device != "cpu":  # the device the guard reads; the job is only queued here, never run
        monkeypatch.setattr(Engine, "device", property(lambda self: torch.device(device)))
    config = ServiceConfig.from_settings(Settings(calibrate=calibrate_setting))  # type: ignore[call-arg]
    services = SimpleNamespace(config=config, engine=engine, scheduler=scheduler, recalibration=RecalibrationBackoff())
    Services.recalibrate_if_due(services)  # type: ignore[arg-type]
    assert len(scheduler.jobs) == (1 if queued else 0)
    assert engine.policy.calibration_due() == 300  # due all along: the device (and setting) decided
