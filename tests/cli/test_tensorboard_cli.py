"""`megatrain tensorboard JOB --download-only` against the embedded stack running the real engine: the
job's event files, written beside its checkpoints, come down through the API and TensorBoard's own
reader finds the job's metrics in them; a tracker that cannot write is a warning on the job, which
still succeeds."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.cli.tensorboard import tensorboard_command
from megatrain.client import Client

pytestmark = pytest.mark.slow


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_tensorboard_download_of_a_real_job(live_stack: LiveApi, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where MLflow wants a folder")
    spec = live_stack.spec("tracked", train_iters=4, log_interval=1, checkpoint_interval=4)
    spec["tracking"] = {"tensorboard": True, "mlflow": {"tracking_uri": (blocked / "mlruns").as_uri()}}
    with Client() as client:
        job_id = client.submit(spec).id
        plain = client.submit(live_stack.spec("untracked", train_iters=1)).id
        assert client.wait(job_id, timeout_s=240).status == "succeeded"
        assert client.wait(plain, timeout_s=240).status == "succeeded"
        events = client.events(job_id)
        train = client.metrics(job_id, kind="train")

    (warning,) = [e for e in events if e["kind"] == "warning"]
    assert warning["reason"].startswith("mlflow tracking stopped: NotADirectoryError")
    assert warning["data"]["tracker"] == "mlflow"

    dest = tmp_path / "board"
    code, out = run("tensorboard", job_id, "--download-only", "--to", str(dest))
    assert code == 0 and f"downloaded 1 event file(s) of job {job_id}" in out, out
    acc = EventAccumulator(str(dest), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (m["step"], float(np.float32(m["loss"]))) for m in train
    ]
    # Again into the same folder: an earlier download is replaced; another folder is left alone.
    assert run("tensorboard", job_id, "--download-only", "--to", str(dest))[0] == 0
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    code, out = run("tensorboard", job_id, "--download-only", "--to", str(tmp_path / "notes"))
    assert code == 1 and "not a TensorBoard folder" in out, out

    # file:// storage signs no URLs: format=urls says so; auto (the CLI's) falls back to the tar.
    headers = {"Authorization": f"Bearer {live_stack.key}"}
    urls = httpx.get(f"{live_stack.url}/v1/jobs/{job_id}/tensorboard?format=urls", headers=headers)
    assert urls.status_code == 422 and urls.json()["detail"][0]["field"] == "format", urls.text
    tar = httpx.get(f"{live_stack.url}/v1/jobs/{job_id}/tensorboard?format=tar", headers=headers)
    assert tar.headers["content-disposition"] == f'attachment; filename="{job_id}-tensorboard.tar"'

    code, out = run("tensorboard", plain, "--download-only", "--to", str(tmp_path / "none"))
    assert code == 1 and "404" in out and "tracking.tensorboard" in out, out
    assert tensorboard_command(dest, "127.0.0.1", 6006) is not None  # what it would run, installed here
