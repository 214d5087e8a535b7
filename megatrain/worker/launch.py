"""How the shard runner starts the engine: the command line (plain python for one process, torchrun
for several, torchrun's c10d rendezvous for one node's share of a multi-node attempt)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

ENGINE_MODULE_ENV = "MEGATRAIN_ENGINE_MODULE"
"""Module (or path to a .py script) the runner starts; tests point it at a fake engine."""
DEFAULT_ENGINE_MODULE = "megatrain.engine.train"


@dataclass(frozen=True)
class Rendezvous:
    """How the shards of a multi-node attempt meet: torchrun's c10d rendezvous at node rank 0."""

    node_rank: int
    nnodes: int
    endpoint: str
    """HOST:PORT of node rank 0's rendezvous store."""
    run_id: str
    """torchrun's --rdzv-id: one per attempt, so a late shard of an older attempt never joins."""
    timeout_s: float = 300.0

    def torchrun_args(self) -> list[str]:
        # Node rank 0 hosts the store (is_host), whatever the hostnames say: two nodes on one
        # machine would otherwise both try. c10d orders the nodes itself (by address and pid), so
        # each node's ranks stay contiguous (whole tp×cp groups) but which node holds global
        # rank 0 is torchrun's choice: every shard reports the metrics and events of its ranks.
        conf = f"is_host={int(self.node_rank == 0)},join_timeout={int(self.timeout_s)}"
        return [
            # No --node-rank: c10d ignores it (with a warning) and orders the nodes itself.
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
            "--max-restarts=0",
        ]


def engine_command(
    num_procs: int, out_dir: Path, checkpoint_url: str, rendezvous: Rendezvous | None = None
) -> list[str]:
    """torchrun for several processes; plain python for one (the engine's contract allows both).
    A share of a multi-node attempt always runs under torchrun, meeting the others at `rendezvous`.

    The engine reads the job's spec and the layout the API resolved and stored, from the attempt's
    folder (`_claim` writes both), so it never plans a layout of its own."""
    engine = os.environ.get(ENGINE_MODULE_ENV) or DEFAULT_ENGINE_MODULE
    target = [engine] if engine.endswith(".py") else ["-m", engine]
    args = [
        *("--spec", str(out_dir / "spec.json"), "--layout", str(out_dir / "layout.json")),
        *("--out", str(out_dir), "--checkpoint-url", checkpoint_url),
    ]
    if num_procs == 1 and rendezvous is None:
        return [sys.executable, "-u", *target, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rendezvous.torchrun_args() if rendezvous else ["--standalone"]),
        f"--nproc-per-node={num_procs}",
        *target,
        *args,
    ]


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
