"""StepTimers: per-phase means over an interval; device synchronisation only on the steps asked for."""

from __future__ import annotations

import time

import pytest
import torch

from megatrain.engine.timers import StepTimers


def test_cpu_phases_accumulate_and_average() -> None:
    timers = StepTimers("cpu")
    for _ in range(3):
        timers.begin_step()
        with timers("forward"):
            time.sleep(0.01)
        for _ in range(2):  # two micro-batches: the phase adds up within the step
            with timers("backward"):
                time.sleep(0.01)
        timers.end_step()
    report = timers.report()
    assert report["timed_steps"] == 3
    assert 0.01 <= report["time_forward_s"] < 0.05
    assert 0.02 <= report["time_backward_s"] < 0.08
    assert timers.report() == {"timed_steps": 0}  # reset after reporting


def test_misuse_is_an_error() -> None:
    timers = StepTimers()
    timers.begin_step()
    timers.start("data")
    with pytest.raises(RuntimeError, match="already running"):
        timers.start("data")
    with pytest.raises(RuntimeError, match="still running"):
        timers.end_step()
    timers.stop("data")
    with pytest.raises(RuntimeError, match="not started"):
        timers.stop("optimizer")


def test_cuda_synchronises_and_times_only_requested_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    timers = StepTimers("cuda:0")
    for step in range(1, 5):
        timers.begin_step(sync=step % 2 == 0)
        with timers("forward"):
            pass
        with timers("optimizer"):
            pass
        timers.end_step()
    # Steps 2 and 4 only: one sync at begin_step, then one per phase boundary (2 phases × 2).
    assert len(syncs) == 2 * 5
    assert all(d == "cuda:0" for d in syncs)
    assert timers.report()["timed_steps"] == 2


def test_sync_every_step_for_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    timers = StepTimers("cuda", sync_every_step=True)
    for _ in range(3):
        timers.begin_step()
        with timers("forward"):
            pass
        timers.end_step()
    assert len(syncs) == 3 * 3
    assert timers.report()["timed_steps"] == 3
