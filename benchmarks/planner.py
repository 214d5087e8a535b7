"""Layout planner latency, and the gloo-on-localhost link constants the CPU pool uses.

    python benchmarks/planner.py                 # plan latency for several model / pool sizes
    python benchmarks/planner.py --repeat 5      # best of 5 calls each
    python benchmarks/planner.py --gloo          # measure all-reduce latency and bandwidth (2 ranks)
    python benchmarks/planner.py --published     # the GPU constants' fit: published runs vs predictions
    python benchmarks/planner.py --published --fit   # ... and the grid search that fitted them
    python benchmarks/planner.py --deepseek      # DeepSeek-V3's layout, each way to run its exchanges

The table: for each model (Llama shapes from 1B to 405B, Mixtral 8x7B and a DeepSeek-V3-class MoE)
and pool (8-GPU H100 nodes; H800 nodes for DeepSeek-V3, whose NVLink is half an H100's), the number
of candidate layouts considered, the best-of-N wall time of one `plan()` call, and the chosen layout
with its predicted step time and MFU (active FLOPs for MoE). The target (issue 16): a 400B-class
model on 6,000 GPUs planned in under a second. A second table predicts the layouts the published
runs used (explicit `parallelism`), to compare with their reported throughput (BENCHMARKS.md).
A third puts LoRA (rank 16 on every linear) beside full-parameter training of Llama-3-70B at 4,096
tokens on one node of 8 GPUs: trainable parameters, memory per GPU and predicted step time, the
cost model's predictions only.

DeepSeek-V3 cannot be written exactly: its multi-head latent attention is modelled as 128-head
MHA of hidden 7168 and its first 3 dense layers as MoE ones (model.moe.layer_freq has no offset),
which gives 705B total / 38.7B active parameters (published: 671B / 37B).

--published predicts the runs of megatrain.plan.published (Megatron-LM's H100 weak and strong
scaling, Llama 3 405B, Mixtral 8x7B, Megatron-Bridge's fp8 Llama runs) on their own layouts and
with `parallelism: auto`, against the throughput their sources report; --fit searches the grid of
the four fitted GPU constants on the rows not held out (least squares of log throughput).

--deepseek predicts DeepSeek-V3 on its published pp16 dp128 ep64 at 1F1B (full recompute, the least
that fits) with each way the engine runs its all-to-alls: pairs or two hops, in 1, 2 or 4 chunks,
with and without two micro-batches in flight (parallelism.moe_overlap_microbatches).

--gloo times `all_reduce` of 4 KiB to 16 MiB between two gloo processes on this host (one thread
each) and fits t = 2·latency + bytes / bandwidth, the two-rank ring formula of megatrain.plan.cost
(latency from the small messages, bandwidth from the large ones):
the figures behind megatrain.plan.cost.CPU_LINKS.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.plan import published as published_runs  # noqa: E402
from megatrain.plan.cost import GPU_CONSTANTS, StepSettings, predict_step  # noqa: E402
from megatrain.plan.memory import from_spec  # noqa: E402
from megatrain.plan.planner import Plan, PlanError, balanced_layers, plan  # noqa: E402
from megatrain.plan.pool import PoolSpec  # noqa: E402
from megatrain.plan.shapes import shape_of_spec, spec_param_counts  # noqa: E402
from megatrain.spec import parse_spec  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "1B": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 8,
           "ffn_hidden_size": 8192, "seq_length": 4096, "vocab_size": 128256},
    "8B": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
           "ffn_hidden_size": 14336, "seq_length": 8192, "vocab_size": 128256},
    "70B": {"num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_query_groups": 8,
            "ffn_hidden_size": 28672, "seq_length": 8192, "vocab_size": 128256},
    "405B": {"num_layers": 126, "hidden_size": 16384, "num_attention_heads": 128, "num_query_groups": 8,
             "ffn_hidden_size": 53248, "seq_length": 8192, "vocab_size": 128256},
    "Mixtral-8x7B": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
                     "ffn_hidden_size": 14336, "seq_length": 4096, "vocab_size": 32000,
                     "moe": {"num_experts": 8, "router_topk": 2}},
    "DeepSeek-V3": {"num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
                    "ffn_hidden_size": 18432, "seq_length": 4096, "vocab_size": 129280,
                    "moe": {"num_experts": 256, "router_topk": 8, "ffn_hidden_size": 2048,
                            "shared_expert_ffn_hidden_size": 2048, "router_score_function": "sigmoid",
                            "router_num_groups": 8, "router_group_topk": 4}},
}  # fmt: skip
CASES = [("1B", 8, 64), ("8B", 64, 512), ("70B", 512, 1024), ("70B", 2048, 2048), ("405B", 2048, 2048),
         ("405B", 6000, 2000), ("405B", 16384, 2048), ("Mixtral-8x7B", 64, 256),
         ("DeepSeek-V3", 2048, 15360)]  # fmt: skip
"""(model, GPUs, global batch in sequences)."""
PUBLISHED = [
    # Llama 3 405B: Dubey et al. 2024, table 4 (16,384 H100, 8K sequences, 41% MFU).
    ("405B", 16384, 2048, {"tp": 8, "pp": 16, "dp": 128, "virtual_stages": 7}),
    # Mixtral 8x7B: Megatron-Core's recipe layout on 64 H100 (tp 1, pp 4, ep 8).
    ("Mixtral-8x7B", 64, 256, {"tp": 1, "pp": 4, "dp": 16, "ep": 8, "virtual_stages": 8}),
    # DeepSeek-V3: 2,048 H800, PP16 × EP64 × DP128 (ZeRO-1), no TP (DeepSeek-AI 2024, section 3.2).
    ("DeepSeek-V3", 2048, 15360, {"tp": 1, "pp": 16, "dp": 128, "ep": 64}),
]  # fmt: skip
"""(model, GPUs, global batch, parallelism) of published runs, predicted as given with the least
recompute that fits (an uneven pipeline split as the planner would cut it)."""


def h100_pool(gpus: int, accelerator: str = "NVIDIA H100 80GB HBM3", nvlink_gbps: float = 450.0) -> PoolSpec:
    return PoolSpec(
        name=accelerator.split()[1].lower(),
        accelerator=accelerator,
        device_memory_bytes=80 << 30,
        peak_tflops={"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0},
        devices_per_node=8,
        nodes=-(-gpus // 8),
        intra_node_bandwidth_gbps=nvlink_gbps,
        inter_node_bandwidth_gbps=50.0,
    )


def pool_for(name: str, gpus: int) -> PoolSpec:
    """H100 nodes, or H800 ones (NVLink 400 GB/s both ways, 8 × 400 Gb/s InfiniBand) for DeepSeek-V3."""
    if name == "DeepSeek-V3":
        return h100_pool(gpus, "NVIDIA H800", nvlink_gbps=200.0)
    return h100_pool(gpus)


def _spec(name: str, gpus: int, batch: int, parallelism: dict[str, Any] | None = None,
          recompute: str = "none", model: dict[str, Any] | None = None, **training: Any) -> Any:  # fmt: skip
    raw: dict[str, Any] = {
        "name": name.lower(),
        "model": {"arch": "llama", **MODELS[name], **(model or {})},
        "data": {"train": [{"dataset": "corpus"}]},
        "training": {"global_batch_size": batch, "micro_batch_size": 1, "precision": "bf16",
                     "recompute": recompute, **training},
        "resources": {"devices": gpus},
    }  # fmt: skip
    if parallelism is not None:
        raw["parallelism"] = {**parallelism, "sequence_parallel": parallelism["tp"] > 1}
    return parse_spec(raw)


def _layout_text(lay: dict[str, Any]) -> str:
    extra = "".join(f" {k}={lay[k]}" for k in ("cp", "ep") if lay[k] > 1)
    flags = (
        f"{' sp' if lay['sequence_parallel'] else ''}{' dist-opt' if lay['distributed_optimizer'] else ''}"
    )
    return (f"tp={lay['tp']} pp={lay['pp']} dp={lay['dp']}{extra} v={lay['virtual_stages']} "
            f"mbs={lay['micro_batch_size']} {lay['recompute']}{flags}")  # fmt: skip


def _row(name: str, gpus: int, batch: int, d: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": name, "gpus": gpus, "global_batch": batch, "considered": d["candidates"]["considered"],
        "layout": _layout_text(d["layout"]),
        "step_s": d["predicted"]["step_time_s"], "mfu": d["predicted"]["mfu"],
        "tflops": d["predicted"]["tflops_per_gpu"],
        "tokens_per_gpu": d["predicted"]["tokens_per_s"] / gpus,
        "gib": d["predicted"]["memory_per_gpu_bytes"] / (1 << 30),
        "params_b": d["parameters"]["total"] / 1e9, "active_b": d["parameters"]["active"] / 1e9,
        "time": {k: round(v, 3) for k, v in d["predicted"]["time_breakdown"].items() if v},
    }  # fmt: skip


def plan_latency(repeat: int) -> list[dict[str, Any]]:
    rows = []
    for name, gpus, batch in CASES:
        spec, pool = _spec(name, gpus, batch), pool_for(name, gpus)
        times, result = [], None
        for _ in range(repeat):
            start = time.perf_counter()
            result = plan(spec, pool)
            times.append(time.perf_counter() - start)
        assert result is not None
        rows.append({**_row(name, gpus, batch, result.as_dict()), "plan_ms": min(times) * 1e3})
    return rows


def published() -> list[dict[str, Any]]:
    """The published runs' own layouts, predicted as explicit specs."""
    rows = []
    for name, gpus, batch, par in PUBLISHED:
        split = balanced_layers(MODELS[name]["num_layers"], par["pp"], par.get("virtual_stages", 1))
        par = {**par, "pipeline_layers": list(split) if split else None}
        for rc in ("none", "selective", "full"):
            try:
                result = plan(_spec(name, gpus, batch, par, rc), pool_for(name, gpus))
            except PlanError:
                continue
            rows.append(_row(name, gpus, batch, result.as_dict()))
            break
    return rows


