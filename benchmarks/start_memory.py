"""Each rank's peak resident memory at a job's start and first steps, against its shard of the state.

Runs the real engine under torchrun (gloo, CPU) at tp × pp (× dp): a Llama of ~360M parameters by
default, from random weights and from a Hugging Face folder (written by transformers, bf16, sharded).
Every rank runs inside a small wrapper (benchmarks/_rank_peak.py) that reports the engine process's
peak resident set (getrusage of its child: the kernel's VmHWM at exit), measured outside the engine.
The same layout with one layer per stage is the baseline (the interpreter, torch, gloo, the data
pipeline, the rank's embedding or head); what a rank holds beyond it is compared with the training
state of the layers it adds: 16 bytes per fp32 parameter (weights, gradient buffer, Adam's two
moments), 4 + 4 + 8/dp with the distributed optimizer.

    python benchmarks/start_memory.py                        # 360M, tp=4 x pp=2, random and hf (~5 min)
    python benchmarks/start_memory.py --model 500m --dp 2    # tp=4 x pp=2 x dp=2, distributed optimizer
    python benchmarks/start_memory.py --model tiny --init random   # seconds: the test's smoke run

Prints one row per rank and a summary line (the worst ratio); --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODELS: dict[str, dict[str, int]] = {
    # ~360M: 24 layers of 1024 wide, GQA 16/4 heads, SwiGLU 2816, a 32k vocabulary.
    "360m": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 4,
             "ffn_hidden_size": 2816, "vocab_size": 32000},
    # ~500M: 16 layers of 1536 wide, GQA 12/4 heads, SwiGLU 4096, a 32k vocabulary. At tp=4 x pp=2 x
    # dp=2 its 16 ranks' whole fp32 copies (2 GB each) would need 32 GB: more than this 24 GiB host.
    "500m": {"num_layers": 16, "hidden_size": 1536, "num_attention_heads": 12, "num_query_groups": 4,
             "ffn_hidden_size": 4096, "vocab_size": 32000},
    "tiny": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 4,
             "ffn_hidden_size": 128, "vocab_size": 512},
}  # fmt: skip
SEQ = 128


def write_corpus(path: Path) -> Path:
    """Plain-text documents: the byte tokenizer reads them, so no tokenizer files are needed."""
    words = ["def", "return", "import", "class", "self", "while", "for", "if", "else", "yield", "None"]
    with open(path, "w") as f:
        for i in range(64):
            text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(400))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_hf_folder(model: dict[str, int], dest: Path) -> Path:
    """A transformers Llama of this shape, random, saved bf16 in 200 MB shards."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=model["num_layers"],
        hidden_size=model["hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_query_groups"],
        intermediate_size=model["ffn_hidden_size"],
        vocab_size=model["vocab_size"],
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(dest, max_shard_size="200MB")
    del hf
    return dest


def spec_for(model: dict[str, int], layout: dict[str, Any], corpus: Path, hf: Path | None) -> dict[str, Any]:
    world = layout["tp"] * layout["pp"] * layout["dp"]
    spec: dict[str, Any] = {
        "name": "start-memory",
        "model": {"arch": "llama", **model, "seq_length": SEQ},
        "data": {"train": [{"path": corpus.as_uri()}], "split": "100,0,0"},
        "training": {
            "train_iters": 2,
            "global_batch_size": 2 * layout["dp"],
            "micro_batch_size": 1,
            "lr": 1e-4,
            "warmup_iters": 0,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 0,
            "checkpoint_interval": 0,
            # The run's one (final) checkpoint written from the live state: an async save stages a
            # host copy of it (12 bytes per parameter here), host memory beside a GPU's, not the
            # start-up or step peak this measures.
            "async_checkpoint": False,
            "seed": 1,
        },
        "parallelism": {**layout, "sequence_parallel": True, "distributed_optimizer": layout["dp"] > 1},
        "resources": {"devices": world},
    }
    if hf is not None:  # the model as the folder's config.json describes it (norm_eps, rope_theta, ...)
        from megatrain.engine.interop import read_hf_config
        from megatrain.hf_config import model_fields_from_hf

        fields = model_fields_from_hf(read_hf_config(hf), seq_length=SEQ)
        spec["model"] = {**fields, "init_from": "hf:" + hf.as_uri()}
    return spec


