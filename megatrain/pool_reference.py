"""The pool reference (docs/pool-reference.md), generated from PoolSpec in megatrain/plan/pool.py.

As with the JobSpec reference (megatrain/spec_reference.py, whose field walk this reuses), every
field's type, default, bounds and docstring come from the model, so the page cannot drift from what
`megatrain pools apply` and `megatrain plan --pool` accept; tests/test_pool_reference.py checks
that the committed copy is current and that each rule below really refuses its example.
`python -m megatrain.pool_reference > docs/pool-reference.md` regenerates it. Torch-free.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any

from megatrain.plan.pool import PoolSpec
from megatrain.spec_reference import sections, type_text

REGENERATE = "python -m megatrain.pool_reference > docs/pool-reference.md"
EXAMPLES = ("h100.yaml", "cpu.yaml")
"""The example pool files under examples/pools/."""

BASE_POOL: dict[str, Any] = {
    "name": "rule-example",
    "device_memory_bytes": 16 << 30,
    "peak_tflops": {"fp32": 1.0},
    "devices_per_node": 2,
    "intra_node_bandwidth_gbps": 10.0,
    "inter_node_bandwidth_gbps": 1.0,
}
"""A valid pool file (a CPU pool, every other field its default); each rule's example changes it."""


@dataclass(frozen=True)
class PoolRule:
    field: str
    rule: str
    change: str
    """The change to BASE_POOL that breaks the rule, as the page shows it."""
    breaks: Any
    """The whole file's content after that change (a mapping, or a list of them)."""


RULES: tuple[PoolRule, ...] = (
    PoolRule("peak_tflops.fp32", "every figure is in (0, 1e6] TFLOP/s", '`peak_tflops: {"fp32": 0}`',
             {**BASE_POOL, "peak_tflops": {"fp32": 0}}),
    PoolRule("pools", "a file that lists several pools names each once", "the pool twice, in a list",
             [BASE_POOL, BASE_POOL]),
    PoolRule("pool", "a file holds one pool (a mapping) or a non-empty list of them", "`[]`", []),
)  # fmt: skip


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _type(annotation: Any) -> str | None:
    """A mapping's type as `{KEY: VALUE}` (the spec reference's walk has no dict fields), else None."""
    if typing.get_origin(annotation) is dict:
        key, value = typing.get_args(annotation)
        return f"{{{type_text(key)}: {type_text(value)}}}"
    return None


def render_markdown() -> str:
    """The pool reference as GitHub-flavoured Markdown."""
    out = [
        "# Pool reference",
        "",
        f"<!-- Generated from megatrain/plan/pool.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "A pool file describes the hardware of a node pool: what the planner's cost model and the "
        "scheduler's placement read about it. The embedded default measures its own machine; describe "
        "the pools it cannot measure (GPU nodes elsewhere, a bigger host) in YAML or JSON. "
        "Examples: " + ", ".join(f"[examples/pools/{n}](../examples/pools/{n})" for n in EXAMPLES) + ".",
        "",
        "- `megatrain plan SPEC --pool POOL.yaml` plans a job spec on one pool offline (nothing is "
        "submitted); `POST /v1/plan` takes the same mapping as its `pool`.",
        "- `megatrain pools apply POOL.yaml …` stores descriptions in the service's database (an "
        "operator's command; a file holds one pool or a list of them); `MEGATRAIN_POOLS_FILE` applies "
        "a file whenever the stack or the scheduler starts. An operator's description replaces the one "
        "a pool's worker measured; `megatrain pools list` shows which is in force.",
        "",
        "Bandwidths are per device and one direction, in GB/s (1e9 bytes): what one device can push "
        "to a peer, over NVLink inside a node, its share of the NICs across nodes. Latencies are one "
        "message's, in µs. Peak TFLOP/s are dense (no sparsity), per device, per precision; a "
        "precision without a figure is planned at the next slower one given (fp8 → bf16 → fp16 → fp32).",
        "",
        "## Fields",
        "",
        "| Field | Type | Default | Bounds | Description |",
        "|---|---|---|---|---|",
    ]
    for section in sections(PoolSpec):
        for f in section.fields:
            default = f.default if f.default == "required" else _code(f.default)
            kind = _type(PoolSpec.model_fields[f.name].annotation) or f.type
            out.append(
                f"| {_code(f.name)} | {_code(kind)} | {default} | {_cell(f.bounds)} | {_cell(f.doc)} |"
            )
    out += [
        "",
        "## Rules",
        "",
        f"Each with the field its error names and a file that breaks it; this one is valid: "
        f"{_code(json.dumps(BASE_POOL))}.",
        "",
        "| Field | Rule | Broken by |",
        "|---|---|---|",
    ]
    out += [f"| {_code(r.field)} | {_cell(r.rule)} | {_cell(r.change)} |" for r in RULES]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render_markdown())
