"""An eval job (`kind: eval`) through the product, as a user drives it with the SDK, on the embedded
default (SQLite, the local executor) and on PostgreSQL + Celery (Redis), the real engine on CPU: a
tiny model exported as a Hugging Face folder is scored on the two shipped tasks (examples/eval); the
results stored on the job (GET /v1/jobs/{id}/results) equal lm-eval's evaluator run in this process
over the same weights, the job's log and `megatrain results` show them as a table. A task file
lm-eval could not run, or one outside the tenant's data roots, is a 422 naming eval.tasks[i] before
anything runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.celery import celery_stack
from fixtures.live import LiveApi

from megatrain.client import ApiError, Client

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"
LIMIT = 16


def _export_tiny(folder: Path) -> Any:
    """The tests' seeded tiny Llama (tests/engine/eval_helpers.py's), exported with its byte tokenizer."""
    from megatrain.engine.interop.hf import export_model_hf
    from megatrain.engine.interop.hf_tokenizer import export_tokenizer
    from megatrain.engine.serving.loader import load_served
    from megatrain.spec import parse_spec

    spec = parse_spec(
        {
            "name": "tiny",
            "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                      "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 64,
                      "init_method_std": 0.3},
            "data": {"train": [{"dataset": "corpus"}], "tokenizer": {"type": "byte"}},
            "training": {"precision": "fp32", "seed": 3},
        }
    )  # fmt: skip
    served = load_served(spec, "cpu")
    tokenizer = export_tokenizer(spec.data.tokenizer, model_max_length=64)
    export_model_hf(
        served.model, folder, dtype=torch.float32, tokenizer_files=tokenizer.files,
        extra_config=tokenizer.special_ids,
    )  # fmt: skip
    return served


def _eval_spec(
    base: Path, tasks: list[str], pool: str = "default", parallelism: dict[str, Any] | None = None
) -> dict[str, Any]:
    devices = {"resources": {"devices": 2}, "parallelism": parallelism} if parallelism else {}
    return {
        "name": "eval-tiny",
        "kind": "eval",
        "model": {"init_from": f"hf:{base.as_uri()}"},
        "data": {"tokenizer": {"type": "byte"}, "train": []},
        "training": {"precision": "fp32"},
        "eval": {"tasks": tasks, "limit": LIMIT, "batch_size": 4},
        "resources": {"devices": 1, "pool": pool, "max_runtime_s": 600},
    } | {k: v if k != "resources" else {**v, "pool": pool, "max_runtime_s": 600} for k, v in devices.items()}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("parallelism", [None, {"tp": 2, "dp": 1}], ids=["one", "tp2"])
def test_an_eval_job_stores_the_results_lm_eval_gives_here(
    live_stack: LiveApi, parallelism: dict[str, Any] | None
) -> None:
    """On one process, and at tp=2 on two ranks (each reading its shards of the folder)."""
    _eval_through_the_api(live_stack, "default", None, parallelism)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_eval_job_on_postgres_and_celery(
    db_url: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with celery_stack(tmp_path, monkeypatch, redis_url) as live:
        _eval_through_the_api(live, live.settings.pool_name, tmp_path / "worker.log")


def _eval_through_the_api(
    live_stack: LiveApi, pool: str, worker_log: Path | None, parallelism: dict[str, Any] | None = None
) -> None:
    pytest.importorskip("lm_eval")
    from megatrain.engine.evaluation.lm import EngineLM
    from megatrain.engine.evaluation.tasks import load_task, run_tasks

    root = live_stack.data_path.parent
    served = _export_tiny(root / "tiny")
    tasks = root / "tasks"
    shutil.copytree(EXAMPLES, tasks, ignore=shutil.ignore_patterns("*.py"))
    urls = [(tasks / "corpus_mc.yaml").as_uri(), (tasks / "corpus_cloze.yaml").as_uri()]
    with Client(api_url=live_stack.url, api_key=live_stack.key) as client:
        job = client.submit(_eval_spec(root / "tiny", urls, pool, parallelism))
        done = client.wait(job.id, timeout_s=240, poll_interval_s=0.5)
        logs = [line.line for line in client.logs(job.id)]
        worker = worker_log.read_text()[-3000:] if worker_log and worker_log.exists() else ""
        assert done.status == "succeeded", f"{done.status_reason}\n" + "\n".join(logs[-40:]) + worker
        results = client.results(job.id)
        started = [e for e in client.events(job.id) if e["kind"] == "started"]
    if parallelism:  # two ranks ran it, at the layout asked for
        assert done.layout is not None and (done.layout["tp"], done.layout["dp"]) == (2, 1), done.layout
        assert started and started[-1]["data"].get("world_size") == 2, started
    assert (results["kind"], results["step"]) == ("eval", 0)
    assert set(results["tasks"]) == {"corpus_mc", "corpus_cloze"}
    here = run_tasks(EngineLM(served.model, served.tokenizer), [load_task(u) for u in urls], limit=LIMIT)
    for task, metrics in here.items():
        for metric, want in metrics.items():
            got = results["tasks"][task][metric]
            assert got["n"] == want["n"] == LIMIT
            assert got["value"] == pytest.approx(want["value"], rel=1e-5), (task, metric)
    assert any(line.startswith("corpus_mc | acc |") for line in logs), logs[-20:]
    # The CLI's table: each task's metrics with value ± stderr and the items scored.
    from typer.testing import CliRunner

    from megatrain.cli import app

    out = CliRunner().invoke(
        app, ["results", job.id], env={"COLUMNS": "200", "MEGATRAIN_API_KEY": live_stack.key}
    )
    assert out.exit_code == 0, out.output
    acc = results["tasks"]["corpus_mc"]["acc"]
    assert f"{acc['value']:.4f} ± {acc['stderr']:.4f}" in out.output and f" {LIMIT}" in out.output, out.output


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_task_file_lm_eval_could_not_run_is_refused_before_anything_runs(live_api: LiveApi) -> None:
    root = live_api.data_path.parent
    bad = root / "bad.yaml"
    bad.write_text("task: bad\ndataset_path: hellaswag\ntest_split: test\n")
    outside = Path("/tmp") / "megatrain-eval-outside.yaml"
    with Client(api_url=live_api.url, api_key=live_api.key) as client:
        for url, words in ((bad.as_uri(), "dataset_path: must be `json`"), (outside.as_uri(), "")):
            with pytest.raises(ApiError) as info:
                client.submit(_eval_spec(root, [url]))
            assert info.value.status == 422, info.value
            assert "eval.tasks[0]" in str(info.value) and words in str(info.value), str(info.value)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_training_job_scores_its_tasks_at_each_eval_step(live_stack: LiveApi) -> None:
    """training.eval_tasks through the product: each eval step's scores in the job's results
    history (the latest on top), the validation rows under OpenAI's names, a bad task a 422."""
    pytest.importorskip("lm_eval")
    root = live_stack.data_path.parent
    tasks = root / "tasks"
    shutil.copytree(EXAMPLES, tasks, ignore=shutil.ignore_patterns("*.py"))
    spec = live_stack.spec("scored", train_iters=4, eval_interval=2, eval_iters=1, eval_tasks_limit=4)
    spec["training"]["eval_tasks"] = [(tasks / "corpus_mc.yaml").as_uri()]
    with Client(api_url=live_stack.url, api_key=live_stack.key) as client:
        bad = {**spec, "training": {**spec["training"], "eval_tasks": [(root / "missing.yaml").as_uri()]}}
        with pytest.raises(ApiError) as info:
            client.submit(bad)
        assert info.value.status == 422 and "training.eval_tasks[0]" in str(info.value), str(info.value)
        job = client.submit(spec)
        done = client.wait(job.id, timeout_s=240, poll_interval_s=0.5)
        assert done.status == "succeeded", done.status_reason
        results = client.results(job.id)
        valid = client.metrics(job.id, kind="val")
    assert [h["step"] for h in results["history"]] == [2, 4] and results["step"] == 4
    assert results["tasks"]["corpus_mc"]["acc"]["n"] == 4
    assert results["tasks"] == results["history"][-1]["tasks"]
    assert [v["step"] for v in valid] == [2, 4]
    assert all(0 <= v["valid_mean_token_accuracy"] <= 1 for v in valid) and "full_valid_loss" in valid[-1]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_lora_fine_tunes_eval_on_several_devices_is_refused_naming_init_from(live_api: LiveApi) -> None:
    """Its checkpoint holds adapters, which one device folds into the weights; a layout's ranks would
    score the base alone. Refused before anything runs; on one device it is accepted."""
    root = live_api.data_path.parent
    _export_tiny(root / "tiny")
    lora = live_api.spec("lora-tune")
    lora.update(kind="finetune", model={"init_from": f"hf:{(root / 'tiny').as_uri()}"})
    lora["data"]["tokenizer"] = {"type": "byte"}
    lora["training"].update(method="lora", lora={"rank": 4})
    tasks = [(EXAMPLES / "corpus_mc.yaml").as_uri()]
    with Client(api_url=live_api.url, api_key=live_api.key) as client:
        tuned = client.submit(lora)
        spec = _eval_spec(root / "tiny", tasks, parallelism={"tp": 2, "dp": 1})
        spec["model"] = {"init_from": f"checkpoint:{tuned.id}"}
        with pytest.raises(ApiError) as info:
            client.submit(spec)
        assert info.value.status == 422 and "model.init_from" in str(info.value), str(info.value)
        assert "one device" in str(info.value), str(info.value)
        one = _eval_spec(root / "tiny", tasks)
        one["model"] = {"init_from": f"checkpoint:{tuned.id}"}
        assert client.submit(one).status == "queued"