def run_job(spec: dict[str, Any], work: Path) -> dict[int, int]:
    """torchrun the engine with each rank wrapped; returns {rank: peak RSS bytes}."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    peaks = work / "peaks"
    peaks.mkdir(exist_ok=True)
    world = spec["resources"]["devices"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    env.update(MEGATRAIN_PEAK_DIR=str(peaks), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "--no-python", sys.executable, str(HERE / "_rank_peak.py"),
           "--spec", str(work / "spec.json"), "--out", str(work / "out")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        out = f"{proc.stdout[-3000:]}\n{proc.stderr[:3000]}"
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{out}")
    return {int(p.stem): int(p.read_text()) for p in peaks.glob("*.peak")}


def rank_params(model: dict[str, int], layout: dict[str, Any]) -> dict[int, int]:
    """Parameters each rank holds (plan.shapes, the planner's count of what the engine builds)."""
    from megatrain.plan.shapes import ModelShape, stage_params

    shape = ModelShape(**model, seq_length=SEQ)  # Llama: SwiGLU, RoPE, RMSNorm, no biases, untied
    tp, pp, dp = layout["tp"], layout["pp"], layout["dp"]
    return {
        rank: sum(stage_params(shape, tp, pp, rank // (tp * dp)).values()) for rank in range(tp * pp * dp)
    }


def state_bytes_per_param(dp: int) -> float:
    """fp32: weights 4, gradient buffer 4, Adam m and v 8 (sharded over dp by the distributed optimizer)."""
    return 4 + 4 + 8 / dp


def measure(model_name: str, layout: dict[str, Any], inits: list[str], work: Path) -> list[dict[str, Any]]:
    """One row per rank and start (random | hf): its peak, the baseline's, and the ratio of the
    difference to the training state of the layers the full model adds."""
    model = MODELS[model_name]
    base_model = {**model, "num_layers": layout["pp"]}  # one layer per stage
    corpus = write_corpus(work / "corpus.jsonl")
    per_param = state_bytes_per_param(layout["dp"])
    # One baseline (random weights) for both starts: what reading a folder adds is part of the measure.
    base = run_job(spec_for(base_model, layout, corpus, None), work / "base")
    held, base_held = rank_params(model, layout), rank_params(base_model, layout)
    rows = []
    for init in inits:
        hf = write_hf_folder(model, work / "hf") if init == "hf" else None
        full = run_job(spec_for(model, layout, corpus, hf), work / f"full-{init}")
        for rank in sorted(full):
            added = held[rank] - base_held[rank]
            rows.append({
                "init": init,
                "rank": rank,
                "params": held[rank],
                "state_bytes": held[rank] * per_param,
                "peak_bytes": full[rank],
                "baseline_peak_bytes": base[rank],
                "ratio": (full[rank] - base[rank]) / (added * per_param),
            })  # fmt: skip
        if hf is not None:
            shutil.rmtree(hf)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="360m")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--init", choices=["random", "hf", "both"], default="both")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    layout = {"tp": args.tp, "pp": args.pp, "dp": args.dp}
    inits = ["random", "hf"] if args.init == "both" else [args.init]
    with tempfile.TemporaryDirectory(prefix="start-memory-") as tmp:
        rows = measure(args.model, layout, inits, Path(tmp))
    gib = 1 << 30
    print(f"model {args.model}, tp={args.tp} pp={args.pp} dp={args.dp}, fp32, seq {SEQ}, 2 steps")
    head = ("init", "rank", "params", "state GiB", "peak GiB", "base GiB", "ratio")
    print("{:>6} {:>4} {:>12} {:>9} {:>8} {:>8} {:>6}".format(*head))
    for r in rows:
        gibs = [r[k] / gib for k in ("state_bytes", "peak_bytes", "baseline_peak_bytes")]
        print(
            "{:>6} {:>4} {:>12,} {:>9.2f} {:>8.2f} {:>8.2f} {:>6.2f}".format(
                r["init"], r["rank"], r["params"], *gibs, r["ratio"]
            )
        )
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio {worst:.2f} (peak above the one-layer baseline / the added layers' state)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
