"""`megatrain validate SPEC` prints every error of a spec, one per line (against the real API)."""

from __future__ import annotations

import json
from pathlib import Path

from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app


def test_every_error_on_its_own_line(live_api: LiveApi, tmp_path: Path) -> None:
    spec = live_api.spec("many-errors")
    spec["model"].update(num_layers=0, hidden_size=31)  # a bound, and hidden vs heads
    spec["resources"]["pool"] = "nowhere"
    spec["data"]["train"].append({"path": (live_api.data_path.parent / "missing.jsonl").as_uri()})
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    result = CliRunner().invoke(app, ["validate", str(path)], env={"COLUMNS": "200"})
    out = result.output
    assert result.exit_code == 1 and "Traceback" not in out, out
    lines = [line.strip() for line in out.splitlines()]
    assert any(line.startswith("error: invalid job spec (HTTP 422)") for line in lines), out
    for field in ("model.num_layers", "model.hidden_size", "resources.pool", "data.train.1.path"):
        assert sum(line.startswith(f"{field}: ") for line in lines) == 1, (field, out)
    assert "missing.jsonl' does not exist" in out


def test_an_unknown_field_is_told_the_nearest_one(live_api: LiveApi, tmp_path: Path) -> None:
    spec = live_api.spec("typo")
    spec["training"]["trainiters"] = 5
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    result = CliRunner().invoke(app, ["validate", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "training.trainiters: unknown field; did you mean train_iters?" in result.output


def test_what_auto_chose_is_printed(live_api: LiveApi, tmp_path: Path) -> None:
    spec = live_api.spec("auto-chose")
    spec["parallelism"] = "auto"
    spec["training"]["micro_batch_size"] = "auto"
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    result = CliRunner().invoke(app, ["validate", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("auto chose: ")]
    assert "parallelism.tp=1" in line and "parallelism.dp=" in line, line
    assert "training.micro_batch_size=" in line, line
