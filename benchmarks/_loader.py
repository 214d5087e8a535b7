"""The loader's side of benchmarks/preprocess.py: samples/s a rank's Loader serves from a memory-mapped
indexed dataset, against what a training step consumes.

Consumption is measured (the engine's own CPU training step on benchmarks/engine_cpu.py's Llama shape)
and modelled for GPUs: an H100 at 40% MFU trains 6·N·tokens FLOPs (+ attention) per step, so a model
of N parameters eats 0.4 · 989e12 / (6N + 12·layers·hidden·seq) tokens/s per GPU; each rank must be
served at least that. The loader reads the step ahead in a thread, so it only has to be faster than
the step, not free; the ratio column says by how much it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrain.engine.data import GPTDataset, IndexedDataset, IndexedDatasetWriter, Loader

H100_BF16_PEAK = 989e12
MFU = 0.4
# (name, parameters, layers, hidden): models a rank might train, for the modelled consumption.
MODELS = [("125M", 125e6, 12, 768), ("1.3B", 1.3e9, 24, 2048), ("7B", 6.7e9, 32, 4096)]


@dataclass
class LoaderRow:
    seq_length: int
    micro_batch: int
    samples_per_s: float
    tokens_per_s: float


def synthetic_dataset(prefix: Path, tokens: int, seed: int = 0) -> IndexedDataset:
    """Documents of 50..4000 random uint16 tokens up to `tokens` in all (a real file on disk)."""
    rng = np.random.default_rng(seed)
    written = 0
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        while written < tokens:
            n = int(rng.integers(50, 4000))
            w.add_document(rng.integers(0, 50000, n, dtype=np.uint16))
            written += n
    return IndexedDataset(prefix)


def time_loader(
    indexed: IndexedDataset, cache: Path, seq_length: int, micro_batch: int, seconds: float
) -> LoaderRow:
    """One rank's Loader, read synchronously (no prefetch) for about `seconds`."""
    steps_planned = 4096
    ds = GPTDataset(indexed, (0, len(indexed)), seq_length, steps_planned * micro_batch, 1234, cache, {})
    loader = Loader(ds, micro_batch, micro_batch, background=False)
    loader.step(0)  # page in the indices
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and n < steps_planned:
        loader.step(n * micro_batch)
        n += 1
    elapsed = time.perf_counter() - start
    samples = n * micro_batch / elapsed
    return LoaderRow(seq_length, micro_batch, samples, samples * seq_length)


def gpu_tokens_per_s(params: float, layers: int, hidden: int, seq_length: int) -> float:
    """Tokens/s one H100 consumes training this model at 40% MFU (Narayanan et al.'s 6N + attention)."""
    flops_per_token = 6 * params + 12 * layers * hidden * seq_length
    return MFU * H100_BF16_PEAK / flops_per_token


def engine_data_share(workdir: Path, steps: int) -> dict[str, float]:
    """Train the demo's Llama shape for `steps` on a memory-mapped dataset, in this process, and read
    the loop's own timers: the share of each step spent waiting for data (the loader reads the next
    step ahead in its thread) and the samples/s the step consumes."""
    import json

    from megatrain.engine.train import run
    from megatrain.spec import JobSpec

    prefix = workdir / "engine-corpus"
    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(4000):
            w.add_document(np.append(rng.integers(0, 256, int(rng.integers(50, 600))), 256))
    spec = JobSpec.model_validate(
        {
            "name": "loader-bench",
            "model": {"num_layers": 6, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2},
            "data": {"train": [{"path": prefix.as_uri()}], "split": "100,0,0"},
            "training": {
                "train_iters": steps,
                "global_batch_size": 16,
                "micro_batch_size": 4,
                "log_interval": 1,
                "checkpoint_interval": 0,
                "eval_interval": 0,
                "precision": "fp32",
            },
            "parallelism": {"tp": 1, "pp": 1, "dp": 1},
        }
    )
    out = workdir / "engine-run"
    run(spec, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "data_time_s" in r][1:]  # the first step reads its data on the spot
    iter_s = float(np.mean([r["iter_time_s"] for r in rows]))
    data_s = float(np.mean([r["data_time_s"] for r in rows]))
    return {
        "iter_time_s": iter_s,
        "data_time_s": data_s,
        "samples_per_s": 16 / iter_s,
        "tokens_per_s": 16 * 256 / iter_s,
    }


def loader_section(workdir: Path, tokens: int, seconds: float, cpu_step_tokens_per_s: float | None) -> str:
    """The table printed by benchmarks/preprocess.py --sections loader."""
    indexed = synthetic_dataset(workdir / "loader-corpus", tokens)
    lines = [
        f"\nLoader: one rank, {indexed.num_tokens / 1e6:.0f}M tokens memory-mapped "
        f"({indexed.bin_path.stat().st_size / 1e6:.0f} MB), synchronous reads",
        f"{'seq':>6} {'mbs':>4} {'samples/s':>11} {'Mtok/s':>8}  "
        + "  ".join(f"{'x ' + name + ' H100':>12}" for name, *_ in MODELS)
        + ("  x CPU step" if cpu_step_tokens_per_s else ""),
    ]
    for seq in (2048, 4096):
        row = time_loader(indexed, workdir / "loader-cache", seq, 8, seconds)
        ratios = [row.tokens_per_s / gpu_tokens_per_s(p, layer, h, seq) for _, p, layer, h in MODELS]
        cpu = f"  {row.tokens_per_s / cpu_step_tokens_per_s:10.0f}x" if cpu_step_tokens_per_s else ""
        lines.append(
            f"{seq:6d} {row.micro_batch:4d} {row.samples_per_s:11.0f} {row.tokens_per_s / 1e6:8.1f}  "
            + "  ".join(f"{r:11.1f}x" for r in ratios)
            + cpu
        )
    lines.append(
        "x MODEL H100: the loader's tokens/s over what one H100 consumes training that model at 40% MFU"
        " (> 1: never the bottleneck); x CPU step: over the tokens/s of the engine's CPU step above."
    )
    return "\n".join(lines)
