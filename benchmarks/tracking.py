"""What tracking costs a training step: the engine's own run (megatrain.engine.train.run, one rank,
CPU) with all three trackers (TensorBoard, W&B offline, MLflow's file store) against none, a row
every `--log-interval` steps (1, the default here, is the worst case; a spec's default is 10), in
this one process. Two measurements:

- blocks: one tracked run of `--blocks` x `--block` rows whose rows go to the trackers in every
  other block only (the trackers' process up all along): the steady per-row cost, with
  the on and off blocks interleaved finely enough that a shared host's load swings move both.
- runs: whole runs, untracked and tracked, alternated `--reps` times: the same plus the trackers'
  process starting beside the first steps (its imports take seconds of a core, a one-off that a
  2-core host feels and a GPU node's spare cores hide); the first `--warmup-s` seconds left out.

The step time is each metrics row's iter_time_s (what the dashboard shows). Below the table, what
one row costs over `--rows` rows: on the training thread (a queue put), in the engine process as a
whole (the feeder thread's flatten and JSON line), and in the trackers' own process (every row
written to all three), which holds no lock of the engine's.

    python benchmarks/tracking.py                                    # ~4 min, 2-core VM
    python benchmarks/tracking.py --log-interval 10 --blocks 30 --block 10 --steps 2000
    python benchmarks/tracking.py --blocks 4 --block 10 --reps 1 --steps 30 --rows 100 --warmup-s 0  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _corpus(path: Path) -> Path:
    words = ["def", "return", "import", "class", "self", "while", "for", "if", "else", "yield"]
    with open(path, "w") as f:
        for i in range(400):
            lines = [" ".join(words[(i * 7 + j * 3 + k) % len(words)] for k in range(8)) for j in range(24)]
            f.write(json.dumps({"text": "\n".join(lines)}) + "\n")
    return path


def _spec(a: argparse.Namespace, corpus: Path, tracking: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "tracking-bench",
        "model": {"arch": "llama", "num_layers": a.layers, "hidden_size": a.hidden, "num_attention_heads": 4,
                  "num_query_groups": 2, "ffn_hidden_size": 4 * a.hidden, "seq_length": a.seq},
        "data": {"train": [{"path": corpus.as_uri()}], "split": "100,0,0"},
        "training": {"train_iters": a.steps, "global_batch_size": a.batch, "micro_batch_size": a.batch,
                     "lr": 1e-3, "warmup_iters": 0, "precision": "fp32", "log_interval": a.log_interval,
                     "eval_interval": 0, "checkpoint_interval": 0, "seed": 1},
        "resources": {"devices": 1},
    }  # fmt: skip
    if tracking is not None:
        spec["tracking"] = tracking
    return spec


def _all_trackers(folder: Path) -> dict[str, Any]:
    return {
        "tensorboard": True,
        "wandb": {"mode": "offline", "project": "tracking-bench"},
        "mlflow": {"tracking_uri": (folder / "mlruns").as_uri()},
    }


def _step_times(a: argparse.Namespace, corpus: Path, folder: Path, tracked: bool) -> list[float]:
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    out = folder / ("tracked" if tracked else "plain")
    spec = parse_spec(_spec(a, corpus, _all_trackers(folder) if tracked else None))
    run(spec, out)
    rows = _rows(out)
    times = [r["iter_time_s"] for r in rows if r["time"] >= rows[0]["time"] + a.warmup_s]
    if not times:
        raise SystemExit(f"the run ended within --warmup-s {a.warmup_s:g}: give it more --steps")
    return times


def _blocks(a: argparse.Namespace, corpus: Path, folder: Path) -> tuple[list[float], list[float]]:
    """(on, off) step times of one tracked run whose rows reach the trackers in odd blocks only."""
    from megatrain.engine import sink
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    def on(step: int) -> bool:  # by the row's index, 1, 2, ... (a row every log_interval steps)
        return (step // a.log_interval - 1) // a.block % 2 == 1

    original = sink.RunLog.track

    def track(self: Any, *args: Any) -> None:  # the run's RunLog, its fan-out gated by block
        original(self, *args)
        forward = self.metrics.also
        self.metrics.also = lambda row: forward(row) if on(row.get("step", 0)) else None

    sink.RunLog.track = track  # type: ignore[method-assign]
    try:
        spec = _spec(a, corpus, _all_trackers(folder))
        spec["training"]["train_iters"] = a.blocks * a.block * a.log_interval
        run(parse_spec(spec), folder / "blocks")
    finally:
        sink.RunLog.track = original  # type: ignore[method-assign]
    rows = _rows(folder / "blocks")
    # A row's cost lands on the next interval; the first two rows of a block are its transition.
    li = a.log_interval
    warm = [r for r in rows if r["time"] >= rows[0]["time"] + a.warmup_s]
    steady = [r for r in warm if (r["step"] // li - 1) % a.block >= 2]
    tracked = [r["iter_time_s"] for r in steady if on(r["step"] - li)]
    return tracked, [r["iter_time_s"] for r in steady if not on(r["step"] - li)]


def _rows(out: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    warnings = [e for e in events if e["event"] == "warning"]
    if warnings:
        raise SystemExit(f"a tracker failed, so the figures would not include it: {warnings}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "iter_time_s" in r]


def _row_costs(folder: Path, rows: int) -> tuple[float, float, float]:
    """Per row, all three trackers: µs on the training thread (queueing), µs of the engine process's
    CPU (the feeder's flatten and JSON), ms of the trackers' process's CPU (its start-up taken out:
    a run of 0 rows subtracted)."""
    from megatrain.engine.tracking.fanout import Trackers
    from megatrain.spec_tracking import TrackingSpec

    plain = (folder / "plain" / "metrics.jsonl").read_text().splitlines()
    row = {k: v for k, v in json.loads(plain[-1]).items() if k != "time"}  # a real row, ~35 numbers

    def feed(n: int) -> tuple[float, float, float]:
        out = folder / f"costs-{n}"
        out.mkdir()
        warned: list[dict[str, Any]] = []
        spec = TrackingSpec.model_validate(_all_trackers(out))
        trackers = Trackers(
            spec, {"spec": {"name": "costs"}}, out, (out / "checkpoints").as_uri(), warned.append
        )
        cpu, child = time.process_time(), _children_cpu()
        began = time.perf_counter()
        for step in range(1, n + 1):
            trackers.log({**row, "step": step})
        queued = time.perf_counter() - began
        trackers.close()
        if warned:
            raise SystemExit(f"a tracker failed: {warned}")
        return queued, time.process_time() - cpu, _children_cpu() - child

    idle, busy = feed(0), feed(rows)
    return busy[0] / rows * 1e6, (busy[1] - idle[1]) / rows * 1e6, (busy[2] - idle[2]) / rows * 1e3


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-interval", type=int, default=1, help="a metrics row every N steps")
    p.add_argument("--block", type=int, default=25, help="rows per block (blocks)")
    p.add_argument("--blocks", type=int, default=60, help="blocks, every other one tracked (blocks)")
    p.add_argument("--steps", type=int, default=800, help="steps per run (runs)")
    p.add_argument("--reps", type=int, default=3, help="alternations of untracked and tracked runs (runs)")
    p.add_argument("--warmup-s", type=float, default=10.0, help="seconds of steps left out of the medians")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the rest of the cores are free)")
    p.add_argument("--rows", type=int, default=2000, help="rows for the per-row costs")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    os.environ.pop("MEGATRAIN_JOB_ID", None)
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="tracking-bench-") as tmp:
        root = Path(tmp)
        corpus = _corpus(root / "corpus.jsonl")
        on, off = _blocks(a, corpus, root)
        for rep in range(a.reps):
            got = {}
            for tracked in (False, True) if rep % 2 == 0 else (True, False):
                folder = root / f"rep{rep}"
                folder.mkdir(exist_ok=True)
                got[tracked] = _step_times(a, corpus, folder, tracked)
                times[tracked] += got[tracked]
            ratios.append(statistics.median(got[True]) / statistics.median(got[False]))
        main_us, feeder_us, child_ms = _row_costs(root / "rep0", a.rows)
    plain, tracked = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"llama {a.layers} layers of {a.hidden}, seq {a.seq}, batch {a.batch}, fp32, CPU, {a.threads} torch "
        f"thread(s), a row every {a.log_interval} step(s); medians after each run's first {a.warmup_s:g} s"
    )
    print(f"{'measurement':44} {'untracked ms':>12} {'tracked ms':>10} {'ratio':>7}  per repetition")
    what = f"blocks: {a.blocks} x {a.block} rows, every other tracked"
    off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
    print(f"{what:44} {off_ms:12.2f} {on_ms:10.2f} {on_ms / off_ms:6.3f}x")
    per_rep = " ".join(f"{r:.3f}x" for r in ratios)
    what = f"runs: {a.reps} x ({a.steps} untracked, {a.steps} tracked)"
    print(f"{what:44} {plain * 1e3:12.2f} {tracked * 1e3:10.2f} {tracked / plain:6.3f}x  {per_rep}")
    print(
        f"per row ({a.rows} rows): {main_us:.1f} µs on the training thread, {feeder_us:.0f} µs of the engine "
        f"process's CPU in all, {child_ms:.2f} ms of CPU in the trackers' process"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
