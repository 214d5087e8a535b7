"""Running lm-eval tasks (megatrain.eval_tasks loads and checks them) over EngineLM with lm-eval's own
evaluator: per task, each metric's value, its stderr and the number of items."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from megatrain.eval_tasks import TaskError, data_urls  # noqa: F401  (re-exported)
from megatrain.eval_tasks import load_task as _load_task


def load_task(path: str | Path) -> dict[str, Any]:
    """megatrain.eval_tasks.load_task on a node: s3:// items downloaded once per node into the
    verified data cache (engine.data.remote), so lm-eval's json loader reads local files."""
    return _load_task(path, fetch=_node_copy)


def _node_copy(url: str) -> Path:
    from megatrain.engine.data.dataset import default_cache_root
    from megatrain.engine.data.remote import cached_files
    from megatrain.storage import split_url

    parent, name = split_url(url)
    return cached_files(parent, [name], default_cache_root(), f"{name}.complete.json") / name


def run_tasks(
    lm: Any, configs: list[dict[str, Any]], *, limit: int | None = None
) -> dict[str, dict[str, Any]]:
    """Run the loaded tasks over `lm` (an lm-eval LM: EngineLM) with lm-eval's evaluator; per task,
    {metric: {"value", "stderr", "n"}}. `limit`: at most this many items per task."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    # lm-eval bootstraps some metrics' stderr in a fork()ed pool; forked from an engine process with
    # live threads (gloo's, the loader's) a child can start holding a lock it will never get back
    # (seen: a two-rank eval job stuck for good in bootstrap_stderr). Its one-process loop draws the
    # same samples (random.Random(chunk) either way).
    os.environ["DISABLE_MULTIPROC"] = "1"
    out = evaluator.simple_evaluate(
        model=lm,
        tasks=configs,
        limit=limit,
        task_manager=TaskManager(include_defaults=False),
        bootstrap_iters=1000,
        log_samples=False,
        random_seed=0,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )
    results: dict[str, dict[str, Any]] = {}
    for task, values in (out or {}).get("results", {}).items():
        n = int((out or {}).get("n-samples", {}).get(task, {}).get("effective", 0))
        metrics: dict[str, Any] = {}
        for key, value in values.items():
            metric, comma, _filter = key.partition(",")
            if not comma or metric.endswith("_stderr"):  # "metric,filter" keys only (not alias, name)
                continue
            stderr = values.get(f"{metric}_stderr,{_filter}")
            metrics[metric] = {"value": _number(value), "stderr": _number(stderr), "n": n}
        results[task] = metrics
    return results


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
