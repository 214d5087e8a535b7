"""The SDK's sample calls (mixed into `Client`): continue a prompt from a job's checkpoint on the
workers, and read the job's recent samples."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatrain.client.models import Sample
from megatrain.client.polling import TaskFailed, poll_until_done


class SampleFailed(TaskFailed):
    """The workers could not generate the sample (e.g. a prompt longer than the model reads);
    `sample.error` says why."""

    @property
    def sample(self) -> Sample:
        return self.item


class SamplesMixin:
    if TYPE_CHECKING:  # provided by Client

        def _json(self, method: str, path: str, **kwargs: Any) -> Any: ...

    def sample(
        self,
        job_id: str,
        prompt: str,
        *,
        step: int | None = None,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        wait: bool = True,
        timeout_s: float | None = 120,
        poll_interval_s: float = 0.5,
    ) -> Sample:
        """Continue `prompt` from the checkpoint at `step` (the latest when None): greedy without
        temperature, top_k and top_p, sampled (reproducibly with `seed`) with any. With `wait` (the
        default) returns the ready sample (`.text` is the continuation; SampleFailed if it failed,
        TimeoutError past timeout_s); without, the pending one at once."""
        body = {
            "prompt": prompt, "step": step, "max_new_tokens": max_new_tokens, "temperature": temperature,
            "top_k": top_k, "top_p": top_p, "seed": seed,
        }  # fmt: skip
        made = Sample.from_dict(self._json("POST", f"/v1/jobs/{job_id}/samples", json=body))
        if not wait:
            return made
        return poll_until_done(
            lambda: self.get_sample(job_id, made.id),
            lambda failed: SampleFailed(failed, "sample"),
            what=f"sample {made.id}",
            timeout_s=timeout_s,
            poll_interval_s=poll_interval_s,
        )

    def samples(self, job_id: str) -> list[Sample]:
        """The job's last 20 samples, newest first."""
        return [Sample.from_dict(r) for r in self._json("GET", f"/v1/jobs/{job_id}/samples")]

    def get_sample(self, job_id: str, sample_id: str) -> Sample:
        return Sample.from_dict(self._json("GET", f"/v1/jobs/{job_id}/samples/{sample_id}"))
