"""The trackers' process: `python -m megatrain.engine.tracking.process`, started by the engine's
rank 0 (tracking.fanout). It reads JSON lines on stdin: first the setup, then one row each
({"step", "values", "at"}), then {"close": ok}; it answers on stdout with JSON lines: {"opened": name},
{"closed": name} and warning events. Anything a library prints goes to stderr (the job's log).

It runs at a lower priority (nice 10) and ignores SIGINT and SIGTERM (a cancelled job's process
group gets them): the engine's end closes its stdin, and the trackers are then flushed and their
runs ended, within CLOSE_TIMEOUT_S.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from megatrain.engine.tracking import RunInfo, Tracker, configured, open_tracker, warning_event
from megatrain.spec_tracking import TrackingSpec

CLOSE_TIMEOUT_S = 120.0
"""How long the run's end waits for the trackers to finish (W&B's upload, the last copy of the
event files); past it they are abandoned, with a warning each."""


def serve(setup: dict[str, Any], lines: Iterable[str], emit: Callable[[dict[str, Any]], None]) -> None:
    """Open the setup's trackers, write every row to each, close them; a tracker that raises is
    dropped after one warning (and its run ended as well as it still can)."""
    tracking = TrackingSpec.model_validate(setup["tracking"])
    run = RunInfo(
        job_name=setup["job_name"],
        job_id=setup.get("job_id"),
        out_dir=Path(setup["out_dir"]),
        checkpoint_url=setup["checkpoint_url"],
        config=setup["config"],
    )
    trackers: list[Tracker] = []
    for name in configured(tracking):
        try:
            trackers.append(open_tracker(name, tracking, run))
            emit({"opened": name})
        except Exception as exc:
            emit(warning_event(name, exc, None))
    ok, step = False, None
    for line in lines:
        message = json.loads(line)
        if "close" in message:
            ok = bool(message["close"])
            break
        step = message["step"]
        for tracker in list(trackers):
            try:
                tracker.log(step, message["values"], message["at"])
            except Exception as exc:
                trackers.remove(tracker)
                emit(warning_event(tracker.name, exc, step))
                with contextlib.suppress(Exception):  # already reported: the first error says why
                    tracker.close(False)
                emit({"closed": tracker.name})
    for tracker in trackers:
        try:
            tracker.close(ok)
        except Exception as exc:
            emit(warning_event(tracker.name, exc, step))
        emit({"closed": tracker.name})


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Background work: where cores are short, the training ranks go first (MLflow's file store
    # takes milliseconds of CPU a row).
    with contextlib.suppress(OSError):
        os.nice(10)
    # fd 1 is the answers' channel alone: whatever a library prints (Python or C) goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def emit(message: dict[str, Any]) -> None:
        with lock, contextlib.suppress(OSError):  # an engine that is gone reads no answers
            answers.write(json.dumps(message) + "\n")

    lines = iter(sys.stdin)
    setup = json.loads(next(lines))

    def abandon() -> None:  # the engine stopped waiting at its own deadline; do not outlive it long
        os._exit(0)

    watchdog = threading.Timer(CLOSE_TIMEOUT_S, abandon)
    watchdog.daemon = True

    def rows() -> Iterable[str]:
        yield from lines
        watchdog.start()  # stdin ended without a close message: the engine died

    serve(setup, rows(), emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
