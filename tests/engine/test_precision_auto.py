"""precision: auto (bf16 where the device runs it natively, else fp32) and the measured model-state
memory beside the planner's estimate of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatrain.engine.runtime import effective_precision
from megatrain.engine.train import run
from megatrain.settings import Settings
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec


def test_auto_resolves_by_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings are cached per process: an earlier test may have cached MEGATRAIN_CPU_LOW_PRECISION=1.
    monkeypatch.setattr("megatrain.engine.runtime.get_settings", lambda: Settings(cpu_low_precision=False))
    monkeypatch.setattr("megatrain.engine.runtime.cpu_has_native_bf16", lambda: False)
    assert effective_precision("auto", "cpu") == "fp32"
    assert effective_precision("bf16", "cpu") == "fp32"  # asked for explicitly: downgraded as before
    assert effective_precision("fp16", "cpu") == "fp32"
    monkeypatch.setattr("megatrain.engine.runtime.cpu_has_native_bf16", lambda: True)
    assert effective_precision("auto", "cpu") == "bf16"
    assert effective_precision("fp32", "cpu") == "fp32"


def _run(tmp_path: Path, corpus: Path, precision: str) -> tuple[dict[str, Any], dict[str, Any]]:
    raw = tiny_spec(corpus, precision=precision, train_iters=2, eval_interval=0, checkpoint_interval=0)
    run(parse_spec(raw), tmp_path)
    started = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "started")
    last = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r][-1]
    return started, last


@pytest.mark.parametrize(("native", "expected"), [(False, "fp32"), (True, "bf16")])
def test_default_spec_runs_what_the_cpu_runs_natively(
    tmp_path: Path,
    corpus: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    native: bool,
    expected: str,
) -> None:
    monkeypatch.setattr("megatrain.engine.runtime.cpu_has_native_bf16", lambda: native)
    raw = tiny_spec(corpus)
    del raw["training"]["precision"]
    assert parse_spec(raw).training.precision == "auto"  # the default asks for nothing it downgrades
    started, last = _run(tmp_path, corpus, "auto")
    assert started["precision"] == expected
    assert f"precision auto: {expected}" in capsys.readouterr().out
    # The measured model state (parameters, fp32 gradient buffer, optimizer's main weights and Adam
    # moments, from the real tensors) agrees with the planner's static estimate in that precision.
    est = started["memory_estimate"]
    planned = est["params_bytes"] + est["grads_bytes"] + est["optimizer_bytes"]
    assert last["model_state_bytes"] == pytest.approx(planned, rel=0.10)
    assert last["measured_params_bytes"] == pytest.approx(est["params_bytes"], rel=0.10)
    assert last["measured_optimizer_bytes"] == pytest.approx(est["optimizer_bytes"], rel=0.10)
    # On a CPU the process's resident set is reported as such, not as a tensor peak.
    assert last["process_rss_bytes"] > last["model_state_bytes"]
    assert "peak_memory_bytes" not in last
