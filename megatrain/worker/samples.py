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

import argparse
import logging
import threading
from typing import Any

from megatrain.db.models import FAILED, READY, CheckpointSample
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings
from megatrain.worker.checkpoint_tasks import checkpoint_folder, claim, fail, finish, heartbeating

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
    attempt = claim(settings, CheckpointSample, sample_id)
    if attempt is None:
        log.info("sample %s is not pending: skipping this delivery", sample_id)
        return None
    with session_scope(settings.resolved_database_url) as s:
        row = s.get(CheckpointSample, sample_id)
        if row is None:
            return None
        folder = checkpoint_folder(settings.resolved_storage_url, row.job_id, row.step)
        prompt, max_new_tokens = row.prompt, row.max_new_tokens
        options = {
            "temperature": row.temperature,
            "top_k": row.top_k or 0,
            "top_p": 1.0 if row.top_p is None else row.top_p,
            "seed": row.seed,
        }
    with heartbeating(settings, CheckpointSample, sample_id, attempt):
        try:
            out = get_sampler().sample(folder, prompt, max_new_tokens, **options)
        except Exception as exc:  # a bad prompt or a missing checkpoint: the sample's reason
            log.warning("sample %s failed: %s", sample_id, exc)
            return FAILED if fail(settings, CheckpointSample, sample_id, attempt, exc) else None
    done = finish(
        settings, CheckpointSample, sample_id, attempt, READY, text=out.text, error="",
        prompt_tokens=len(out.prompt_ids), new_tokens=len(out.new_ids), elapsed_s=out.elapsed_s,
    )  # fmt: skip
    log.info("sample %s: %d tokens in %.2fs", sample_id, len(out.new_ids), out.elapsed_s)
    return READY if done else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.samples", description=__doc__)
    parser.add_argument("--sample-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sample_checkpoint(args.sample_id, get_settings())


if __name__ == "__main__":
    main()
