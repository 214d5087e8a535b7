"""The packages a spec needs where it runs (flash-attn, Transformer Engine, torchao), and what a node
can import: torch-free, so that the API judges a spec against its target pool's nodes, not its own
(a CPU-only API host must not refuse `attention_backend: flash` for a GPU pool that has it).

Nodes report `installed_packages()` when they register (Node.packages); the API checks a submission
against the nodes of its pool that reported; a worker checks the job against its own packages when it
claims it (a pool whose nodes never reported then fails the job there, with the same one line), and
the engine once more before it builds the model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain.spec import JobSpec
    from megatrain.spec_errors import Problem

REPORTED: dict[str, str] = {
    "torch": "torch",
    "triton": "triton",
    "flash_attn": "flash-attn",
    "flash_attn_interface": "flash-attn-3",
    "transformer_engine": "transformer-engine",
    "torchao": "torchao",
}
"""module → its distribution: what a node reports it can import, with the version installed."""
CUDA = "cuda"
"""The key of the CUDA version torch was built with (absent for a CPU build)."""


@dataclass(frozen=True)
class Need:
    """A package a spec's field needs: any one of `modules` provides it."""

    field: str
    what: str
    modules: tuple[str, ...]
    install: str
    alternative: str


ATTENTION = {
    "flash": (("flash_attn", "flash_attn_interface"), "flash-attn package (`pip install megatrain[gpu]`)"),
    "te": (("transformer_engine",), "transformer-engine package (`pip install megatrain[gpu]`)"),
}
"""model.attention_backend → (modules, any one of which provides it; what to install)."""
FP8 = {"torchao": ("torchao", "torchao"), "te": ("transformer_engine", "transformer_engine[pytorch]")}
"""training.fp8_backend → (the module it imports, what pip installs)."""


def needs(spec: JobSpec) -> list[Need]:
    """The packages `spec` needs on the node that runs it."""
    out = []
    backend = spec.model.attention_backend
    if backend in ATTENTION:
        modules, install = ATTENTION[backend]
        what = f"model.attention_backend={backend!r}"
        out.append(Need("model.attention_backend", what, modules, install, "or choose auto or sdpa"))
    t = spec.training
    if t.precision == "fp8":
        module, pip = FP8[t.fp8_backend]
        field = "training.fp8_backend" if t.fp8_backend != "torchao" else "training.precision"
        what = f"training.precision=fp8 with fp8_backend {t.fp8_backend}"
        install = f"'{module}' package (pip install {pip})"
        out.append(Need(field, what, (module,), install, "or choose another precision"))
    return out


def package_problems(spec: JobSpec, nodes: Mapping[str, Mapping[str, str]], where: str) -> list[Problem]:
    """What `spec` needs that a node of `nodes` ({node name: its installed_packages()}) lacks; `where`
    names them in messages ("this worker", "pool 'h100'"). No nodes: nothing to judge."""
    problems: list[Problem] = []
    for need in needs(spec):
        lacking = sorted(name for name, pkgs in nodes.items() if not any(m in pkgs for m in need.modules))
        if not lacking:
            continue
        whom = where if len(lacking) == len(nodes) else f"{where}'s node(s) {', '.join(lacking)}"
        have = nodes[lacking[0]]
        seen = ", ".join(f"{m} {v}" for m, v in sorted(have.items())) or "none of the packages we check"
        problems.append(
            {
                "field": need.field,
                "message": f"{need.what} needs the {need.install}, which {whom} cannot import "
                f"(it reports {seen}); install it there, {need.alternative}",
            }
        )
    return problems


def installed_packages() -> dict[str, str]:
    """{module: version} of REPORTED's modules importable here, and torch's CUDA version as `cuda`:
    found without importing any of them (the API's process must not load torch)."""
    out: dict[str, str] = {}
    for module, dist in REPORTED.items():
        if importlib.util.find_spec(module) is None:
            continue
        try:
            out[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[module] = "unknown"
    cuda = _torch_cuda()
    if cuda:
        out[CUDA] = cuda
    return out


def _torch_cuda() -> str | None:
    """torch.version.cuda, read from torch/version.py's text (importing it would import torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        found = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", path.read_text(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None
