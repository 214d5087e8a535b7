"""The shard runner's heartbeat, on its own thread: a slow tick of the reporting loop (a large
backfill, a slow database write, stack dumps, a rank that takes its grace period to stop) never lets
the heartbeat lapse, so the scheduler never relaunches a healthy attempt.

The thread beats only while the runner's loop has been seen within `max_stall_s`: a runner wedged
for longer stops beating, and the scheduler's heartbeat timeout ends its attempt. So a runner that
dies is noticed within heartbeat_timeout_s, and one that hangs within max_stall_s + that.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from megatrain.worker.metrics import worker_metrics
from megatrain.worker.reporter import ReportError

if TYPE_CHECKING:
    from megatrain.worker.reporter import Reporter

log = logging.getLogger(__name__)

MAX_STALL_S = 300.0
"""How long the runner's loop may go unseen before its heartbeat stops."""


class Heartbeat:
    def __init__(
        self,
        reporter: Reporter,
        job_id: str,
        host: str,
        pid: int,
        interval_s: float,
        max_stall_s: float = MAX_STALL_S,
    ):
        self.reporter, self.job_id, self.host, self.pid = reporter, job_id, host, pid
        self.interval_s, self.max_stall_s = interval_s, max_stall_s
        self.seen = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"heartbeat-{job_id}")

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def touch(self) -> None:
        """The runner's loop is alive (called every iteration)."""
        self.seen = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def beat(self) -> bool:
        """One heartbeat if this runner still owns the running job; False if it does not (or failed)."""
        try:
            owned = self.reporter.heartbeat(self.job_id, self.host, self.pid)
        except ReportError as exc:
            log.warning("job %s: heartbeat failed (will retry): %s", self.job_id, exc)
            return False
        if owned:
            worker_metrics().heartbeat(self.job_id)  # its age is what /metrics shows
        return owned

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self.seen > self.max_stall_s:
                continue  # the loop is wedged: let the scheduler's timeout judge this runner
            self.beat()
