"""Process groups for a Layout (megatrain.plan.layout), passed explicitly to whatever needs them (no
module globals).

`ParallelState.single()` is the one-process state: every group is None and every size 1, so the
parallel layers and collectives reduce to their single-device behaviour without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatrain.plan.layout import AXES, Coords, Layout, LayoutError

Group = dist.ProcessGroup | None

_JOINT = {"mp": ("tp", "pp"), "dp_cp": ("cp", "dp")}
"""Groups spanning several axes: the model-parallel ranks, and the weight replicas (dp×cp)."""


@dataclass
class ParallelState:
    layout: Layout
    rank: int
    device: torch.device
    groups: dict[str, Group] = field(default_factory=dict)
    """tp, cp, dp, pp, mp (tp×pp: the model-parallel group) and dp_cp (dp×cp: the ranks holding the
    same weights, over which gradients are averaged; the dp group itself when cp = 1); None where the
    size is 1. With pp > 1 also pp_bwd (the pp ranks again: pipeline gradients travel apart from
    activations) and embd (the first and last stage of each pipeline: the tied embedding's two copies).
    With ep > 1 also ep and edp (expert-parallel and expert-data-parallel, carved from dp×cp:
    Layout.expert_group_ranks)."""

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        return cls(Layout(), 0, torch.device(device), {a: None for a in (*AXES, *_JOINT)})

    @classmethod
    def build(cls, layout: Layout, device: torch.device | str = "cpu") -> ParallelState:
        """Create every group (collective: all ranks must call this with the same layout)."""
        if not dist.is_initialized():
            if layout.world_size == 1:
                return cls(layout, 0, torch.device(device), {a: None for a in (*AXES, *_JOINT)})
            raise LayoutError(f"{layout.describe()} needs {layout.world_size} processes; none is initialised")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise LayoutError(
                f"tp×cp×dp×pp = {layout.tp}×{layout.cp}×{layout.dp}×{layout.pp} = {layout.world_size} "
                f"but the world has {world} processes"
            )
        rank = dist.get_rank()
        groups: dict[str, Group] = {}
        for name, along in [*((d, (d,)) for d in AXES), *_JOINT.items()]:
            if name == "dp_cp" and layout.cp == 1:
                groups[name] = groups["dp"]  # the same ranks: no second group
                continue
            mine: Group = None
            for ranks in layout.group_ranks(*along):
                # new_group is collective over the world: every rank creates every group.
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    mine = group
            groups[name] = mine
        groups["pp_bwd"] = groups["embd"] = None
        if layout.pp > 1:
            for ranks in layout.group_ranks("pp"):
                bwd = dist.new_group(ranks)
                embd = dist.new_group([ranks[0], ranks[-1]])
                if rank in ranks:
                    groups["pp_bwd"], groups["embd"] = bwd, embd
        if layout.ep > 1:
            for axis in ("ep", "edp"):
                groups[axis] = None
                for ranks in layout.expert_group_ranks(axis):
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if rank in ranks:
                        groups[axis] = group
        return cls(layout, rank, torch.device(device), groups)

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    def group(self, dim: str) -> Group:
        return self.groups[dim]

    def size(self, dim: str) -> int:
        if dim in _JOINT:
            return self.layout.size(_JOINT[dim][0]) * self.layout.size(_JOINT[dim][1])
        return self.layout.size(dim)

    def local_rank_in(self, dim: str) -> int:
        c = self.coords
        if dim == "mp":
            return c.tp + self.layout.tp * c.pp
        if dim == "dp_cp":
            return c.cp + self.layout.cp * c.dp  # the group's ranks are ordered cp fastest
        return getattr(c, dim)

    # Shorthands the layers use most.
    @property
    def tp_group(self) -> Group:
        return self.groups["tp"]

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_group(self) -> Group:
        return self.groups["dp"]

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def cp_group(self) -> Group:
        return self.groups["cp"]

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def dp_cp_group(self) -> Group:
        """Weight replicas: gradients, the loss and its token count are averaged over dp×cp."""
        return self.groups.get("dp_cp", self.groups.get("dp"))

    @property
    def dp_cp_size(self) -> int:
        return self.layout.dp * self.layout.cp

    @property
    def pp_group(self) -> Group:
        return self.groups["pp"]

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    # Expert parallelism: ep and edp split the dp×cp ranks. Their groups exist only with ep > 1 (with
    # ep = 1 no parameter is an expert-parallel one and nothing asks for them).
    @property
    def ep_group(self) -> Group:
        return self.groups.get("ep")

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[0]

    @property
    def edp_group(self) -> Group:
        return self.groups.get("edp")

    @property
    def edp_size(self) -> int:
        return self.layout.edp

    @property
    def edp_rank(self) -> int:
        return self.layout.expert_coords(self.rank)[1]

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel
