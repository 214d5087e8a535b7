"""A job's own profile: torch.profiler over a few training steps, a Chrome trace per rank.

`training.profile_steps: N` (or `python -m megatrain.engine.train --profile N`) records N whole
loop iterations of every rank (the step, its logging and the pauses around it: what a run costs
beyond its step is what a profile is for), after SKIP_STEPS of the attempt's first steps (allocation
and warm-up) and one warm-up step of the profiler's own. Each rank writes
`OUT/profile/trace.rank{R}.json.gz` and copies it next to the checkpoints
(`{storage}/jobs/{id}/profile/`, which GET /v1/jobs/{id}/profile serves); the main rank's `profiled`
event names the steps and the files. The trace opens in Perfetto (ui.perfetto.dev) and
chrome://tracing. The phases of a step (data, forward_backward, grad_sync, optimizer, log) are
labelled ranges in it; on a GPU the CUDA kernels are recorded too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule

from megatrain.engine.runtime import Dist
from megatrain.engine.sink import RunLog
from megatrain.engine.tracking import sibling_url
from megatrain.storage import open_store

FOLDER = "profile"
"""The folder beside `checkpoints/` (and in the run folder) that holds the traces."""
SKIP_STEPS = 3
"""The attempt's first steps, left out: they allocate, fault pages in and warm caches."""


def trace_name(rank: int) -> str:
    return f"trace.rank{rank}.json.gz"


def profiled_steps(start_step: int, steps: int) -> tuple[int, int]:
    """The first and last step (1-based, as the logs count) an attempt starting after `start_step`
    records: the profiler's own warm-up step follows the skipped ones."""
    first = start_step + SKIP_STEPS + 2
    return first, first + steps - 1


class StepProfiler:
    """Drives torch.profiler from the training loop: `start()` before the first step, `step()` at
    the end of every loop iteration (cheap once done). `annotate` is True while recording (the
    step timers then label their phases)."""

    def __init__(
        self,
        steps: int,
        rank: int,
        world_size: int,
        out_dir: Path,
        checkpoint_url: str,
        device: str,
        log: RunLog,
    ):
        """`log`: the run's events and console (written by the main rank only)."""
        self.steps, self.rank, self.world_size = steps, rank, world_size
        self.local = out_dir / FOLDER
        self.url = sibling_url(checkpoint_url, FOLDER)
        self.log = log
        activities = [ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        self._prof: Any = profile(
            activities=activities,
            schedule=schedule(wait=SKIP_STEPS, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._export,
            record_shapes=True,
        )
        self._iteration = 0
        self._start_step = 0
        self.done = False

    @property
    def annotate(self) -> bool:
        return not self.done and SKIP_STEPS <= self._iteration < SKIP_STEPS + 1 + self.steps

    def start(self, start_step: int) -> None:
        self._start_step = start_step
        self._prof.start()

    def step(self) -> None:
        if self.done:
            return
        self._prof.step()
        self._iteration += 1
        if self._iteration >= SKIP_STEPS + 1 + self.steps:
            self.stop()

    def stop(self) -> None:
        """Leave the profiler (a run shorter than the window ends it here, with no trace)."""
        if not self.done:
            self.done = True
            self._prof.stop()

    def _export(self, prof: Any) -> None:
        began = time.perf_counter()
        self.local.mkdir(parents=True, exist_ok=True)
        path = self.local / trace_name(self.rank)
        prof.export_chrome_trace(str(path))
        store = open_store(self.url)
        if getattr(store, "root", None) != self.local.resolve():
            store.put_file(path.name, path)  # next to the checkpoints (the local run folder's own copy stays)
        first, last = profiled_steps(self._start_step, self.steps)
        seconds = time.perf_counter() - began
        self.log.events.write(
            {
                "event": "profiled",
                "step": last,
                "steps": [first, last],
                "folder": FOLDER,
                "files": [trace_name(r) for r in range(self.world_size)],
                "bytes": path.stat().st_size,
                "seconds": round(seconds, 3),
            }
        )
        self.log.say(
            f"step {last} | profile of steps {first}-{last} written: {FOLDER}/{path.name} "
            f"({path.stat().st_size / 1e6:.1f} MB, {seconds:.1f} s; one per rank, next to the checkpoints)"
        )


def step_profiler(
    steps: int, ctx: Dist, out_dir: Path, checkpoint_url: str, log: RunLog
) -> StepProfiler | None:
    """The run's profiler when training.profile_steps asks for one (None for 0)."""
    if steps <= 0:
        return None
    return StepProfiler(steps, ctx.rank, ctx.world_size, out_dir, checkpoint_url, str(ctx.device), log)
