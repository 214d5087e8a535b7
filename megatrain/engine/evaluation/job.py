"""An eval job's process (`kind: eval`): model.init_from loaded as a serve job loads its base
(engine.serving.loader, one device), or on several ranks at the job's layout as a fine-tune starts
(only each rank's shards read), each of eval.tasks loaded (engine.evaluation.tasks), scored by
lm-eval's evaluator over EngineLM, and the results written where a run's figures go: one metrics
row {"step": 0, "eval": {task: {metric: {value, stderr, n}}}} (the control plane stores it as the
job's results), OUT/results.json, and a table in the job's log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megatrain.engine.data import build_tokenizer
from megatrain.engine.evaluation.lm import EngineLM
from megatrain.engine.evaluation.perplexity import perplexity_results
from megatrain.engine.evaluation.scorer import LayoutScorer
from megatrain.engine.evaluation.tasks import load_task, run_tasks
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.serving.loader import default_device, load_served
from megatrain.engine.sink import RunLog
from megatrain.plan.layout import Layout, with_micro_batch_size
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
        names = ", ".join([c["task"] for c in configs] + [f"perplexity:{s}" for s in spec.eval.perplexity])
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
        results = _score(spec, lm, configs, tick)
        _report(log, out_dir, results, len(configs), batches[0], time.monotonic() - began, True)
        return results
    finally:
        log.close()


def evaluate_at_layout(
    spec: JobSpec, layout: Layout, out_dir: Path, ctx: Any, activity: Any
) -> dict[str, Any]:
    """An eval job on several ranks (`resources.devices` > 1 with its tp / pp / dp layout): each
    rank builds only its shards of model.init_from (a Hugging Face folder read by slice or a job's
    checkpoint, as a fine-tune starts) and runs the same requests through LayoutScorer; rank 0
    writes what the one-process job writes. Returns {"step": 0} (a run's summary)."""
    from megatrain.engine.start import start_rank_model, worker_model_config
    from megatrain.engine.train import runnable_config

    assert spec.eval is not None, "kind eval has an eval block (spec.py)"
    out_dir.mkdir(parents=True, exist_ok=True)
    log, began = RunLog(out_dir, ctx.is_main), time.monotonic()
    try:
        spec = with_micro_batch_size(spec, layout=layout)
        cfg = runnable_config(spec, layout, ctx.device, log)
        activity.phase = "init"  # a missing task file or base is the job's own input
        configs = [load_task(t) for t in spec.eval.tasks]
        tokenizer = build_tokenizer(spec.data.tokenizer)
        mcfg = worker_model_config(spec, tokenizer.vocab_size, ctx.device, cfg.precision)
        _refuse_adapters(spec.model.init_from)
        state = ParallelState.build(layout, ctx.device)
        model = start_rank_model(spec, mcfg, cfg, state, ctx.device, spec.model.init_from, activity, log)
        model.module.requires_grad_(False)
        log.events.write({"event": "started", "device": ctx.device, "num_params": model.num_params, "step": 0,
                          "world_size": layout.world_size, "layout": layout.as_dict()})  # fmt: skip
        names = ", ".join([c["task"] for c in configs] + [f"perplexity:{s}" for s in spec.eval.perplexity])
        log.say(f"evaluating {spec.model.init_from} ({model.num_params:,} parameters, {cfg.precision}) at "
                f"{layout.describe()}: {names}")  # fmt: skip
        rows = max(1, spec.eval.batch_size // state.dp_size)  # a micro-batch: each replica's share
        scorer = LayoutScorer(model, mcfg.seq_length, mcfg.real_vocab_size, rows_per_forward=rows)
        batches = [0]

        def tick() -> None:  # progress for the runner's hang watch: one "step" per batch
            batches[0] += 1
            write_progress(out_dir, ctx.rank, batches[0], "evaluating")

        activity.phase = "evaluation"
        lm = EngineLM(scorer, tokenizer, batch_size=rows * state.dp_size, on_batch=tick)
        results = _score(spec, lm, configs, tick)
        _report(log, out_dir, results, len(configs), batches[0], time.monotonic() - began, ctx.is_main)
        return {"step": 0}
    finally:
        log.close()


def _refuse_adapters(init_from: str | None) -> None:
    """A LoRA fine-tune's checkpoint evaluates on one device, where load_checkpoint folds its adapters
    into the weights; a layout's ranks read base weights by box and would score the base alone."""
    if not (init_from or "").startswith("checkpoint:"):
        return
    from megatrain.engine.checkpoint import open_folder, resolve_init_from
    from megatrain.engine.config import lora_config
    from megatrain.settings import get_settings
    from megatrain.spec import SpecError

    src = resolve_init_from(str(init_from), get_settings().resolved_storage_url)
    if lora_config(open_folder(src, weights_only=True).spec) is not None:
        why = "model.init_from is a LoRA fine-tune's checkpoint: it is evaluated on one device (devices: 1)"
        raise SpecError([{"field": "model.init_from", "message": why}])


def _score(spec: JobSpec, lm: EngineLM, configs: list[dict[str, Any]], tick: Any) -> dict[str, Any]:
    """The tasks' results, then each eval.perplexity split's (task `perplexity:SPLIT`)."""
    assert spec.eval is not None
    results = run_tasks(lm, configs, limit=spec.eval.limit) if configs else {}
    return results | perplexity_results(spec, lm.scorer, lm.batch_size_per_call, tick)


def _report(
    log: RunLog, out_dir: Path, results: dict[str, Any], tasks: int, batches: int, seconds: float, main: bool
) -> None:
    """The results where a run's figures go (rank 0 only): a metrics row, results.json, the log's table."""
    log.metrics.write({"step": 0, "eval": results})
    if main:
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    for line in table(results):
        log.say(line)
    log.events.write({"event": "finished", "step": 0, "batches": batches, "seconds": round(seconds, 1)})
    log.say(f"evaluated {tasks} task(s) in {batches} batches, {seconds:.1f} s")


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The results as the log shows them: task | metric | value | ± stderr | n."""
    lines = ["task | metric | value | stderr | n"]
    for task in sorted(results):
        for metric, r in sorted(results[task].items()):
            value = "-" if r["value"] is None else f"{r['value']:.4f}"
            stderr = "-" if r["stderr"] is None else f"{r['stderr']:.4f}"
            lines.append(f"{task} | {metric} | {value} | {stderr} | {r['n']}")
    return lines
