"""The model server behind /openai/v1/chat/completions: time from a fine-tune's `succeeded` to its
first served token, and tokens/s of concurrent chat requests with continuous batching against the
same requests one at a time.

    PYTHONPATH=. python benchmarks/serving.py                      # ~3 min on a 2-core CPU
    PYTHONPATH=. python benchmarks/serving.py --tiny               # a smoke run
    PYTHONPATH=. python benchmarks/serving.py --sections engine    # the Batcher alone (no stack)

stack: a fresh embedded stack in this process (SQLite, the local executor, the API on a free
port): a pretrain job makes the base, a LoRA fine-tune trains adapters on it; the moment the
fine-tune succeeds, one chat request names its model through the `openai` package (not streamed,
max_tokens 1: the answer arrives with the first token). The API submits the serve job, the
scheduler places it, a worker starts the model server; the first table splits that wait by the
serve job's events. Then N = 1, 4, 16 chat requests at once against the same N one after another,
through the API (its proxy, the server's HTTP, the batcher). The second table: tokens/s = the
completion tokens the answers count (`usage`) over the wall time.

engine: the same comparison at the Batcher alone (the base model in this process, no HTTP), every
request running exactly max_tokens (end-of-document ignored), so the figures isolate batching.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MODELS = {
    "small": {"arch": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
              "num_query_groups": 4, "seq_length": 256},
    "tiny": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_query_groups": 2, "seq_length": 64},
}  # fmt: skip
TRAIN = {"train_iters": 2, "global_batch_size": 2, "micro_batch_size": 2, "checkpoint_interval": 2,
         "warmup_iters": 0, "precision": "fp32", "log_interval": 1, "eval_interval": 0}  # fmt: skip
PROMPTS = ["def add(a, b):", "class Point:", "import numpy as np", "for i in range(10):"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_stack(home: Path) -> Iterator[tuple[str, str, Path]]:
    """(url, key, data folder) of a fresh embedded stack with its scheduler, in this process."""
    data = home / "data"
    data.mkdir(parents=True)
    port = _free_port()
    os.environ.update({
        "MEGATRAIN_HOME": str(home), "MEGATRAIN_API_URL": f"http://127.0.0.1:{port}",
        "MEGATRAIN_ALLOWED_DATA_ROOTS": data.as_uri(), "MEGATRAIN_CPU_SLOTS": "2",
        "MEGATRAIN_SCHEDULER_INTERVAL_S": "0.2", "MEGATRAIN_HEARTBEAT_INTERVAL_S": "0.5",
    })  # fmt: skip
    from megatrain.cli.server import EmbeddedStack
    from megatrain.settings import get_settings, reset_settings_cache

    reset_settings_cache()
    settings = get_settings()
    key = EmbeddedStack.prepare(settings)
    stack = EmbeddedStack(settings, "127.0.0.1", port, log_level="warning")
    stack.start_in_background(scheduler=True)
    try:
        yield stack.url, key, data
    finally:
        stack.stop()


def _wait(client: Any, job_id: str) -> Any:
    job = client.wait(job_id, timeout_s=900, poll_interval_s=0.05)
    if job.status != "succeeded":
        raise SystemExit(f"job {job_id} {job.status}: {job.status_reason}")
    return job


def _at(text: str | None) -> datetime:
    at = datetime.fromisoformat(str(text))
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def first_token(
    url: str, key: str, data: Path, model: dict[str, Any]
) -> tuple[str, str, list[tuple[str, float]]]:
    """(the fine-tuned model's id, its serve job, [(phase, seconds since the fine-tune succeeded)])."""
    import openai

    from megatrain.client import Client

    corpus, sft = data / "corpus.jsonl", data / "sft.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{p}\n    return {i}\n" * 8}) + "\n"
                              for i, p in enumerate(PROMPTS * 10)))  # fmt: skip
    sft.write_text("".join(json.dumps({"prompt": p, "response": f"    pass  # {i}"}) + "\n"
                           for i, p in enumerate(PROMPTS * 4)))  # fmt: skip
    base = {"name": "base", "model": model, "data": {"train": [{"path": corpus.as_uri()}], "split": "1,0,0"},
            "training": TRAIN, "resources": {"devices": 1}}  # fmt: skip
    with Client(api_url=url, api_key=key) as client:
        pre = _wait(client, client.submit(base).id)
        tune = {**base, "name": "lora", "kind": "finetune",
                "model": {**model, "init_from": f"checkpoint:{pre.id}"},
                "data": {"train": [{"path": sft.as_uri()}], "split": "1,0,0"},
                "training": {**TRAIN, "method": "lora", "lora": {"rank": 8, "alpha": 16.0}}}  # fmt: skip
        job = _wait(client, client.submit(tune).id)
        ft = f"ft:base:default:lora:{job.id}"
        sdk = openai.OpenAI(base_url=f"{url}/openai/v1", api_key=key, max_retries=5)
        raw = sdk.chat.completions.with_raw_response.create(
            model=ft, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=1
        )
        answered = datetime.now(UTC)
        serve_id = raw.headers["x-megatrain-serve-job"]
        succeeded = _at(job.finished_at)
        phases = [("fine-tune succeeded", 0.0)]
        names = {"queued": "serve job submitted", "scheduled": "placed on a node",
                 "running": "worker started it", "started": "base loaded (engine started)",
                 "serving": "model server listening"}  # fmt: skip
        for event in client.events(serve_id):
            kind = event.get("to_status") or event.get("kind")
            if kind in names:
                phases.append((names.pop(kind), (_at(event["created_at"]) - succeeded).total_seconds()))
        phases.append(("first token answered", (answered - succeeded).total_seconds()))
    return ft, serve_id, phases


