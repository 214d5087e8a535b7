"""CLI rendering and exit codes against a scripted API (no server needed)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import megatrain.cli.jobs as cli


def _job(step: int, status: str, reason: str = "") -> dict[str, Any]:
    return {"id": "job-00000000000000aa", "name": "n", "kind": "pretrain", "status": status,
            "status_reason": reason, "current_step": step, "total_steps": 12, "latest_loss": 2.5,
            "latest_tokens_per_s": 4321.0, "latest_mfu": 0.0123}  # fmt: skip


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, megatrain_home: Path) -> list[dict[str, Any]]:
    """The CLI's Client talks to a MockTransport that plays back job states in order."""
    states: list[dict[str, Any]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "POST":
            return httpx.Response(201, json=_job(0, "queued"))
        return httpx.Response(200, json=states.pop(0) if len(states) > 1 else states[0])

    client = functools.partial(cli.Client, "http://api.test", "k", transport=httpx.MockTransport(handler))
    monkeypatch.setattr(cli, "Client", client)
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    return states


@pytest.mark.parametrize(("final", "code"), [("succeeded", 0), ("failed", 1), ("cancelled", 1)])
def test_submit_follow_shows_progress_and_sets_exit_code(
    scripted: list[dict[str, Any]], tmp_path: Path, final: str, code: int
) -> None:
    scripted += [_job(0, "queued"), _job(6, "running"), _job(12, final, "the reason")]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "n", "data": {"train": [{"path": "file:///x"}]}}))
    result = CliRunner().invoke(cli.app, ["submit", str(spec), "--follow"], env={"COLUMNS": "200"})
    assert result.exit_code == code, result.output
    assert "step 12/12" in result.output and "loss 2.5000" in result.output
    assert "4,321 tok/s" in result.output and "MFU 1.23%" in result.output
    assert f"job job-00000000000000aa {final}: the reason" in result.output
    assert "Traceback" not in result.output


def test_layout_text_names_the_degrees_and_only_what_is_not_default() -> None:
    from megatrain.cli.jobs import layout_text

    layout = {"tp": 2, "pp": 2, "dp": 1, "cp": 1, "ep": 1, "virtual_stages": 2,
              "sequence_parallel": True, "pipeline_schedule": "1f1b", "pipeline_layers": None}  # fmt: skip
    assert layout_text(layout, 4) == "4 processes: tp=2 pp=2 dp=1 virtual_stages=2 sequence_parallel"
    assert layout_text({"tp": 1, "pp": 1, "dp": 1}, 1) == "1 process: tp=1 pp=1 dp=1"
