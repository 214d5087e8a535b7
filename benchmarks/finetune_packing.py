"""Sequence packing for fine-tuning: how full samples are, what the document mask costs in attention,
and how fast the dataset hands out packed batches.

    python benchmarks/finetune_packing.py                  # 20k records, seq 2048, attention at T 1024
    python benchmarks/finetune_packing.py --records 5000 --seq-length 1024

1. Fill: records with log-normal lengths (median ~300 tokens, as chat data tends to have) placed by
   packing.pack (best-fit decreasing) vs one record per padded sample: the share of a sample's tokens
   that are real, the samples needed, and the placement time.
2. Attention forward + backward on this CPU, one layer's core: SDPA is_causal (unpacked rows), SDPA
   with the block-diagonal mask (packed rows), and the reference twin; the mask's construction alone.
3. Loader: FinetuneDataset.batch samples/s on packed data read from the indexed cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.engine.data.finetune import build_finetune_datasets  # noqa: E402
from megatrain.engine.data.packing import pack  # noqa: E402
from megatrain.engine.data.tokenizers import ByteTokenizer  # noqa: E402
from megatrain.kernels.attention import Segments, attention, attention_reference  # noqa: E402
from megatrain.spec import DataSpec  # noqa: E402


def fill(records: int, seq_length: int) -> None:
    rng = np.random.default_rng(0)
    cap = seq_length + 1
    lengths = np.clip(rng.lognormal(np.log(300), 0.9, size=records).astype(np.int64), 8, cap)
    t0 = time.perf_counter()
    bins = pack(lengths, cap, seed=0)
    dt = time.perf_counter() - t0
    print(
        f"records {records}, lengths median {int(np.median(lengths))} mean {lengths.mean():.0f}, window {cap}"
    )
    print(f"  {'layout':<22}{'samples':>9}{'real tokens':>13}")
    print(f"  {'one record / sample':<22}{records:>9}{lengths.sum() / (records * cap):>13.2%}")
    print(f"  {'packed (best fit)':<22}{len(bins):>9}{lengths.sum() / (len(bins) * cap):>13.2%}")
    print(f"  placement: {dt:.2f} s ({records / dt:,.0f} records/s)")


def _time(fn, reps: int = 3) -> float:  # noqa: ANN001
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def attention_cost(t: int) -> None:
    b, h, hd = 2, 8, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, hd, generator=gen, requires_grad=True) for _ in range(3))
    ids = torch.as_tensor(np.repeat(np.arange(t // 256 + 1), 256)[:t]).expand(b, t).contiguous()

    def run(fn, segments):  # noqa: ANN001, ANN202
        return lambda: fn(q, k, v, segments).sum().backward()

    print(f"attention fwd+bwd, B={b} H={h} T={t} hd={hd} fp32, {torch.get_num_threads()} threads:")
    causal = _time(run(attention, None))
    print(f"  SDPA is_causal            {causal * 1e3:8.1f} ms")
    print(f"  SDPA document mask        {_time(lambda: run(attention, Segments(ids))()) * 1e3:8.1f} ms")
    reference = _time(lambda: run(attention_reference, Segments(ids))())
    print(f"  reference (fp32 softmax)  {reference * 1e3:8.1f} ms")
    print(f"  mask construction alone   {_time(lambda: Segments(ids).mask) * 1e3:8.2f} ms")


def loader(seq_length: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.jsonl"
        rng = np.random.default_rng(1)
        with open(path, "w") as f:
            for i in range(3000):
                n = int(np.clip(rng.lognormal(np.log(200), 0.8), 4, 4 * seq_length))
                f.write(
                    json.dumps({"prompt": f"question {i}: " + "x" * (n // 4), "response": "y" * n}) + "\n"
                )
        data = DataSpec(train=[{"path": path.as_uri()}], split="1,0,0")
        t0 = time.perf_counter()
        ds = build_finetune_datasets(data, ByteTokenizer(), seq_length, 0, Path(tmp) / "cache", True)["train"]
        built = time.perf_counter() - t0
        assert ds is not None
        n = 256
        dt = _time(lambda: ds.batch(list(range(n))), reps=2)
        print(f"loader: 3000 records tokenized, cached and packed in {built:.2f} s; stats {ds.stats}")
        rate = n / dt
        print(
            f"  batch(): {rate:,.0f} packed samples/s of {seq_length} tokens ({rate * seq_length:,.0f} tok/s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--attention-t", type=int, default=1024)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}")
    fill(args.records, args.seq_length)
    attention_cost(args.attention_t)
    loader(args.seq_length)


if __name__ == "__main__":
    main()
