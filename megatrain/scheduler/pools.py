"""The local pool: this machine's GPUs, or CPU slots when it has none, registered in the database."""

from __future__ import annotations

import shutil
import socket
import subprocess

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.db.models import Node, NodePool, utcnow
from megatrain.settings import Settings


def detect_gpus() -> list[str]:
    """Names of this machine's NVIDIA GPUs via nvidia-smi (the control plane never imports torch)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def local_capacity(settings: Settings) -> tuple[str, int]:
    """(accelerator, slots): GPUs when there are any, else the configured CPU slots."""
    gpus = detect_gpus()
    if gpus:
        return gpus[0], len(gpus)
    return "cpu", settings.cpu_slots


def ensure_local_pool(session: Session, settings: Settings) -> Node:
    """Register (or refresh) this machine as a node of pool `settings.pool_name`; the caller commits.

    Safe to call from several processes at once: a lost insert race is retried as a lookup.
    """
    accelerator, slots = local_capacity(settings)
    hostname = socket.gethostname()
    for _ in range(3):
        pool = session.scalar(select(NodePool).where(NodePool.name == settings.pool_name))
        if pool is None:
            try:
                with session.begin_nested():
                    pool = NodePool(name=settings.pool_name, accelerator=accelerator)
                    session.add(pool)
            except IntegrityError:
                continue
        node = session.scalar(select(Node).where(Node.pool_id == pool.id, Node.hostname == hostname))
        if node is None:
            try:
                with session.begin_nested():
                    node = Node(pool_id=pool.id, hostname=hostname, slots_total=slots)
                    session.add(node)
            except IntegrityError:
                continue
        node.slots_total = slots
        node.last_seen_at = utcnow()
        node.status = "ready"
        pool.accelerator = accelerator
        session.flush()
        return node
    raise RuntimeError(f"could not register node {hostname} in pool {settings.pool_name}")
