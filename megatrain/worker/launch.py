"""How the shard runner starts the engine: the command line (plain python for one process, torchrun
for several, torchrun's c10d rendezvous for one node's share of a multi-node attempt)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from megatrain.attempts.model import Rendezvous  # noqa: F401  (re-exported)

ENGINE_MODULE_ENV = "MEGATRAIN_ENGINE_MODULE"
"""Module (or path to a .py script) the runner starts; tests point it at a fake engine."""
DEFAULT_ENGINE_MODULE = "megatrain.engine.train"


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
