"""lm-eval's requests through our EngineLM on a CPU: items/s of loglikelihood and generate_until,
batched against one at a time, and against lm-eval's own HFLM on the same weights (exported with
interop.hf) in the same process.

    PYTHONPATH=. python benchmarks/eval_lm.py              # ~2 min on a 2-core CPU
    PYTHONPATH=. python benchmarks/eval_lm.py --tiny       # a smoke run

loglikelihood: N (context, continuation) pairs cut from a synthetic corpus (contexts of 40-200
bytes, continuations of 1-12), as a multiple-choice task sends them. generate_until: N prompts,
greedy, max_gen_toks tokens each with no stop string met (the end-of-document token is masked out
of the vocabulary by choosing prompts the model continues; what counts is tokens decoded). Each
cell is the best of --repeats runs (the machine is shared: the fastest run is the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = {
    "small": {"arch": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
              "num_query_groups": 4, "ffn_hidden_size": 704, "seq_length": 256},
    "tiny": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 64},
}  # fmt: skip
WORDS = [
    "the",
    "model",
    "of",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
    "and",
    "then",
    "ran",
    "to",
    "the",
    "door",
    "of",
    "house",
    "with",
    "light",
]


def _text(rng: random.Random, n: int) -> str:
    out = ""
    while len(out) < n:
        out += rng.choice(WORDS) + " "
    return out[:n]


def requests(n: int, seq: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[str]]:
    """(loglikelihood pairs, generation prompts), deterministic."""
    rng = random.Random(seed)
    pairs = [(_text(rng, rng.randint(seq // 6, seq * 3 // 4)), " " + _text(rng, rng.randint(1, 12)))
             for _ in range(n)]  # fmt: skip
    prompts = [_text(rng, rng.randint(seq // 8, seq // 4)) for _ in range(n)]
    return pairs, prompts


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(model: str, n: int, gen_tokens: int, repeats: int, threads: int) -> list[dict[str, Any]]:
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatrain.engine.evaluation.lm import EngineLM
    from megatrain.engine.interop.hf import export_model_hf
    from megatrain.engine.interop.hf_tokenizer import export_tokenizer
    from megatrain.engine.serving.loader import load_served
    from megatrain.spec import parse_spec

    torch.set_num_threads(threads)
    cfg = MODELS[model]
    data = {"train": [{"dataset": "corpus"}], "tokenizer": {"type": "byte"}}
    training = {"precision": "fp32", "seed": 3}
    spec = parse_spec({"name": "bench", "model": cfg, "data": data, "training": training})
    served = load_served(spec, "cpu")
    pairs, prompts = requests(n, cfg["seq_length"])

    def reqs(kind: str, args: list[tuple[Any, ...]]) -> list[Instance]:
        return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]

    until = {"until": ["\x00never"], "max_gen_toks": gen_tokens}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        tok = export_tokenizer(spec.data.tokenizer, model_max_length=cfg["seq_length"])
        export_model_hf(served.model, Path(folder), dtype=torch.float32, tokenizer_files=tok.files,
                        extra_config=tok.special_ids)  # fmt: skip
        for batch in (1, 8):
            ours = EngineLM(served.model, served.tokenizer, batch_size=batch)
            hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=batch,
                      max_length=cfg["seq_length"])  # fmt: skip
            for kind, args in (("loglikelihood", pairs), ("generate_until", [(p, until) for p in prompts])):
                for side, lm in (("EngineLM", ours), ("HFLM", hf)):
                    call = getattr(lm, kind)
                    seconds = best_of(repeats, lambda call=call, args=args, kind=kind: call(reqs(kind, args)))
                    items = len(args) / seconds
                    tokens = items * gen_tokens if kind == "generate_until" else None
                    rows.append({"request": kind, "batch": batch, "side": side, "items_per_s": items,
                                 "tokens_per_s": tokens})  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """request | batch | EngineLM items/s | HFLM items/s | ratio | EngineLM batched/one."""
    by = {(r["request"], r["batch"], r["side"]): r["items_per_s"] for r in rows}
    lines = ["request          batch  EngineLM items/s  HFLM items/s  ours/HFLM  batched/one (ours)"]
    for request in ("loglikelihood", "generate_until"):
        for batch in (1, 8):
            ours, theirs = by[(request, batch, "EngineLM")], by[(request, batch, "HFLM")]
            speedup = ours / by[(request, 1, "EngineLM")]
            lines.append(f"{request:<16} {batch:>5}  {ours:>16.1f}  {theirs:>12.1f}  {ours / theirs:>9.2f}"
                         f"  {speedup:>18.2f}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--items", type=int, default=64, help="requests of each kind")
    p.add_argument("--gen-tokens", type=int, default=16, help="max_gen_toks of each generation")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a smoke run: the tiny model, 8 items, 1 repeat")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.items, args.gen_tokens, args.repeats = "tiny", 8, 4, 1
    if args.items < 1 or args.gen_tokens < 1 or args.repeats < 1:
        p.error("--items, --gen-tokens and --repeats must be >= 1")
    rows = run(args.model, args.items, args.gen_tokens, args.repeats, args.threads)
    print(f"model {args.model}, {args.items} requests of each kind, {args.gen_tokens} tokens per generation, "
          f"{args.threads} threads, best of {args.repeats}")  # fmt: skip
    for line in table(rows):
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
