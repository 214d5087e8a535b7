"""Weights & Biases: one run per job, its id the job's (a resumed attempt continues it), the resolved
spec and layout as its config, every metrics row a history row at the row's step. The API key is
W&B's own WANDB_API_KEY from the job's environment (a tenant secret the spec's `secrets` names),
never a spec field. mode offline (or WANDB_MODE=offline) needs no network and leaves the run
folder OUT/wandb/offline-run-*/ for `wandb sync`.
"""

from __future__ import annotations

from typing import Any

from megatrain.engine.tracking import RunInfo
from megatrain.spec_tracking import WandbSpec


class WandbTracker:
    name = "wandb"

    def __init__(self, spec: WandbSpec, run: RunInfo) -> None:
        import wandb

        self._wandb = wandb
        run.out_dir.mkdir(parents=True, exist_ok=True)
        # console off: the job's log already holds every line; stats off: the rows carry the
        # devices' memory and utilization, sampled where the step pays nothing for them.
        settings = wandb.Settings(console="off", x_disable_stats=True, quiet=True, disable_git=True)
        resume: dict[str, Any] = {"id": run.job_id, "resume": "allow"} if run.job_id else {}
        self._run = wandb.init(
            project=spec.project or run.job_name,
            entity=spec.entity,
            name=spec.name or run.job_name,
            tags=spec.tags or None,
            mode=spec.mode,
            dir=str(run.out_dir),
            settings=settings,
            reinit="create_new",  # a run of its own even where this process holds another
            **resume,
        )
        # A resumed attempt may run another layout: its config replaces the first attempt's.
        self._run.config.update(run.config, allow_val_change=True)

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        # Rows at one step (training, then validation) merge into one history row; a step below
        # the run's last (an attempt redoing steps after a resume) is dropped by W&B: first wins.
        self._run.log(values, step=step)

    def close(self, ok: bool) -> None:
        self._run.finish(exit_code=0 if ok else 1)
