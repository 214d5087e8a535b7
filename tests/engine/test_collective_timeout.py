"""A job's process group gives up on a collective after settings.collective_timeout_s instead of
waiting forever (gloo here; NCCL on a GPU, where the flight recorder then dumps each rank's last
collectives into the attempt folder)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatrain.engine.runtime import flight_recorder_env, init_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int) -> tuple[float, str]:
    dist.destroy_process_group()  # the launcher's; the engine's own is made from torchrun's variables
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    init_distributed(timeout_s=2.0)
    began = time.monotonic()
    if rank == 1:
        time.sleep(8)  # never joins in time: a stopped rank
        return 0.0, ""
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        return time.monotonic() - began, str(exc)
    return time.monotonic() - began, "no error"


@pytest.mark.distributed
def test_a_collective_a_rank_never_joins_fails_at_the_timeout() -> None:
    from .parallel._launch import run_distributed

    (elapsed, error), _ = run_distributed(_rank, 2, _free_port(), timeout=60)
    assert 1.5 < elapsed < 7.0 and "timed out" in error.lower(), (elapsed, error)


def test_the_flight_recorder_dumps_into_the_attempt_folder(tmp_path: Path) -> None:
    env = flight_recorder_env(tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_trace.rank")
