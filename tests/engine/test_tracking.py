"""Trackers (megatrain.engine.tracking): a tiny training's metrics rows, read back with each tracker's
own reader (TensorBoard's EventAccumulator, W&B's `wandb leet inspect` of the offline run's log,
MLflow's client on the file store), equal metrics.jsonl; a tracker that fails is a warning event and
the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatrain.engine.tracking import RunInfo, flatten, process, sibling_url
from megatrain.engine.tracking.fanout import Trackers
from megatrain.engine.train import run
from megatrain.spec import parse_spec
from megatrain.spec_tracking import MLflowSpec, TrackingSpec

from .helpers import read_jsonl, tiny_spec

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def _expected(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """{name: {step: value}} of the rows as every tracker gets them (rows at one step merge)."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in flatten(row).items():
            out.setdefault(name, {})[row["step"]] = value
    return out


def _tensorboard(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_records(out: Path) -> list[dict[str, Any]]:
    """The offline run's transaction log as W&B's own reader prints it, one record per line."""
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    text = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _wandb_history(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if r["type"] == "history":
            step = int(r["history"]["step"]["num"])
            for name, value in r["history"]["item"].items():
                if not name.startswith("_"):  # W&B's own: _step, _runtime, _timestamp
                    out.setdefault(name, {})[step] = value
    return out


def _mlflow(uri: str) -> tuple[Any, dict[str, dict[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny-runs"]
    (found,) = client.search_runs([experiment.experiment_id])
    history = {
        name: {m.step: m.value for m in client.get_metric_history(found.info.run_id, name)}
        for name in found.data.metrics
    }
    return found, history


def test_every_tracker_reads_back_the_metrics_rows(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEGATRAIN_JOB_ID", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # the spec's dir wins: OUT/wandb
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's reader (MLflow 3 asks)
    raw = tiny_spec(corpus, train_iters=4, eval_interval=2, checkpoint_interval=4)
    mlruns = (tmp_path / "mlruns").as_uri()
    raw["tracking"] = {
        "tensorboard": True,
        "wandb": {"mode": "offline", "project": "proj", "name": "tiny-run", "tags": ["ci", "tiny"]},
        "mlflow": {"tracking_uri": mlruns, "experiment": "tiny-runs"},
    }
    # Checkpoints in "object storage" (a job's prefix): the event files are copied beside them.
    checkpoints = tmp_path / "storage" / "jobs" / "j1" / "checkpoints"
    run(parse_spec(raw), tmp_path / "out", checkpoint_url=checkpoints.as_uri())

    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    want = _expected(rows)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "process_rss_bytes", "val_loss"} <= want.keys()
    assert sorted(want["loss"]) == [1, 2, 3, 4] and sorted(want["val_loss"]) == [2, 4]
    assert not any(e["event"] == "warning" for e in read_jsonl(tmp_path / "out" / "events.jsonl"))

    # TensorBoard: scalars are float32 in the event file; the copy beside the checkpoints is the same.
    local = tmp_path / "out" / "tensorboard"
    copied = checkpoints.parent / "tensorboard"
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in copied.iterdir())
    for p in local.iterdir():
        assert p.read_bytes() == (copied / p.name).read_bytes()
    board = _tensorboard(copied)
    assert board.keys() == want.keys()
    for name, points in want.items():
        assert board[name] == {s: float(np.float32(v)) for s, v in points.items()}, name

    # W&B offline: its history (float64) equals the rows; the run folder holds config, name and tags.
    records = _wandb_records(tmp_path / "out")
    assert _wandb_history(records) == want
    (head,) = [r["run"] for r in records if r["type"] == "run"]
    assert (head["project"], head["display_name"], head["tags"]) == ("proj", "tiny-run", ["ci", "tiny"])
    config: dict[str, Any] = {}
    for r in records:
        if r["type"] == "config":
            config |= r["config"]["update"]
    assert config["spec"]["name"] == "tiny" and config["spec"]["model"]["hidden_size"] == 32
    assert config["layout"]["tp"] == 1 and config["spec"]["tracking"]["wandb"]["project"] == "proj"

    # MLflow: the file store's metric histories equal the rows; params hold the spec and layout.
    found, history = _mlflow(mlruns)
    assert history == want
    assert found.info.status == "FINISHED" and found.info.run_name == "tiny"
    params = found.data.params
    assert params["spec.model.hidden_size"] == "32" and params["layout.dp"] == "1"
    assert json.loads(params["spec.data.train"])[0]["path"] == corpus.as_uri()


def test_a_failing_tracker_is_a_warning_and_the_run_goes_on(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A worker without wandb: the trackers' process finds this stand-in first, which is not there.
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\", name='wandb')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where MLflow wants a folder")
    raw = tiny_spec(corpus, train_iters=2, eval_interval=0, checkpoint_interval=2)
    raw["tracking"] = {
        "tensorboard": True,
        "wandb": {"mode": "offline"},
        "mlflow": {"tracking_uri": (blocked / "mlruns").as_uri()},
    }
    summary = run(parse_spec(raw), tmp_path / "out")
    assert summary["step"] == 2

    events = read_jsonl(tmp_path / "out" / "events.jsonl")
    warnings = {e["tracker"]: e for e in events if e["event"] == "warning"}
    assert warnings.keys() == {"wandb", "mlflow"}, events
    assert "wandb is not installed here" in warnings["wandb"]["reason"]
    assert warnings["mlflow"]["reason"].startswith("NotADirectoryError")
    assert warnings["mlflow"]["step"] is None  # it never opened
    assert [e["event"] for e in events].count("finished") == 1
    assert "mlflow tracking stopped" in capsys.readouterr().out
    # TensorBoard, which worked, has every step.
    assert sorted(_tensorboard(tmp_path / "out" / "tensorboard")["loss"]) == [1, 2]


class _Flaky:
    """A tracker that breaks at step 3."""

    name = "mlflow"

    def __init__(self, record: list[Any]) -> None:
        self.record = record

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        if step == 3:
            raise ConnectionError("tracking server went away")
        self.record.append(step)

    def close(self, ok: bool) -> None:
        self.record.append(("closed", ok))


def test_a_tracker_failing_mid_run_is_dropped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    record: list[Any] = []
    monkeypatch.setattr(process, "open_tracker", lambda name, spec, run: _Flaky(record))
    setup = {"tracking": {"mlflow": {"tracking_uri": "file:///nowhere"}}, "job_name": "t", "out_dir": "/x",
             "checkpoint_url": "file:///x/checkpoints", "config": {}}  # fmt: skip
    lines = [json.dumps({"step": s, "values": {"loss": 1.0 / s}, "at": 0.0}) for s in range(1, 6)]
    emitted: list[dict[str, Any]] = []
    process.serve(setup, [*lines, json.dumps({"close": True})], emitted.append)
    assert record == [1, 2, ("closed", False)]  # dropped at 3 and ended as failed, once
    assert emitted == [
        {"opened": "mlflow"},
        {
            "event": "warning",
            "tracker": "mlflow",
            "step": 3,
            "reason": "ConnectionError: tracking server went away",
        },
        {"closed": "mlflow"},
    ]


def _trackers(tmp_path: Path, warned: list[dict[str, Any]], command: list[str]) -> Trackers:
    spec = TrackingSpec(tensorboard=True, mlflow=MLflowSpec(tracking_uri="file:///nowhere"))
    return Trackers(spec, {"spec": {"name": "t"}}, tmp_path, "file:///x/checkpoints", warned.append, command)


def test_trackers_that_hang_or_crash_are_warnings_and_the_run_ends(tmp_path: Path) -> None:
    warned: list[dict[str, Any]] = []
    hung = _trackers(tmp_path, warned, [sys.executable, "-c", "import time; time.sleep(60)"])
    hung.log({"step": 1, "loss": 2.0})
    hung.log({"loss": 1.0})  # no step: no point
    began = time.monotonic()
    hung.close(timeout_s=1.0)
    assert time.monotonic() - began < 5
    assert [(w["tracker"], w["step"]) for w in warned] == [("tensorboard", 1), ("mlflow", 1)]
    assert all("did not finish within 1 s" in w["reason"] for w in warned)
    hung.close()  # once only (and atexit's call is gone)
    assert len(warned) == 2

    warned.clear()
    crashed = _trackers(
        tmp_path, warned, [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)"]
    )
    crashed.log({"step": 1, "loss": 2.0})
    crashed.close()
    assert [w["tracker"] for w in warned] == ["tensorboard", "mlflow"]
    assert {w["reason"] for w in warned} == {"the trackers' process exited with code 3"}


def test_flatten_names_every_number_once() -> None:
    row = {
        "step": 10, "time": 1.0, "loss": 2.5, "skipped_iters": 0, "mfu": None, "host_under_load": True,
        "rewards/margins": 0.25,
        "eval": {"arc easy": {"acc": {"value": 0.5, "stderr": 0.1, "n": 20},
                              "f1": {"value": None, "stderr": None, "n": 0}}},
    }  # fmt: skip
    assert flatten(row) == {
        "loss": 2.5, "skipped_iters": 0.0, "rewards/margins": 0.25,
        "eval/arc easy/acc": 0.5, "eval/arc easy/acc_stderr": 0.1,
    }  # fmt: skip
    assert flatten({"eval": {"t,x": {"m": {"value": 1}}}}) == {"eval/t_x/m": 1.0}  # MLflow's name rules
    assert sibling_url("s3://b/p/jobs/j1/checkpoints/", "tensorboard") == "s3://b/p/jobs/j1/tensorboard"


def test_mlflow_continues_the_jobs_run_on_a_resumed_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # restored after the test
    from megatrain.engine.tracking.mlflow_run import MLflowTracker

    uri = (tmp_path / "mlruns").as_uri()
    spec = MLflowSpec(tracking_uri=uri)

    def attempt(layout_dp: int, steps: list[int]) -> str:
        info = RunInfo("job", "j-42", tmp_path, "file:///x/checkpoints", {"layout": {"dp": layout_dp}})
        t = MLflowTracker(spec, info)
        for s in steps:
            t.log(s, {"loss": float(s)}, time.time())
        t.close(ok=True)
        return str(t.run_id)

    first, second = attempt(2, [1, 2]), attempt(4, [3])
    assert first == second
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(first, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    # Params never change once logged: the first attempt's layout stays (W&B's config takes the new).
    assert client.get_run(first).data.params == {"layout.dp": "2"}


def test_tensorboard_shows_a_resumed_attempts_points_from_its_first_step(tmp_path: Path) -> None:
    from megatrain.engine.tracking.tensorboard_writer import TensorBoardTracker
    from megatrain.spec_tracking import TensorBoardSpec

    storage = tmp_path / "storage" / "jobs" / "j1" / "checkpoints"

    def attempt(n: int, steps: range, value: float) -> None:
        info = RunInfo("job", "j1", tmp_path / f"attempt-{n}", storage.as_uri(), {"layout": {"dp": n}})
        t = TensorBoardTracker(TensorBoardSpec(), info)
        for s in steps:
            t.log(s, {"loss": value}, time.time())
        t.close(ok=True)
        time.sleep(1.1)  # event file names carry the second they were made: TensorBoard's order

    attempt(1, range(1, 5), 1.0)  # died after step 4, checkpointed at 2
    attempt(2, range(3, 6), 2.0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(storage.parent / "tensorboard"))
    acc.Reload()
    # The first attempt's 3 and 4 are purged, not shown beside the second's.
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (1, 1.0),
        (2, 1.0),
        (3, 2.0),
        (4, 2.0),
        (5, 2.0),
    ]


def test_trackers_that_cannot_start_are_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain.engine.sink import RunLog
    from megatrain.engine.tracking import fanout

    monkeypatch.setattr(fanout, "COMMAND", [str(tmp_path / "no-such-python")])
    log = RunLog(tmp_path, True)
    log.track(TrackingSpec(tensorboard=True, wandb=True), {"spec": {"name": "t"}}, "file:///x/checkpoints")
    log.metrics.write({"step": 1, "loss": 1.0})  # still written where it always is
    log.close()
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [(e["tracker"], e["reason"].split(":")[0]) for e in events] == [
        ("tensorboard", "FileNotFoundError"),
        ("wandb", "FileNotFoundError"),
    ]
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0]
