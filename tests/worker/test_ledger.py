"""The runner's split of an attempt's wall time (worker.ledger.AttemptClock): checkpoint stalls and
evaluation pauses come from the engine's events, each counted once however often a line is re-read,
and never more than the attempt's wall time."""

from __future__ import annotations

from megatrain.worker.ledger import AttemptClock


def test_evaluation_pauses_are_their_own_kind_of_time() -> None:
    clock = AttemptClock(started=0.0, attempt=1, queued_s=3.0, prev_step=0)
    clock.observe_metrics([{"step": 1, "iter_time_s": 0.5}], now=2.0)
    events = [
        {"event": "checkpoint_saved", "step": 10, "stall_s": 1.5},
        {"event": "evaluated", "step": 10, "what": "validation", "seconds": 4.0},
        {"event": "evaluated", "step": 10, "what": "tasks", "seconds": 6.0},
    ]
    clock.observe_events(events)
    clock.observe_events(events[1:])  # a re-read line counts once
    got = clock.seconds(now=100.0)
    assert got == {
        "queued_s": 3.0, "restart_s": 0.0, "checkpoint_stall_s": 1.5, "hang_s": 0.0, "eval_s": 10.0,
        "productive_s": 100.0 - 1.5 - 10.0,
    }  # fmt: skip
    # Never more than the wall time left after the other losses.
    clock.hang_s = 95.0
    short = clock.seconds(now=100.0)
    assert short["eval_s"] == 100.0 - 1.5 - 95.0 and short["productive_s"] == 0.0
