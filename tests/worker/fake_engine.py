"""A stand-in for `megatrain.engine.train` that follows its file contract without torch.

Runs `training.train_iters` steps from the spec, resuming from the checkpoint store's `latest`.
Rank 0 writes metrics.jsonl / events.jsonl / checkpoints; every rank records its pid under
OUT/pids/. Behaviour knobs (environment):
  FAKE_ENGINE_STEP_S         seconds per step (default 0.01)
  FAKE_ENGINE_FAIL_AT        exit FAKE_ENGINE_EXIT_CODE (default 3) on reaching this step ...
  FAKE_ENGINE_FAIL_MARKER    ... only if this file does not exist yet (it is created): fail once
  FAKE_ENGINE_RAISE          ... or raise this builtin exception there (e.g. FileNotFoundError),
                             recorded as the real engine records it (megatrain.failures) ...
  FAKE_ENGINE_MESSAGE        ... with this message
  FAKE_ENGINE_PHASE          ... while this phase (default training: at the step; else at setup)
  FAKE_ENGINE_SIGNAL         ... or kill itself with this signal number there
  FAKE_ENGINE_FAIL_RANK      ... only on this rank (default: every rank)
  FAKE_ENGINE_OOM_COUNTER    ... having first added one to `oom_kill` in this file (a fabricated
                             memory.events: what the kernel's OOM killer does as it kills)
  FAKE_ENGINE_IGNORE_SIGTERM 1: ignore SIGTERM (the runner must SIGKILL)
  FAKE_ENGINE_IGNORE_SIGUSR2 1: ignore SIGUSR2 (a preempted run that never stops by itself)
  FAKE_ENGINE_PRINT_ENV      print this variable's value (a tenant secret leaking into the log) and
                             write its sha256 to OUT/pids/rank{R}.env.sha256
  FAKE_ENGINE_HANG_AT        rank FAKE_ENGINE_HANG_RANK (default 0) stops making progress before
                             this step (once, with FAKE_ENGINE_FAIL_MARKER); the others, on every
                             node, stop at the step after it, as at their next collective with it
Every rank writes OUT/progress.rank{R} after each step and dumps its stacks on SIGUSR1, as the real
engine does. On SIGUSR2 (preemption) it checkpoints at the next step boundary (unless it just did)
and exits 75 (EXIT_PREEMPTED), as the real engine does.
"""

from __future__ import annotations

import argparse
import builtins
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from megatrain.progress_files import write_progress
from megatrain.storage import open_store


def _emit(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row | {"time": time.time()}) + "\n")
        f.flush()


def _should_fail(marker: str | None) -> bool:
    if marker and Path(marker).exists():
        return False
    if marker:
        Path(marker).write_text("failed once")
    return True


def _fail(out: Path, rank: int, step: int | None) -> int:
    """Fail as FAKE_ENGINE_RAISE / FAKE_ENGINE_SIGNAL / FAKE_ENGINE_EXIT_CODE ask."""
    print(f"fake engine: failing at step {step}", flush=True)
    if name := os.environ.get("FAKE_ENGINE_RAISE"):
        from megatrain.failures import Activity, describe, write_record

        exc = getattr(builtins, name)(os.environ.get("FAKE_ENGINE_MESSAGE", "fake failure\nsecond line"))
        print("Traceback (most recent call last):\n  File fake_engine.py\n" + f"{name}: {exc}", flush=True)
        phase = os.environ.get("FAKE_ENGINE_PHASE", "training")
        write_record(out, describe(exc, rank, Activity(phase, step)))
        return 1
    if number := os.environ.get("FAKE_ENGINE_SIGNAL"):
        if counter := os.environ.get("FAKE_ENGINE_OOM_COUNTER"):
            path = Path(counter)
            rows = [ln.split() for ln in path.read_text().splitlines()]
            path.write_text("".join(f"{k} {int(v) + (k == 'oom_kill')}\n" for k, v in rows))
        os.kill(os.getpid(), int(number))
    return int(os.environ.get("FAKE_ENGINE_EXIT_CODE", "3"))


