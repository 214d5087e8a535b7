"""An eval job's process (`kind: eval`): model.init_from loaded as a serve job loads its base
(engine.serving.loader, one device), each of eval.tasks loaded (engine.evaluation.tasks), scored by
lm-eval's evaluator over EngineLM, and the results written where a run's figures go: one metrics
row {"step": 0, "eval": {task: {metric: {value, stderr, n}}}} (the control plane stores it as the
job's results), OUT/results.json, and a table in the job's log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megatrain.engine.evaluation.lm import EngineLM
from megatrain.engine.evaluation.tasks import load_task, run_tasks
from megatrain.engine.serving.loader import default_device, load_served
from megatrain.engine.sink import RunLog
from megatrain.progress_files import write_progress
from megatrain.spec import JobSpec


def evaluate_job(spec: JobSpec, out_dir: Path, activity: Any = None) -> dict[str, dict[str, Any]]:
    """Run the spec's tasks on its model; the results, as written to the metrics row."""
    assert spec.eval is not None, "kind eval has an eval block (spec.py)"
    out_dir.mkdir(parents=True, exist_ok=True)
    log, began = RunLog(out_dir, True), time.monotonic()
    try:
        if activity is not None:
            activity.phase = "init"  # a missing task file or base is the job's own input
        configs = [load_task(t) for t in spec.eval.tasks]
        device = default_device()
        served = load_served(spec, device)
        num_params = served.model.num_parameters()
        log.events.write({"event": "started", "device": device, "num_params": num_params, "step": 0})
        names = ", ".join(c["task"] for c in configs)
        log.say(
            f"evaluating {served.base} ({num_params:,} parameters, {served.precision}) on {device}: {names}"
        )
        batches = [0]

        def tick() -> None:  # progress for the runner's hang watch: one "step" per batch
            batches[0] += 1
            write_progress(out_dir, 0, batches[0], "evaluating")

        if activity is not None:
            activity.phase = "evaluation"
        lm = EngineLM(served.model, served.tokenizer, batch_size=spec.eval.batch_size, on_batch=tick)
        results = run_tasks(lm, configs, limit=spec.eval.limit)
        log.metrics.write({"step": 0, "eval": results})
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        for line in table(results):
            log.say(line)
        seconds = time.monotonic() - began
        log.events.write(
            {"event": "finished", "step": 0, "batches": batches[0], "seconds": round(seconds, 1)}
        )
        log.say(f"evaluated {len(configs)} task(s) in {batches[0]} batches, {seconds:.1f} s")
        return results
    finally:
        log.close()


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The results as the log shows them: task | metric | value | ± stderr | n."""
    lines = ["task | metric | value | stderr | n"]
    for task in sorted(results):
        for metric, r in sorted(results[task].items()):
            value = "-" if r["value"] is None else f"{r['value']:.4f}"
            stderr = "-" if r["stderr"] is None else f"{r['stderr']:.4f}"
            lines.append(f"{task} | {metric} | {value} | {stderr} | {r['n']}")
    return lines
