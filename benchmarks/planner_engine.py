"""The layout planner's predictions against the engine on this CPU.

    python benchmarks/planner_engine.py                       # every tp, pp, dp in {1, 2} (~3 min)
    python benchmarks/planner_engine.py --layouts 2,1,2 1,2,2 --steps 4 --json

For each (tp, pp, dp) layout the engine trains a small Llama (4 layers, hidden 128, seq 128, global
batch 16 in micro-batches of 2, fp32, sequence parallel with tp) under torchrun with gloo ranks, each
pinned to its own core; the table puts the median step time after warm-up beside the planner's
prediction for the same spec on a pool that describes this host, and rank 0's model state (params +
grads + optimizer, megatrain.engine.memory_stats) beside the planner's. On a CPU there is no
allocator peak to compare the activations with; tests/engine/test_memory.py covers them.

The pool is this host as the engine runs it: the matmul peak (megatrain.engine.calibrate's
measurement, taken before and after each run since other work on a shared host moves it) for the
threads each rank gets, shared when ranks outnumber the cores, and the gloo-on-localhost link
constants (megatrain.plan.cost.CPU_LINKS, `benchmarks/planner.py --gloo`). "other work" is the
host's CPU time (/proc/stat) less our processes', per second of the run: a run that shared its cores
with other work measured that work, so its error is marked and left out of the summary line.

Step time is a measurement, so it lives here and not in the tests (tests/plan/
test_cost_calibration.py holds the model state exact on a few layouts). The CPU constants of
megatrain.plan.cost were fitted with this script; BENCHMARKS.md "Layout planner" has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.hostinfo import host_busy_s  # noqa: E402
from megatrain.plan.cost import CPU_LINKS  # noqa: E402
from megatrain.plan.memory import host_memory_bytes  # noqa: E402
from megatrain.plan.planner import plan  # noqa: E402
from megatrain.plan.pool import PoolSpec  # noqa: E402
from megatrain.spec import parse_spec  # noqa: E402

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
"""(tp, pp, dp): every mix of 1 and 2 up to 4 ranks (8 ranks on a 2-core host would measure mostly
the operating system's scheduler)."""
QUIET_CORES = 1 / 8
"""A run counts as quiet when other work used less than this share of the host's cores during it:
with every core taken by our ranks, a third of a core of other work already stretched steps ~1.5x."""


def cores() -> int:
    return len(os.sched_getaffinity(0))


def threads_per_rank(world: int) -> int:
    """One thread per rank: a run of fewer ranks than cores is pinned to as many cores as it has
    ranks (a 2-thread GEMM on a shared host stalls whenever either core is taken), and the engine
    gives each rank cores // ranks threads."""
    return max(1, min(world, cores()) // world)


def rank_peak_tflops(world: int) -> float:
    """What one of `world` ranks' matmuls reach now: the engine's measurement with the threads the
    engine gives each rank, uncached (on a shared host the figure moves with the load)."""
    import torch

    from megatrain.engine.calibrate import measure_matmul_tflops

    before = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(world))
    try:
        return measure_matmul_tflops(torch.float32)
    finally:
        torch.set_num_threads(before)


def cpu_pool(world: int, peak: float) -> PoolSpec:
    """This host as `world` ranks see it, each computing at `peak` TFLOP/s with its own threads."""
    # Ranks beyond the cores time-share them: each computes at its share, and a collective waits
    # for its peers to be scheduled (latency) and shares the copying (bandwidth).
    crowd = max(1.0, world / cores())
    links = dict(CPU_LINKS)
    for key in links:
        links[key] = links[key] * crowd if key.endswith("latency_us") else links[key] / crowd
    return PoolSpec(
        name="this-host",
        accelerator="cpu",
        device_memory_bytes=host_memory_bytes() // world,
        peak_tflops={"fp32": peak / crowd},
        devices_per_node=world,
        nodes=1,
        **links,
    )


def busy_cpu_s() -> tuple[float, float]:
    """(CPU seconds every process on the host has run, those our finished children have run)."""
    busy = host_busy_s()
    assert busy is not None, "this benchmark reads /proc/stat"
    ours = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, ours.ru_utime + ours.ru_stime


def calibration_spec(corpus: Path, tp: int, pp: int, dp: int, steps: int) -> dict[str, Any]:
    return {
        "name": "calibration",
        "model": {"arch": "llama", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 128},
        "data": {"train": [{"path": corpus.as_uri()}], "split": "100,0,0"},
        "training": {"train_iters": steps, "global_batch_size": 16, "micro_batch_size": 2, "lr": 1e-3,
                     "precision": "fp32", "log_interval": 1, "eval_interval": 0, "checkpoint_interval": 0},
        "parallelism": {"tp": tp, "pp": pp, "dp": dp, "sequence_parallel": tp > 1},
        "resources": {"devices": tp * pp * dp},
    }  # fmt: skip


def write_corpus(path: Path) -> Path:
    words = ["def", "return", "import", "class", "self", "while", "for", "if", "else", "yield"]
    with open(path, "w") as f:
        for i in range(200):
            text = "\n".join(
                " ".join(words[(i * 7 + j * k) % len(words)] for k in range(8)) for j in range(20)
            )
            f.write(json.dumps({"text": text}) + "\n")
    return path


def measure(tmp: Path, tp: int, pp: int, dp: int, steps: int, warmup: int) -> dict[str, Any]:
    """Run the engine under torchrun: the median step time after warm-up and rank 0's model state."""
    corpus = tmp / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus)
    raw = calibration_spec(corpus, tp, pp, dp, steps)
    run_dir = tmp / f"tp{tp}pp{pp}dp{dp}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a checkpoint left there would be resumed
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    if os.environ.get("MEGATRAIN_CACHE_DIR"):
        env["MEGATRAIN_CACHE_DIR"] = os.environ["MEGATRAIN_CACHE_DIR"]
    world = tp * pp * dp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "megatrain.engine.train", "--spec", str(run_dir / "spec.json"),
           "--out", str(run_dir / "out")]  # fmt: skip
    peak_before = rank_peak_tflops(world)
    start, (busy0, ours0) = time.perf_counter(), busy_cpu_s()
    pinned = set(sorted(os.sched_getaffinity(0))[:world])
    proc = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.sched_setaffinity(0, pinned),
    )
    (busy1, ours1), wall = busy_cpu_s(), time.perf_counter() - start
    peak_after = rank_peak_tflops(world)
    if proc.returncode != 0:
        raise RuntimeError(f"tp={tp} pp={pp} dp={dp} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "iter_time_s" in r]
    if len(train) != steps:
        raise RuntimeError(f"tp={tp} pp={pp} dp={dp}: {len(train)} steps logged, {steps} asked for")
    return {
        "step_time_s": statistics.median(r["iter_time_s"] for r in train[warmup:]),
        "model_state_bytes": train[-1]["model_state_bytes"],
        "peak_tflops": (peak_before + peak_after) / 2,
        # Cores that other work kept busy during the run, on average.
        "other_load": max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall,
        "spec": raw,
    }


def predict(raw: dict[str, Any], peak: float) -> dict[str, Any]:
    world = raw["resources"]["devices"]
    result = plan(parse_spec(raw), cpu_pool(world, peak)).as_dict()
    mem = result["predicted"]["memory_breakdown"]
    return {
        "step_time_s": result["predicted"]["step_time_s"],
        "model_state_bytes": mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"],
        "time_breakdown": result["predicted"]["time_breakdown"],
    }


def compare(
    tmp: Path, layouts: list[tuple[int, int, int]], steps: int, warmup: int, retry: float | None = 0.25
) -> list[dict[str, Any]]:
    """One row per layout; a layout whose step time is off by more than `retry` (or whose run was
    not quiet) is measured once more, since another session's burst can stretch a whole run."""
    rows = []
    for tp, pp, dp in layouts:
        for _attempt in (0, 1):
            got = measure(tmp, tp, pp, dp, steps, warmup)
            want = predict(got["spec"], got["peak_tflops"])
            error = want["step_time_s"] / got["step_time_s"] - 1
            quiet = got["other_load"] < QUIET_CORES * cores()
            if retry is None or (quiet and abs(error) <= retry):
                break
        rows.append({
            "tp": tp, "pp": pp, "dp": dp,
            "measured_step_s": got["step_time_s"], "predicted_step_s": want["step_time_s"],
            "error": error, "quiet": quiet, "other_load": got["other_load"],
            "peak_tflops": got["peak_tflops"],
            "measured_model_state_bytes": got["model_state_bytes"],
            "predicted_model_state_bytes": want["model_state_bytes"],
        })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| tp | pp | dp | measured (ms) | predicted (ms) | error | other work (cores) | peak (TFLOP/s/rank) "
        "| model state measured (bytes) | predicted |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mark = "" if r["quiet"] else " (busy)"
        print(
            f"| {r['tp']} | {r['pp']} | {r['dp']} | {r['measured_step_s'] * 1e3:.0f} | "
            f"{r['predicted_step_s'] * 1e3:.0f} | {r['error']:+.0%}{mark} | {r['other_load']:.2f} | "
            f"{r['peak_tflops']:.3f} | {r['measured_model_state_bytes']:,} | "
            f"{r['predicted_model_state_bytes']:,} |"
        )
    quiet = [abs(r["error"]) for r in rows if r["quiet"]]
    if quiet:
        print(f"\nquiet runs: {len(quiet)} of {len(rows)}; worst step-time error {max(quiet):.0%}, "
              f"median {statistics.median(quiet):.0%}")  # fmt: skip
    else:
        print("\nno run was quiet: the step-time errors measure the other work, not the model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=None, help="tp,pp,dp triples (default: all 7)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-retry", action="store_true", help="measure each layout once")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = ap.parse_args()
    layouts = [tuple(int(x) for x in s.split(",")) for s in args.layouts] if args.layouts else LAYOUTS
    if args.warmup >= args.steps:
        ap.error("--warmup must be below --steps")
    with tempfile.TemporaryDirectory() as tmp:
        retry = None if args.no_retry else 0.25
        rows = compare(Path(tmp), layouts, args.steps, args.warmup, retry)  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(rows))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
