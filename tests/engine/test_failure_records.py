"""What a failing rank leaves for the worker: OUT/failure.rank{R}.json with what failed (phase,
step), the exception's type and first line, and whether retrying can help; the traceback on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.engine.loop import TrainLoop
from megatrain.engine.train import EXIT_FAILURE, EXIT_USAGE, main

from .helpers import tiny_spec


def _main(tmp_path: Path, raw: dict) -> int:
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    return main(["--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "out")])


def _record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out" / "failure.rank0.json").read_text())


def test_a_missing_data_file_is_a_user_error_during_setup(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tiny_spec(corpus)
    corpus.unlink()  # deleted after the job was submitted
    assert _main(tmp_path, raw) == EXIT_USAGE
    record = _record(tmp_path)
    assert record["kind"] == "user" and record["rank"] == 0
    assert (record["phase"], record["step"]) == ("data", None)
    assert record["exception"] == "FileNotFoundError" and str(corpus) in record["message"]
    assert "\n" not in record["message"]
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err  # the whole traceback reaches the job's log
    assert "rank 0: reading the data failed on rank 0 during setup: FileNotFoundError" in err


def test_an_unknown_error_while_training_names_the_step_and_is_infrastructure(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = TrainLoop.step

    def flaky(self: TrainLoop, consumed: int):  # the third step's collective breaks
        if consumed >= 2 * self.cfg.global_batch_size:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\nsecond line")
        return real_step(self, consumed)

    monkeypatch.setattr(TrainLoop, "step", flaky)
    assert _main(tmp_path, tiny_spec(corpus, checkpoint_interval=0, eval_interval=0)) == EXIT_FAILURE
    record = _record(tmp_path)
    assert record["kind"] == "infrastructure"
    assert (record["phase"], record["step"]) == ("training", 3)
    assert record["exception"] == "RuntimeError"
    assert record["message"] == "Connection closed by peer [127.0.0.1]:29500"


def test_a_spec_the_engine_refuses_is_a_user_error(tmp_path: Path) -> None:
    assert _main(tmp_path, {"name": "x"}) == EXIT_USAGE
    record = _record(tmp_path)
    assert (record["kind"], record["phase"], record["exception"]) == ("user", "setup", "SpecError")