def print_published(rows: list[dict[str, Any]]) -> None:
    print("\n| published run | GPUs | layout | params (B, total/active) | step (s) | tokens/s/GPU "
          "| TFLOP/s/GPU | MFU | GiB/GPU |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['gpus']:,} | {r['layout']} | {r['params_b']:.1f} / {r['active_b']:.1f} | "
              f"{r['step_s']:.2f} | {r['tokens_per_gpu']:,.0f} | {r['tflops']:.0f} | {r['mfu']:.1%} | "
              f"{r['gib']:.1f} |")  # fmt: skip


LORA = {"method": "lora", "lora": {"rank": 16, "targets": ["qkv", "proj", "fc1", "fc2"]}}
LORA_SHAPE = ("70B", 8, {"seq_length": 4096})
"""Llama-3-70B at 4,096-token sequences, 8 sequences per step (model, global batch, model overrides)."""


def _method_row(
    run: str, gpus: int, spec: Any, result: Plan | None, note: str = "", fits: bool = True
) -> dict[str, Any]:
    """One row of the LoRA table: a plan's figures, or (result None) only why nothing fits."""
    counts = spec_param_counts(spec)
    assert counts is not None
    row: dict[str, Any] = {
        "run": run, "gpus": gpus, "fits": fits and result is not None, "note": note,
        "trainable": counts.get("trainable", counts["total"]), "total": counts["total"],
    }  # fmt: skip
    if result is None:
        return row
    pred = result.as_dict()["predicted"]
    mem = pred["memory_breakdown"]
    parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
    row.update(
        layout=_layout_text(result.choice.as_dict()),
        step_s=pred["step_time_s"],
        mfu=pred["mfu"],
        tokens_per_gpu=pred["tokens_per_s"] / gpus,
        gib=pred["memory_per_gpu_bytes"] / (1 << 30),
        parts={k.removesuffix("_bytes"): mem[k] / (1 << 30) for k in parts},
    )
    return row