def _wait_for_save(ckpt: Any, step: int, timeout_s: float = 60.0) -> None:
    """Until rank 0's checkpoint store says `latest` is `step` or later (the engine's ranks finish a
    save together)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ckpt.exists("latest") and int(ckpt.get_bytes("latest")) >= step:
            return
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _hang_forever() -> None:
    """Stand still as a deadlocked collective would (a named frame for the stack dump to show)."""
    print("fake engine: hanging", flush=True)
    while True:
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint-url", default=None)
    p.add_argument("--layout", required=True)  # the stored layout the real engine runs with
    args = p.parse_args()
    if os.environ.get("FAKE_ENGINE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ.get("RANK", "0"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    preempted: list[int] = []
    if os.environ.get("FAKE_ENGINE_IGNORE_SIGUSR2") == "1":
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGUSR2, lambda *_: preempted.append(1))
    hang_at = int(os.environ.get("FAKE_ENGINE_HANG_AT", "0"))
    hang_rank = int(os.environ.get("FAKE_ENGINE_HANG_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = json.loads(Path(args.layout).read_text())
    if layout["tp"] * layout["pp"] * layout["dp"] * layout["cp"] != world:
        print(f"error: the stored layout {layout} does not match a world of {world}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"rank{rank}.pid").write_text(str(os.getpid()))
    # The devices this rank was given (the runner's CUDA_* variables), for the placement tests.
    cuda = {k: v for k, v in os.environ.items() if k.startswith("CUDA_")}
    (out / "pids" / f"rank{rank}.cuda.json").write_text(json.dumps(cuda))
    leak = os.environ.get("FAKE_ENGINE_PRINT_ENV")
    if leak:
        value = os.environ.get(leak, "")
        print(f"fake engine: {leak}={value}", flush=True)
        (out / "pids" / f"rank{rank}.env.sha256").write_text(hashlib.sha256(value.encode()).hexdigest())
    spec = json.loads(Path(args.spec).read_text())
    tr = spec.get("training", {})
    iters, log_every = int(tr.get("train_iters", 20)), int(tr.get("log_interval", 1))
    ckpt_every = int(tr.get("checkpoint_interval", 0))
    # The checkpoint store, as the engine's: file:// or s3:// (the runner's --checkpoint-url).
    ckpt_url = args.checkpoint_url or (out / "checkpoints").as_uri()
    ckpt = open_store(ckpt_url, os.environ.get("MEGATRAIN_S3_ENDPOINT_URL"))
    step_s = float(os.environ.get("FAKE_ENGINE_STEP_S", "0.01"))
    fail_at = int(os.environ.get("FAKE_ENGINE_FAIL_AT", "0"))
    marker = os.environ.get("FAKE_ENGINE_FAIL_MARKER")

    start = int(ckpt.get_bytes("latest")) if ckpt.exists("latest") else 0
    lead = rank == 0
    if os.environ.get("FAKE_ENGINE_PHASE", "training") != "training" and _should_fail(marker):
        return _fail(out, rank, None)
    (out / "pids" / f"rank{rank}.ready").touch()
    if world > 1 and not lead:
        print(f"fake engine: rank {rank} of {world} ready", flush=True)
    if lead:
        # As the engine's first collective: 'started' once every rank has its handlers in place
        # (the runner signals only a started engine).
        # The ranks on this node (a gang's other nodes write their own folders).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        deadline = time.monotonic() + 60
        while len(list((out / "pids").glob("rank*.ready"))) < local and time.monotonic() < deadline:
            time.sleep(0.02)
        print(f"fake engine: world={world} resuming from {start or None}", flush=True)
        _emit(
            out / "events.jsonl",
            {
                "event": "started",
                "step": start,
                "num_params": 1234,
                "world_size": world,
                "layout": {"dp": world},
                "device": "cpu",
                "resumed_from": start or None,
            },
        )
    for step in range(start + 1, iters + 1):
        time.sleep(step_s)
        fail_rank = os.environ.get("FAKE_ENGINE_FAIL_RANK")
        if fail_at and step == fail_at and fail_rank in (None, str(rank)) and _should_fail(marker):
            return _fail(out, rank, step)
        # The hung rank says so beside the marker (every node's ranks see it), naming its pid: the
        # others wait for it only while it lives (a retry's ranks run on).
        flags = Path(marker).parent if marker else out
        if hang_at and step == hang_at and rank == hang_rank and _should_fail(marker):
            (flags / f"hanging.rank{rank}").write_text(str(os.getpid()))
            _hang_forever()
        if hang_at and step == hang_at + 1 and rank != hang_rank:
            # As at a collective: wait for the hung rank to get there (a node that started late
            # is still behind; a retry finds its flag, of a dead pid, at once).
            deadline = time.monotonic() + 60
            while not list(flags.glob("hanging.rank*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            if any(_alive(int(f.read_text())) for f in flags.glob("hanging.rank*")):
                _hang_forever()
        write_progress(out, rank, step)
        if not lead:
            if preempted and step < iters:
                # A save is collective: no rank leaves before rank 0 has saved (torchrun stops every
                # rank once one exits, mid-write on a slow store otherwise).
                _wait_for_save(ckpt, step)
                return 75
            continue
        if step % log_every == 0:
            loss = 10.0 / step
            _emit(
                out / "metrics.jsonl",
                {
                    "step": step,
                    "loss": loss,
                    "lr": 1e-3,
                    "grad_norm": 1.0,
                    "tokens_per_s": 1000.0 + step,
                    "tflops_per_device": 0.1,
                    "mfu": 0.1,
                    "peak_memory_bytes": 0,
                    "iter_time_s": step_s,
                    "consumed_samples": step * 4,
                },
            )
            print(f"step {step} loss {loss:.4f}", flush=True)
        if (ckpt_every and step % ckpt_every == 0) or (preempted and step < iters):
            folder = f"iter_{step:07d}"
            ckpt.put_bytes(f"{folder}/trainer_state.json", json.dumps({"step": step}).encode())
            ckpt.put_bytes(f"{folder}/manifest.json", json.dumps({"files": ["trainer_state.json"]}).encode())
            ckpt.put_bytes("latest", str(step).encode())
            uri = f"{ckpt_url.rstrip('/')}/{folder}"
            _emit(
                out / "events.jsonl",
                {"event": "checkpoint_saved", "step": step, "uri": uri, "size_bytes": 42},
            )
        if preempted and step < iters:
            _emit(out / "events.jsonl", {"event": "preempted", "step": step})
            print(f"fake engine: preempted at step {step}", flush=True)
            return 75
    if lead:
        _emit(out / "events.jsonl", {"event": "finished", "step": iters})
        print("fake engine: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
