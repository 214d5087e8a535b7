"""The engine run whole, as a user runs it, against Hugging Face's bare training loop on the same
shapes, in the same minutes.

The engine: `torchrun --standalone --nproc_per_node 1 -m megatrain.engine.train` on a pretraining
spec (Llama, fp32, the byte tokenizer over examples/data/corpus.jsonl), with everything a job runs
around its steps: the loader's prefetch thread, metrics and progress files, device statistics, the
hang watch's progress thread, straggler and host-load sampling. Its throughput is read from the
wall-clock times of its metrics rows (every --log-interval steps), the first row (warm-up) left out:
what is between two rows is everything the run does in those steps.

Hugging Face: LlamaForCausalLM (sdpa) with the same shapes, padded vocabulary and threads,
forward with labels, backward, clip_grad_norm_(1.0), fused AdamW, zero_grad; the median step of
--hf-steps after two warm-up steps, timed before the engine run and again after it (the ratio uses
their mean, and both are printed: a drift between them says the machine's load changed).

    PYTHONPATH=. python benchmarks/engine_whole.py                 # ~3 min on 2 cores
    PYTHONPATH=. python benchmarks/engine_whole.py --load 2        # with 2 busy processes beside
    PYTHONPATH=. python benchmarks/engine_whole.py --tiny          # a smoke run

--load N starts N processes doing 1-thread matrix products for the whole measurement (both sides):
a shared machine's neighbours.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "examples" / "data" / "corpus.jsonl"

SHAPES = {
    "base": {"layers": 4, "hidden": 256, "heads": 4, "groups": 2, "seq": 256, "batch": 8},
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "groups": 2, "seq": 64, "batch": 2},
}


def engine_spec(s: dict[str, int], steps: int, log_interval: int, profile: int) -> dict[str, Any]:
    training: dict[str, Any] = {
        "train_iters": steps,
        "global_batch_size": s["batch"],
        "micro_batch_size": s["batch"],
        "lr": 3.0e-4,
        "min_lr": 3.0e-5,
        "warmup_iters": 0,
        "precision": "fp32",
        "checkpoint_interval": 0,
        "log_interval": log_interval,
        "eval_interval": 0,
    }
    if profile:
        training["profile_steps"] = profile
    return {
        "name": "bench-whole-run",
        "kind": "pretrain",
        "model": {
            "arch": "llama",
            "num_layers": s["layers"],
            "hidden_size": s["hidden"],
            "num_attention_heads": s["heads"],
            "num_query_groups": s["groups"],
            "seq_length": s["seq"],
        },
        "data": {
            "tokenizer": {"type": "byte"},
            "train": [{"path": CORPUS.as_uri(), "weight": 1.0}],
            "text_key": "text",
            "split": "100,0,0",
        },
        "training": training,
        "parallelism": {"tp": 1, "pp": 1, "dp": 1},
        "resources": {"devices": 1},
    }


def hf_tokens_per_s(s: dict[str, int], vocab: int, ffn: int, steps: int) -> float:
    """Hugging Face's bare loop: the median step's tokens/s after two warm-up steps."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
        num_key_value_heads=s["groups"], intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=s["seq"], tie_word_embeddings=False, use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 2):
        tokens = torch.randint(0, 257, (s["batch"], s["seq"]), generator=g)
        t0 = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return s["batch"] * s["seq"] / statistics.median(times)


def engine_tokens_per_s(spec: dict[str, Any], s: dict[str, int], workdir: Path) -> dict[str, float]:
    """Run the engine under torchrun; tokens/s from its metrics rows' wall-clock times (and the
    median of the rows' own tokens_per_s, which leaves out the pauses the loop excludes)."""
    spec_path, out = workdir / "spec.yaml", workdir / "run"
    spec_path.write_text(yaml.safe_dump(spec))
    torchrun = shutil.which("torchrun") or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc_per_node", "1", "-m", "megatrain.engine.train"]
    cmd += ["--spec", str(spec_path), "--out", str(out)]
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"the engine run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    if len(rows) < 3:
        raise SystemExit("too few metrics rows: raise --steps or lower --log-interval")
    tokens = s["batch"] * s["seq"]
    span = rows[-1]["time"] - rows[0]["time"]
    steps = rows[-1]["step"] - rows[0]["step"]
    return {
        "wall_tokens_per_s": tokens * steps / span,
        "row_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
        "process_s": wall,
    }


def _busy() -> None:
    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--steps", type=int, default=100, help="engine steps (rows every --log-interval)")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--hf-steps", type=int, default=15, help="Hugging Face steps before and after")
    parser.add_argument("--load", type=int, default=0, help="busy 1-thread processes beside both runs")
    parser.add_argument("--profile", type=int, default=0, help="the engine run profiles this many steps")
    args = parser.parse_args()
    s = SHAPES["tiny" if args.tiny else "base"]

    from megatrain.engine.data.tokenizers import build_tokenizer
    from megatrain.spec import parse_spec

    spec = engine_spec(s, args.steps, args.log_interval, args.profile)
    model = parse_spec(spec).model
    vocab = model.padded_vocab(build_tokenizer(parse_spec(spec).data.tokenizer).vocab_size)
    busy = [mp.get_context("spawn").Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in busy:
        p.start()
    try:
        hf_before = hf_tokens_per_s(s, vocab, model.ffn_size, args.hf_steps)
        with tempfile.TemporaryDirectory() as tmp:
            engine = engine_tokens_per_s(spec, s, Path(tmp))
        hf_after = hf_tokens_per_s(s, vocab, model.ffn_size, args.hf_steps)
    finally:
        for p in busy:
            p.terminate()
    hf = (hf_before + hf_after) / 2
    load = os.getloadavg()[0]
    print(f"shape {s} | vocab {vocab} | threads {torch.get_num_threads()}", end=" ")
    print(f"| busy {args.load} | load average {load:.2f}")
    print("| run | tokens/s | vs Hugging Face |")
    print("|---|---:|---:|")
    print(f"| Hugging Face, before | {hf_before:,.0f} | |")
    print(f"| Hugging Face, after | {hf_after:,.0f} | |")
    print(f"| engine, whole run (metrics rows' wall clock) | {engine['wall_tokens_per_s']:,.0f} | "
          f"{engine['wall_tokens_per_s'] / hf:.2f}x |")  # fmt: skip
    print(f"| engine, rows' own tokens_per_s (median) | {engine['row_tokens_per_s']:,.0f} | "
          f"{engine['row_tokens_per_s'] / hf:.2f}x |")  # fmt: skip
    print(f"engine process: {engine['process_s']:.1f} s for {args.steps} steps", file=sys.stderr)


if __name__ == "__main__":
    main()