def lora_vs_full() -> list[dict[str, Any]]:
    """LoRA planned on 8 GPUs; full-parameter training at the LoRA's layout (what it would need
    there), planned on the same 8 GPUs (nothing fits) and on 32."""
    name, batch, model = LORA_SHAPE
    lora_spec, full_spec = _spec(name, 8, batch, model=model, **LORA), _spec(name, 8, batch, model=model)
    pool = pool_for(name, 8)
    lora = plan(lora_spec, pool)
    rows = [_method_row("LoRA r=16, planned", 8, lora_spec, lora)]
    # Full-parameter training on the LoRA's layout, estimated and predicted as the planner would.
    c = lora.choice
    est = from_spec(c.apply(full_spec), c.layout)
    settings = StepSettings(micro_batch_size=c.micro_batch_size, global_batch_size=batch,
                            recompute=c.recompute, distributed_optimizer=c.distributed_optimizer)  # fmt: skip
    t = predict_step(shape_of_spec(full_spec, full_spec.model.vocab_size), c.layout, settings, pool)
    same = Plan(c, t, est, 8, pool.name, "bf16", explicit=True)
    rows.append(_method_row("full, at the LoRA's layout", 8, full_spec, same, "does not fit", fits=False))
    try:
        plan(full_spec, pool)
        rows.append(_method_row("full, planned", 8, full_spec, None, note="unexpectedly fits"))
    except PlanError as exc:
        rows.append(_method_row("full, planned", 8, full_spec, None, note=exc.errors[0]["message"]))
    full_32 = _spec(name, 32, batch, model=model)
    rows.append(_method_row("full, planned", 32, full_32, plan(full_32, pool_for(name, 32))))
    return rows


