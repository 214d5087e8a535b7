"""Pure layout planning: from a JobSpec to a (tp, pp, dp, cp, ep) layout, and whether it fits a pool.

No database, no torch, no process group: the API calls this at submission to refuse a spec that can
never run, the scheduler to size the gang, the worker to pick the process count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatrain.spec import JobSpec, ParallelismSpec, SpecError


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    pipeline_layers: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def as_dict(self) -> dict[str, int | bool]:
        return asdict(self)


def _error(field: str, message: str) -> SpecError:
    return SpecError([{"field": field, "message": message}])


def plan_layout(spec: JobSpec) -> Layout:
    """The layout a spec asks for; raises SpecError naming the field when it is inconsistent."""
    gpus = spec.resources.gpus
    par = spec.parallelism if isinstance(spec.parallelism, ParallelismSpec) else ParallelismSpec()
    model_parallel = par.tp * par.pp * par.cp
    if par.dp == "auto":
        if gpus is not None and gpus % model_parallel:
            raise _error(
                "resources.gpus",
                f"resources.gpus={gpus} is not divisible by tp×pp×cp={par.tp}×{par.pp}×{par.cp}",
            )
        dp = (gpus // model_parallel) if gpus is not None else 1
    else:
        dp = par.dp
        if gpus is not None and gpus != model_parallel * dp:
            raise _error(
                "resources.gpus",
                f"resources.gpus={gpus} does not equal tp×pp×cp×dp={par.tp}×{par.pp}×{par.cp}×{dp}",
            )
    tr = spec.training
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise _error(
            "training.global_batch_size",
            f"training.global_batch_size={tr.global_batch_size} is not divisible by "
            f"micro_batch_size×dp={tr.micro_batch_size}×{dp}",
        )
    micro_batches = tr.global_batch_size // (tr.micro_batch_size * dp)
    if par.virtual_stages > 1 and micro_batches % par.pp:
        raise _error(
            "parallelism.virtual_stages",
            f"parallelism.virtual_stages={par.virtual_stages} (interleaved 1F1B) needs the micro-batches "
            f"per step, global_batch_size/(micro_batch_size×dp) = {micro_batches}, divisible by "
            f"parallelism.pp={par.pp}",
        )
    return Layout(
        tp=par.tp,
        pp=par.pp,
        dp=dp,
        cp=par.cp,
        ep=par.ep,
        virtual_stages=par.virtual_stages,
        sequence_parallel=par.sequence_parallel,
        pipeline_schedule=par.pipeline_schedule,
        pipeline_layers=tuple(par.pipeline_layers) if par.pipeline_layers is not None else None,
    )


def fit_problem(layout: Layout, node_slots: list[int], pool: str) -> str | None:
    """Why a layout can never run on a pool whose nodes offer `node_slots` processes, or None.

    Jobs run on one node for now (gang placement across nodes comes with multi-node torchrun).
    """
    if not node_slots:
        return f"resources.pool={pool!r} has no nodes"
    biggest = max(node_slots)
    if layout.world_size > biggest:
        return (
            f"the job needs tp×pp×cp×dp={layout.world_size} processes but the largest node in "
            f"pool {pool!r} offers {biggest}"
        )
    return None
