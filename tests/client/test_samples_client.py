"""The SDK's sample(), samples() and get_sample() against the live API: an engine-trained checkpoint,
the samples run by the real task (handed out by the scheduler's dispatch, on a thread); the text is
the engine CheckpointSampler's for the same arguments, greedy and seeded."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.checkpoints import samples_in_background, train_job_checkpoint
from fixtures.live import LiveApi

from megatrain.client import ApiError, Client, SampleFailed


def test_sample_wait_list_and_failures(live_api: LiveApi, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from megatrain.engine.sampling import CheckpointSampler

    with Client() as client:
        job_id = client.submit(live_api.spec("sampled")).id
        with pytest.raises(ApiError) as ei:
            client.sample(job_id, "def")
        assert ei.value.status == 409 and "no checkpoints yet" in str(ei.value)
        train_job_checkpoint(live_api.settings, job_id, tmp_path / "train")
        with pytest.raises(ApiError) as ei:
            client.sample(job_id, "def", max_new_tokens=1000)
        assert ei.value.status == 422 and "max_new_tokens" in ei.value.fields

        pending = client.sample(job_id, "class Point:", wait=False)
        assert (pending.status, pending.step, pending.text) == ("pending", 2, None)
        with samples_in_background(live_api.settings):
            greedy = client.sample(job_id, "def add(a, b):", max_new_tokens=6, timeout_s=60)
            seeded = client.sample(job_id, "def add(a, b):", step=2, temperature=1.2, top_p=0.9, seed=5)
            with pytest.raises(SampleFailed) as failed:
                client.sample(job_id, "print(i) " * 40, timeout_s=60)
            assert "reads at most 15" in failed.value.sample.error
            assert client.get_sample(job_id, pending.id).status in ("pending", "running", "ready")

        folder = f"{live_api.settings.resolved_storage_url}/jobs/{job_id}/checkpoints/iter_0000002"
        reference = CheckpointSampler(keep=1)
        assert greedy.status == "ready" and greedy.text == reference.sample(folder, "def add(a, b):", 6).text
        want = reference.sample(folder, "def add(a, b):", 64, temperature=1.2, top_p=0.9, seed=5)
        assert (seeded.text, seeded.new_tokens) == (want.text, len(want.new_ids))
        listed = client.samples(job_id)
        assert [s.id for s in listed][:3] == [failed.value.sample.id, seeded.id, greedy.id]
        assert listed[-1].id == pending.id
