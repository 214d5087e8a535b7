"""`megatrain demo`'s words around the job (megatrain/cli/demo.py): its duration from the planner's
prediction, and the walk-through's next commands once it is done."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import typer.main

from megatrain.cli import app as cli_app
from megatrain.cli.demo import duration_line, next_steps

ROOT = Path(__file__).resolve().parents[2]


def test_the_duration_is_the_planners_step_time_over_the_steps() -> None:
    line = duration_line({"step_time_s": 0.3}, 500, "default")
    assert line.startswith("expected duration: about 2 min for 500 steps (the planner's prediction for pool")
    assert "0.3 s a step" in line
    assert duration_line({"step_time_s": 0.05}, 500, "default").startswith("expected duration: about 25 s")
    assert "unknown" in duration_line(None, 500, "default")


def test_next_steps_from_the_checkout_are_the_walkthroughs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    lines = next_steps("job-123")
    assert lines[0].startswith("next, as examples/README.md goes on")
    commands = [shlex.split(line.strip())[1:] for line in lines[1:]]
    assert commands == [
        ["export", "job-123", "--to", "~/megatrain-models/demo-llama", "--dtype", "fp32"],
        ["models", "register", "~/megatrain-models/demo-llama", "--name", "demo-llama"],
        ["submit", "examples/finetune_hf_chat.yaml", "--follow"],
    ]
    # The same commands as examples/README.md gives them, with options the CLI takes.
    readme = (ROOT / "examples" / "README.md").read_text()
    for line in lines[1:]:
        assert line.strip().replace("job-123", "JOB") in readme, line
    root = typer.main.get_command(cli_app)
    for args in commands:
        cmd, rest = root, args
        while getattr(cmd, "commands", None) is not None:
            cmd, rest = cmd.commands[rest[0]], rest[1:]  # type: ignore[attr-defined]
        opts = {o for p in cmd.params for o in p.opts}
        assert {w for w in rest if w.startswith("--")} <= opts, args


def test_next_steps_elsewhere_name_the_checkouts_examples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    lines = next_steps("job-1")
    assert str(ROOT / "examples" / "README.md") in lines[0]
    assert lines[-1].strip() == f"megatrain submit {ROOT / 'examples' / 'finetune_hf_chat.yaml'} --follow"
