"""The sample task: continue a prompt from a job's checkpoint and store the text.

`sample_checkpoint(sample_id, settings)` is thin and idempotent like the export task: it claims a
`pending` sample (→ running; any other state means another delivery has it), loads the checkpoint
folder `{storage}/jobs/{job_id}/checkpoints/iter_{step:07d}` with the process's CheckpointSampler
(kept at module level, so a long-lived Celery worker keeps recent models warm) and generates with the
sample's options: greedy without temperature, top_k or top_p, sampled (seeded) with any. The sample
becomes `ready` with the text and its token counts, or `failed` with the reason: a prompt the model
cannot take is such a reason, not a crash.

CLI: `python -m megatrain.worker.samples --sample-id ID` (what the local executor spawns).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from megatrain.db.models import FAILED, READY
from megatrain.settings import Settings
from megatrain.worker import checkpoint_tasks as tasks

log = logging.getLogger(__name__)

SAMPLER_KEEP = 2
"""Checkpoints a worker process keeps loaded (the most recently sampled)."""

_sampler: Any = None
_sampler_lock = threading.Lock()


def get_sampler() -> Any:
    """This process's engine CheckpointSampler, made on first use (only a worker imports torch)."""
    global _sampler
    with _sampler_lock:
        if _sampler is None:
            from megatrain.engine.sampling import CheckpointSampler

            _sampler = CheckpointSampler(keep=SAMPLER_KEEP)
        return _sampler


def sample_checkpoint(sample_id: str, settings: Settings) -> str | None:
    """Run a pending sample; its final status (ready/failed), or None if it was not pending (another
    delivery ran it), was deleted meanwhile, or was taken over by a newer attempt."""
    link = tasks.task_link(settings)
    claimed = tasks.claim_row(link, "sample", sample_id)
    if claimed is None:
        return None
    attempt, row = claimed
    folder = tasks.checkpoint_folder(settings.resolved_storage_url, row.job_id, row.step)
    options = {
        "temperature": row.temperature,
        "top_k": row.top_k or 0,
        "top_p": 1.0 if row.top_p is None else row.top_p,
        "seed": row.seed,
    }
    with tasks.heartbeating(settings, link, "sample", sample_id, attempt):
        try:
            out = get_sampler().sample(folder, row.prompt, row.max_new_tokens, **options)
        except Exception as exc:  # a bad prompt or a missing checkpoint: the sample's reason
            log.warning("sample %s failed: %s", sample_id, exc)
            return FAILED if tasks.fail(link, "sample", sample_id, attempt, exc) else None
    done = link.finish(
        "sample", sample_id, attempt, READY, text=out.text, error="",
        prompt_tokens=len(out.prompt_ids), new_tokens=len(out.new_ids), elapsed_s=out.elapsed_s,
    )  # fmt: skip
    log.info("sample %s: %d tokens in %.2fs", sample_id, len(out.new_ids), out.elapsed_s)
    return READY if done else None


def main(argv: list[str] | None = None) -> None:
    tasks.task_main("megatrain.worker.samples", __doc__, "sample-id", sample_checkpoint, argv)


if __name__ == "__main__":
    main()