def print_lora(rows: list[dict[str, Any]]) -> None:
    print("\n| Llama-3-70B, 4,096 tokens, 8 sequences/step | GPUs | layout | trainable params | GiB/GPU "
          "(params / grads / optimizer / activations) | step (s) | tokens/s/GPU | MFU |")  # fmt: skip
    print("|---|---:|---|---:|---|---:|---:|---:|")
    for r in rows:
        n = r["trainable"]
        trainable = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        if "layout" not in r:
            print(f"| {r['run']} | {r['gpus']} | {r['note']} | {trainable} | | | | |")
            continue
        p = r["parts"]
        mem = (f"{r['gib']:.1f} ({p['params']:.1f} / {p['grads']:.2f} / {p['optimizer']:.2f} / "
               f"{p['activations']:.1f}){'' if r['fits'] else ': ' + r['note']}")  # fmt: skip
        print(f"| {r['run']} | {r['gpus']} | {r['layout']} | {trainable} | {mem} | {r['step_s']:.2f} | "
              f"{r['tokens_per_gpu']:,.0f} | {r['mfu']:.1%} |")  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | GPUs | global batch | candidates | plan (ms) | chosen layout | step (s) | MFU | GiB/GPU |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['gpus']:,} | {r['global_batch']:,} | {r['considered']:,} | "
              f"{r['plan_ms']:.1f} | {r['layout']} | {r['step_s']:.2f} | {r['mfu']:.1%} | {r['gib']:.1f} |")  # fmt: skip  # noqa: E501


# -- the GPU constants against published runs ---------------------------------------------------------


def published_calibration() -> list[dict[str, Any]]:
    """Each published run: its figure, the prediction for its layout and `parallelism: auto`'s."""
    rows = []
    for run in published_runs.RUNS:
        pred, auto = published_runs.predict(run), published_runs.plan_auto(run)
        auto_tokens = auto.time.tokens_per_s / run.gpus
        c = auto.choice
        rows.append({
            "run": run.name, "gpus": run.gpus, "held_out": run.held_out, "precision": run.precision,
            "published_layout": " ".join(f"{k}={v}" for k, v in run.parallelism.items()),
            "published_tflops": run.tflops, "published_tokens_per_gpu": run.published_tokens_per_gpu,
            "layout": pred.layout, "tokens_per_gpu": pred.tokens_per_gpu, "error": pred.error,
            "auto_layout": f"{c.layout.describe()} v={c.layout.virtual_stages} mbs={c.micro_batch_size} "
                           f"{c.recompute}",
            "auto_tokens_per_gpu": auto_tokens, "auto_gain": auto_tokens / pred.tokens_per_gpu - 1,
            "source": run.source,
        })  # fmt: skip
    return rows


def print_calibration(rows: list[dict[str, Any]]) -> None:
    print("| run | GPUs | fit | published layout | published tokens/s/GPU (TFLOP/s) "
          "| predicted (open choices) | tokens/s/GPU | error | auto | auto tokens/s/GPU "
          "| auto vs the published layout |")  # fmt: skip
    print("|---|---:|---|---|---:|---|---:|---:|---|---:|---:|")
    for r in rows:
        tf = f" ({r['published_tflops']:.0f})" if r["published_tflops"] else ""
        print(f"| {r['run']} | {r['gpus']:,} | {'held out' if r['held_out'] else 'train'} | "
              f"{r['published_layout']} | {r['published_tokens_per_gpu']:,.0f}{tf} | {r['layout']} | "
              f"{r['tokens_per_gpu']:,.0f} | {r['error']:+.1%} | {r['auto_layout']} | "
              f"{r['auto_tokens_per_gpu']:,.0f} | {r['auto_gain']:+.1%} |")  # fmt: skip


FIT_GRID = {
    "max_fraction": [0.54 + 0.01 * i for i in range(10)],
    "elementwise_bytes": [60.0, 120.0, 180.0, 210.0, 240.0, 270.0, 300.0],
    "tp_overlap": [0.0, 0.5, 1.0],
    "dp_overlap": [0.7, 0.8, 0.9, 1.0],
}
"""The fitted GPU constants and the values searched (the rest stay as in GPU_CONSTANTS)."""


