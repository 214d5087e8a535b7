"""An attempt of a job as the control plane hands it to a runner (`Attempt`, JSON both ways) and how
the shards of a multi-node attempt meet (`Rendezvous`, torchrun's c10d)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from megatrain.secrets_box import Redactor


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


@dataclass
class Attempt:
    """One attempt of a job, as a runner claimed it (a whole job, or one node's share of a gang)."""

    job_id: str
    attempt: int
    max_retries: int
    num_procs: int
    max_runtime_s: float
    out_dir: Path
    devices: list[int] | None = None
    """The node's device indices the scheduler placed this attempt on."""
    accelerator: str = "cpu"
    node_slots: int | None = None
    """The slots of the node it was placed on (a CPU node's share its devices by: worker.nodes)."""
    rendezvous: Rendezvous | None = None
    """Set for one node's share of a multi-node attempt (a gang)."""
    node_id: str | None = None
    queued_s: float = 0.0
    """How long the job waited in the queue before this attempt (for the goodput ledger)."""
    prev_step: int = 0
    checkpoint_interval: int = 0
    train_iters: int = 0
    """The spec's last step (0: unknown): past it the engine is finishing, not stepping (worker.hang)."""
    preemptions: int = 0
    """Earlier attempts of the job that ended preempted (not failures: see db.jobs.retry_allowed)."""
    max_preemptions: int = 10
    continuations: int = 0
    """Earlier attempts that ended at an allocation's time limit and continued (not failures)."""
    serve_token: str | None = None
    """A serve job's bearer token for this attempt (db.models.Job.serve_token)."""
    first_step_bound_s: float | None = None
    save_bound_s: float | None = None
    """How long the hang watch allows before the first step and for a checkpoint's save, predicted
    for this job on its pool (plan.attempt_times); None: settings.hang_grace_s for both."""
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    """The tenant secrets the job names (spec `secrets`), decrypted for its engine's environment."""

    @property
    def redact(self) -> Redactor:
        """Removes those secrets' values from what the attempt reports (lines, events, reasons)."""
        return Redactor(self.secret_env)

    def to_wire(self) -> dict[str, Any]:
        """The attempt as JSON (the API's claim answer), without the node's own folder."""
        wire = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "out_dir"}
        wire["rendezvous"] = asdict(self.rendezvous) if self.rendezvous is not None else None
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any], out_dir: Path) -> Attempt:
        rdzv = wire.get("rendezvous")
        names = {f.name for f in fields(cls)} - {"out_dir", "rendezvous"}
        values = {k: v for k, v in wire.items() if k in names}
        return cls(out_dir=out_dir, rendezvous=Rendezvous(**rdzv) if rdzv else None, **values)
