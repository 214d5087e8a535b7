"""The planner's per-rank memory estimate against the engine's own start and first step on fake
tensors (megatrain.engine.dryrun), term by term, at the real shapes of megatrain.engine.dryrun.cases.

    python benchmarks/dryrun_vs_planner.py            # the table (about 15 s per model on one core)
    python benchmarks/dryrun_vs_planner.py --json     # one JSON object per model

Each row is one rank of the layout, in GiB: the planner's figure for that rank's stage, the
dryrun's, and their ratio. "stored" is what forward saved when a backward started; "transient" the rest of the
activation peak; "startup" the most held before the first step; "peak" the larger of the start-up
and a steady step (model state with Adam's moments + activations).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrain.engine.dryrun import dryrun  # noqa: E402
from megatrain.engine.dryrun.__main__ import TERMS, compare, dryrun_terms, report_of  # noqa: E402
from megatrain.engine.dryrun.cases import BENCHMARK_CASES  # noqa: E402

GiB = 1 << 30


def _layout_text(layout: dict) -> str:
    parts = [f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if layout[k] > 1]
    if layout["virtual_stages"] > 1:
        parts.append(f"v={layout['virtual_stages']}")
    if layout["sequence_parallel"]:
        parts.append("sp")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not args.json:
        print(
            "| model | layout, rank run, micro-batches | term | planner GiB | dryrun GiB | planner / dryrun |"
        )
        print("|---|---|---|---:|---:|---:|")
    for case in BENCHMARK_CASES:
        spec, layout = case.spec(), case.layout()
        result = compare(spec, layout, dryrun(spec, layout, case.rank, microbatches=case.microbatches))
        if args.json:
            print(json.dumps({"model": case.name, **result}))
            continue
        measured = dryrun_terms(report_of(result))
        lay = result["layout"]
        dist_opt = case.parallelism.get("distributed_optimizer", True) and lay["dp"] * lay["cp"] > 1
        text = _layout_text(lay) + (" dist-opt" if dist_opt else "")
        text += f", rank {case.rank} (stage {result['stage']}), {case.microbatches} mb"
        for term in TERMS:
            plan, run = result["planner"][term] / GiB, measured[term] / GiB
            ratio = result["ratio"][term]
            print(f"| {case.name} | {text} | {term} | {plan:,.2f} | {run:,.2f} | {ratio:.3f} |")
        print(f"| {case.name} | | dryrun wall time | | {result['dryrun']['seconds']:.1f} s | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