def fit_constants(top: int = 5) -> list[tuple[float, dict[str, float]]]:
    """The grid's best points by the rms of log(predicted / published) over the rows not held out."""
    train = [r for r in published_runs.RUNS if not r.held_out]
    scored = []
    for values in itertools.product(*FIT_GRID.values()):
        point = dict(zip(FIT_GRID, values, strict=True))
        c = dataclasses.replace(GPU_CONSTANTS, **point)
        logs = [math.log1p(published_runs.predict(r, c).error) for r in train]
        scored.append((math.sqrt(sum(x * x for x in logs) / len(logs)), point))
    scored.sort(key=lambda x: x[0])
    for rms, point in scored[:top]:
        print(f"rms {rms:.4f}  " + "  ".join(f"{k}={v:g}" for k, v in point.items()))
    return scored[:top]


# -- gloo link constants ----------------------------------------------------------------------------

SIZES = [1 << k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB


def _gloo_rank(rank: int, store_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    results = {}
    for size in SIZES:
        t = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(t)
        samples = []
        for _ in range(15):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - start)
        results[size] = statistics.median(samples)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def gloo_links() -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_gloo_rank, args=(r, os.path.join(tmp, "store"), out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    # Two-rank ring all-reduce: t = 2·latency + bytes / bandwidth. The latency from the small
    # messages (their median), the bandwidth from the slope between the two largest.
    xs = sorted(times)
    a = statistics.median(times[x] for x in xs[:3])
    b = (times[xs[-1]] - times[xs[-2]]) / (xs[-1] - xs[-2])
    print("| bytes | all-reduce (ms) | fit (ms) |")
    print("|---:|---:|---:|")
    for x, y in times.items():
        print(f"| {x:,} | {y * 1e3:.3f} | {(a + b * x) * 1e3:.3f} |")
    links = {"bandwidth_gbps": 1 / b / 1e9, "latency_us": max(a, 0.0) / 2 * 1e6}
    print(f"bandwidth {links['bandwidth_gbps']:.2f} GB/s, latency {links['latency_us']:.0f} us")
    return links


DEEPSEEK_PUBLISHED_TOKENS_PER_GPU = 1543
"""DeepSeek-V3 technical report: 2.664M H800 GPU hours for 14.8T tokens on 2,048 GPUs."""


def deepseek_exchanges() -> None:
    """The --deepseek table."""
    name, gpus, batch = "DeepSeek-V3", 2048, 15360
    par = {"tp": 1, "pp": 16, "dp": 128, "ep": 64, "pipeline_layers": list(balanced_layers(61, 16, 1))}
    print("| dispatch | chunks | lanes | step (s) | exposed all-to-all (s) | tokens/s/GPU "
          "| published / predicted | GiB/GPU |\n|---|---:|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for lanes, how, k in itertools.product((False, True), ("pairs", "nodes"), (1, 2, 4)):
        way = {"moe_dispatch": how, "moe_overlap_chunks": k, "moe_overlap_microbatches": lanes}
        r = plan(_spec(name, gpus, batch, {**par, **way}, "full"), pool_for(name, gpus))
        t, per_gpu, gib = r.time, r.time.tokens_per_s / gpus, r.memory.total_bytes / 2**30
        print(f"| {'two hops' if how == 'nodes' else how} | {k} | {'yes' if lanes else 'no'} | "
              f"{t.step_time_s:.2f} | {t.ep_comm_s:.2f} | {per_gpu:,.0f} | "
              f"{DEEPSEEK_PUBLISHED_TOKENS_PER_GPU / per_gpu:.2f} | {gib:.1f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="plan() calls per case (the best is shown)")
    parser.add_argument("--gloo", action="store_true", help="measure gloo all-reduce on localhost instead")
    parser.add_argument("--published", action="store_true", help="published runs against the predictions")
    parser.add_argument("--fit", action="store_true", help="with --published: search the fitted constants")
    parser.add_argument("--deepseek", action="store_true", help="DeepSeek-V3's layout, each exchange")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.deepseek:
        deepseek_exchanges()
        return 0
    if args.published:
        rows = published_calibration()
        print_calibration(rows)
        if args.fit:
            fit_constants()
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    result: Any = gloo_links() if args.gloo else plan_latency(args.repeat)
    if not args.gloo:
        print_table(result)
        runs = published()
        print_published(runs)
        methods = lora_vs_full()
        print_lora(methods)
        result += [{**r, "published": True} for r in runs]
        result += [{**r, "lora_table": True} for r in methods]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
