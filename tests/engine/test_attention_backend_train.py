"""model.attention_backend through the engine (megatrain/engine/train.py): a run with flex trains to
the losses of one with SDPA over packed documents, and a worker that cannot run the named backend
fails before building the model, with the API's words; ring attention refuses a backend it would
not run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.context import parallelize_context
from megatrain.engine.train import run
from megatrain.plan.layout import Layout
from megatrain.spec import SpecError, parse_spec

from .helpers import read_jsonl, tiny_spec


def _losses(tmp_path: Path, corpus: Path, backend: str) -> list[float]:
    raw = tiny_spec(corpus, train_iters=3, eval_interval=0, checkpoint_interval=0)
    raw["model"]["attention_backend"] = backend
    raw["data"]["packing"] = True  # documents packed into each row: flex's document block mask
    run(parse_spec(raw), tmp_path / backend)
    return [r["loss"] for r in read_jsonl(tmp_path / backend / "metrics.jsonl")]


def test_flex_trains_to_the_losses_of_sdpa(tmp_path: Path, corpus: Path) -> None:
    sdpa = _losses(tmp_path, corpus, "sdpa")
    assert len(sdpa) == 3
    assert _losses(tmp_path, corpus, "flex") == pytest.approx(sdpa, rel=1e-4)


def test_a_backend_this_worker_cannot_run_fails_before_the_model(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, package=None: None)
    raw = tiny_spec(corpus, precision="bf16")
    raw["model"]["attention_backend"] = "te"
    with pytest.raises(SpecError, match=r"transformer-engine package.*pip install megatrain\[gpu\]"):
        run(parse_spec(raw), tmp_path / "out")
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or read_jsonl(metrics) == []  # no step ran


def test_ring_attention_refuses_a_named_backend_it_would_not_run() -> None:
    model = GPTModel(TransformerConfig.preset("tiny-llama", attention_backend="flex"))
    with pytest.raises(ValueError, match=r"attention_backend='flex' is not used with parallelism.cp=2"):
        parallelize_context(model, SimpleNamespace(cp_size=2, layout=Layout(cp=2)))  # type: ignore[arg-type]
