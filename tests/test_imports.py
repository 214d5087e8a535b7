"""The import rules of DESIGN.md, read off the source (lazy imports inside functions included): the
engine never imports the control plane, the API never imports the engine or the worker, the worker
never imports the scheduler or the API, and no two top-level parts import each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import megatrain

PACKAGE = Path(megatrain.__file__).parent
CONTROL_PLANE = {"api", "attempts", "db", "scheduler", "worker", "cli", "client", "demo"}


def _part(module: str) -> str | None:
    """The top-level part of a megatrain module ('megatrain.engine.train' -> 'engine')."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megatrain" and len(parts) > 1 else None


def _imports() -> dict[str, set[tuple[str, str]]]:
    """part -> {(importing file, imported part)}, every import statement, lazy ones included."""
    edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        src = _part(module) if module != "megatrain" else None
        if src is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                dst = _part(target)
                if dst is not None and dst != src:
                    edges[src].add((str(rel), dst))
    return edges


def test_the_engine_and_planning_import_nothing_of_the_control_plane() -> None:
    edges = _imports()
    for low in ("engine", "kernels", "plan", "spec", "settings", "storage"):
        bad = sorted((f, dst) for f, dst in edges.get(low, ()) if dst in CONTROL_PLANE)
        assert not bad, f"{low} imports the control plane: {bad}"
    # Kernels sit below the models that call them.
    bad = sorted((f, dst) for f, dst in edges.get("kernels", ()) if dst == "engine")
    assert not bad, f"kernels import the engine: {bad}"
    bad = sorted((f, dst) for f, dst in edges.get("api", ()) if dst in {"engine", "worker", "kernels"})
    assert not bad, f"the API imports the engine or the worker: {bad}"
    # The worker sits below the scheduler (which imports the executors), never beside the API.
    bad = sorted((f, dst) for f, dst in edges.get("worker", ()) if dst in {"scheduler", "api"})
    assert not bad, f"the worker imports the scheduler or the API: {bad}"


def test_the_scheduler_reaches_the_worker_only_through_the_executor_interface() -> None:
    # Only worker/ knows how a job or a background task runs (its processes, hosts, brokers): the
    # scheduler asks an Executor (worker.executors) and imports nothing else of the worker.
    bad = []
    for path in (PACKAGE / "scheduler").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [
                (path.name, n)
                for n in names
                if n.startswith("megatrain.worker") and n != "megatrain.worker.executors"
            ]
    assert not bad, f"the scheduler reaches past the executor interface: {sorted(bad)}"


def test_no_cycles_between_top_level_parts() -> None:
    graph = {src: {dst for _, dst in targets} for src, targets in _imports().items()}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif len(path) < len(graph) + 1:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, f"import cycles between top-level parts: {sorted({' -> '.join(c) for c in cycles})}"


def test_planning_and_the_kernel_registry_import_no_torch() -> None:
    # The API and the scheduler plan jobs (layouts, memory) on machines without torch.
    code = (
        "import sys, megatrain.plan.layout, megatrain.plan.memory, megatrain.kernels; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