def api_throughput(
    url: str, key: str, model: str, concurrency: list[int], max_tokens: int
) -> list[dict[str, Any]]:
    """Chat requests through the API: N at once against the same N one after another."""
    import openai

    sdk = openai.OpenAI(base_url=f"{url}/openai/v1", api_key=key, max_retries=2)

    def ask(i: int) -> int:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        answer = sdk.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, seed=i)
        assert answer.usage is not None
        return answer.usage.completion_tokens

    ask(0)  # warm: the adapters read, the connection made
    rows = []
    for n in concurrency:
        began = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            batched = sum(pool.map(ask, range(n)))
        batched_s = time.perf_counter() - began
        began = time.perf_counter()
        alone = sum(ask(i) for i in range(n))
        alone_s = time.perf_counter() - began
        rows.append({"n": n, "batched": batched / batched_s, "alone": alone / alone_s,
                     "tokens": (batched, alone)})  # fmt: skip
    return rows


def engine_throughput(
    model_fields: dict[str, Any], concurrency: list[int], max_tokens: int
) -> list[dict[str, Any]]:
    """The Batcher alone: N sequences batched against the same N one at a time, max_tokens each."""
    import torch

    from megatrain.engine.build import build_model
    from megatrain.engine.config import transformer_config
    from megatrain.engine.data.tokenizers import ByteTokenizer
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.engine.serving import Batcher, SamplingParams
    from megatrain.spec import parse_spec

    spec = parse_spec({"name": "b", "model": model_fields, "data": {"train": [{"path": "/x"}]}})
    tokenizer = ByteTokenizer()
    model = build_model(
        transformer_config(spec, tokenizer.vocab_size), ParallelState.single(), 0, "cpu"
    ).module
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    def run(batch: Batcher, n: int) -> float:
        began = time.perf_counter()
        for i in range(n):
            batch.submit(prompts[i % len(prompts)], params)
        while batch.busy:
            batch.step()
        return time.perf_counter() - began

    with torch.inference_mode():
        run(Batcher(model, tokenizer, max_batch=1, eos_id=-1), 1)  # warm
        rows = []
        for n in concurrency:
            most = max(concurrency)  # every request may wait (one at a time: all but one do)
            batched_s = run(Batcher(model, tokenizer, max_batch=most, eos_id=-1, max_waiting=most), n)
            alone_s = run(Batcher(model, tokenizer, max_batch=1, eos_id=-1, max_waiting=most), n)
            total = n * max_tokens
            rows.append(
                {"n": n, "batched": total / batched_s, "alone": total / alone_s, "tokens": (total, total)}
            )
    return rows


def _print_rows(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'requests':>8} {'batched tok/s':>14} {'one at a time':>14} {'speedup':>8} {'tokens':>14}")
    for r in rows:
        tokens, speedup = "/".join(str(t) for t in r["tokens"]), r["batched"] / r["alone"]
        print(f"{r['n']:>8} {r['batched']:>14.1f} {r['alone']:>14.1f} {speedup:>7.2f}x {tokens:>14}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer 64-wide model, short answers: a smoke run"
    )
    parser.add_argument("--sections", default="stack,engine", help="stack, engine or both (comma-separated)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads here and in the stack's jobs (default 1)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per answer (default 64; 8 with --tiny)"
    )
    args = parser.parse_args(argv)
    # Before torch loads, here and in every job the stack starts (they inherit the environment).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    model = MODELS["tiny" if args.tiny else "small"]
    max_tokens = args.max_tokens or (8 if args.tiny else 64)
    concurrency = [1, 4] if args.tiny else [1, 4, 16]
    sections = set(args.sections.split(","))
    shape = ", ".join(f"{k} {v}" for k, v in model.items() if k != "arch")
    print(
        f"model llama ({shape}), fp32 on CPU ({os.cpu_count()} cores, {args.threads} torch threads), "
        f"{max_tokens} tokens per answer, load average {os.getloadavg()[0]:.1f}"
    )
    if "stack" in sections:
        with tempfile.TemporaryDirectory(prefix="serving-bench-") as tmp, embedded_stack(Path(tmp)) as stack:
            url, key, data = stack
            ft, serve_id, phases = first_token(url, key, data, model)
            print(f"\nsucceeded → first served token (embedded stack, local executor; serve job {serve_id})")
            print(f"{'phase':<32} {'s after succeeded':>18}")
            for name, seconds in phases:
                print(f"{name:<32} {seconds:>18.2f}")
            _print_rows("through the API (openai SDK → proxy → model server)",
                        api_throughput(url, key, ft, concurrency, max_tokens))  # fmt: skip
            from megatrain.client import Client

            with Client(api_url=url, api_key=key) as client:  # the server ends with the stack
                client.cancel(serve_id)
                client.wait(serve_id, timeout_s=60, poll_interval_s=0.2)
    if "engine" in sections:
        import torch

        torch.set_num_threads(args.threads)
        _print_rows("the Batcher alone (no HTTP; every answer max_tokens long)",
                    engine_throughput(model, concurrency, max_tokens))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
