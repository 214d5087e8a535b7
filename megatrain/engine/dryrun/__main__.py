"""`python -m megatrain.engine.dryrun --spec SPEC [--layout LAYOUT.json] --rank R [--microbatches M] --json`:
rank R's start and first step on fake tensors (megatrain.engine.dryrun), next to the planner's
estimate for the same stage, term by term."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megatrain.engine.dryrun import DryRunReport, dryrun
from megatrain.plan.layout import Layout, check_layout, resolve_layout
from megatrain.plan.memory import MemoryEstimate, from_spec
from megatrain.spec import load_spec

TERMS = ("params", "grads", "optimizer", "activations", "stored", "transient", "startup_peak", "peak")
"""The rows of the comparison: the planner's term and the dryrun's measurement of it."""


def planner_terms(est: MemoryEstimate) -> dict[str, int]:
    """The planner's figures under the dryrun's names (stored: the saved activations; transient: the
    largest transient; peak: the step's total)."""
    b = est.breakdown
    return {
        "params": est.params_bytes,
        "grads": est.grads_bytes,
        "optimizer": est.optimizer_bytes,
        "activations": est.activations_bytes,
        "stored": sum(v for k, v in b.items() if k.startswith("activations_")),
        "transient": max((v for k, v in b.items() if k.startswith("transient_")), default=0),
        "startup_peak": est.startup_bytes,
        "peak": max(est.total_bytes, est.startup_bytes),
    }


def dryrun_terms(r: DryRunReport) -> dict[str, int]:
    return {
        "params": r.params_bytes,
        "grads": r.grads_bytes,
        "optimizer": r.optimizer_bytes,
        "activations": r.activations_bytes,
        "stored": r.stored_bytes,
        "transient": r.transient_bytes,
        "startup_peak": r.startup_peak_bytes,
        "peak": r.peak_bytes,
    }


def compare(spec: Any, layout: Layout, report: DryRunReport) -> dict[str, Any]:
    """The planner's estimate for the dryrun's stage and micro-batch count, side by side with it."""
    est = from_spec(
        spec, layout, precision=report.precision, num_microbatches=report.microbatches, stage=report.stage
    )
    plan, run = planner_terms(est), dryrun_terms(report)
    return {
        "rank": report.rank,
        "stage": report.stage,
        "layout": layout.as_dict(),
        "dryrun": report.as_dict(),
        "planner": plan,
        "ratio": {k: round(plan[k] / run[k], 4) if run[k] else None for k in TERMS},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatrain.engine.dryrun", description=__doc__)
    parser.add_argument("--spec", required=True, help="job spec (YAML or JSON)")
    parser.add_argument(
        "--layout", default=None, help="the job's resolved layout (JSON; default: the spec's)"
    )
    parser.add_argument("--rank", type=int, default=0, help="the global rank to run (default 0)")
    parser.add_argument(
        "--microbatches", type=int, default=None, help="per step and dp rank (default: the spec's)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    spec = load_spec(args.spec)
    if args.layout is None:
        layout = resolve_layout(spec)
    else:
        layout = Layout.from_dict(json.loads(Path(args.layout).read_text()))
        check_layout(spec, layout)
    if not 0 <= args.rank < layout.world_size:
        print(f"error: rank {args.rank} is outside the layout's {layout.world_size} ranks", file=sys.stderr)
        return 2
    result = compare(spec, layout, dryrun(spec, layout, args.rank, microbatches=args.microbatches))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"rank {result['rank']} (stage {result['stage']}) | {layout.describe()}")
    print(f"{'term':<14}{'planner GiB':>13}{'dryrun GiB':>13}{'ratio':>8}")
    for k in TERMS:
        ratio = result["ratio"][k]
        p, d = result["planner"][k] / 2**30, dryrun_terms(report_of(result))[k] / 2**30
        print(f"{k:<14}{p:>13.3f}{d:>13.3f}{'' if ratio is None else f'{ratio:>8.3f}'}")
    return 0


def report_of(result: dict[str, Any]) -> DryRunReport:
    return DryRunReport(**result["dryrun"])


if __name__ == "__main__":
    sys.exit(main())
