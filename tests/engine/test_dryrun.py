"""The planner's memory estimate against the engine's own start and first step on fake tensors
(megatrain.engine.dryrun), at real shapes: Llama-3-8B (tp=2, sp), Llama-3-70B (tp=8, pp=4,
interleaved, sp, distributed optimizer over dp=2) and Mixtral-8x7B (ep=8), rank 0 of each.

Tolerances: model state (parameters, gradients, optimizer) is counted exactly by both sides, so 10%
only absorbs bucket padding; activations within 20% (the planner counts per-token coefficients, the
dryrun every saved tensor, including small ones the planner leaves out, such as RoPE's per-layer
tables); the start-up peak, an exact sequence of allocations, within 10%.
"""

from __future__ import annotations

import json

import pytest

from megatrain.engine.dryrun import DryRunReport, dryrun
from megatrain.engine.dryrun.__main__ import compare, main
from megatrain.engine.dryrun.cases import CASES, LORA_70B, Case

GiB = 1 << 30


def _close(planned: float, measured: float, tolerance: float) -> bool:
    return abs(planned - measured) <= tolerance * measured


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_planner_agrees_with_the_dryrun(case: Case) -> None:
    spec, layout = case.spec(), case.layout()
    report = dryrun(spec, layout, case.rank, microbatches=case.microbatches)
    result = compare(spec, layout, report)
    plan = result["planner"]
    state = report.params_bytes + report.grads_bytes + report.optimizer_bytes
    planned_state = plan["params"] + plan["grads"] + plan["optimizer"]
    text = {k: (round(plan[k] / GiB, 2), round(v / GiB, 2)) for k, v in _measured(report).items()}
    assert _close(planned_state, state, 0.10), text
    assert _close(plan["activations"], report.activations_bytes, 0.20), text
    assert _close(plan["startup_peak"], report.startup_peak_bytes, 0.10), text
    # Every term is really there, at its real size (a fake step that skipped work would be small).
    assert report.num_params > 1e9 and report.activations_bytes > 5 * GiB, text


def test_planner_agrees_with_a_lora_dryrun() -> None:
    """Llama-3-70B frozen with rank-16 adapters on every linear (the 70B case's layout): the frozen
    base's bytes, and the gradient buffer, fp32 mains and moments of the adapters alone (sharded
    over dp), as the planner counts them; activations and the start-up peak close."""
    spec, layout = LORA_70B.spec(), LORA_70B.layout()
    report = dryrun(spec, layout, LORA_70B.rank, microbatches=LORA_70B.microbatches)
    plan = compare(spec, layout, report)["planner"]
    text = {k: (round(plan[k] / GiB, 3), round(v / GiB, 3)) for k, v in _measured(report).items()}
    assert plan["params"] == report.params_bytes, text
    # (The distributed optimizer pads each bucket to a multiple of dp: a few elements.)
    assert _close(plan["grads"], report.grads_bytes, 0.001), text
    assert _close(plan["optimizer"], report.optimizer_bytes, 0.001), text
    assert report.grads_bytes + report.optimizer_bytes < 0.05 * report.params_bytes, text
    assert _close(plan["activations"], report.activations_bytes, 0.05), text
    assert _close(plan["startup_peak"], report.startup_peak_bytes, 0.01), text


def _measured(r: DryRunReport) -> dict[str, int]:
    return {
        "params": r.params_bytes,
        "grads": r.grads_bytes,
        "optimizer": r.optimizer_bytes,
        "activations": r.activations_bytes,
        "startup_peak": r.startup_peak_bytes,
    }


def test_cli_prints_one_json_object(tmp_path, capsys) -> None:  # noqa: ANN001
    """The command line on a small spec: a JSON object with both sides of every term."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: tiny\nmodel: {arch: llama, num_layers: 2, hidden_size: 256, num_attention_heads: 8,\n"
        "  num_query_groups: 4, ffn_hidden_size: 688, seq_length: 256, vocab_size: 1024}\n"
        "data: {train: [{dataset: corpus}]}\n"
        "training: {global_batch_size: 4, micro_batch_size: 1, precision: bf16}\n"
        "parallelism: {tp: 2, pp: 2, dp: 1, sequence_parallel: true}\n"
    )
    assert main(["--spec", str(spec), "--rank", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rank"] == 3 and out["stage"] == 1
    assert set(out["planner"]) == set(out["ratio"])
    assert out["dryrun"]["microbatches"] == 4
    assert 0.8 < out["ratio"]["params"] < 1.2
    # A stored layout is run as given (here the spec's, written out as the API stores it).
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps(out["layout"]))
    assert main(["--spec", str(spec), "--layout", str(layout), "--rank", "1", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["stage"] == 0 and again["layout"] == out["layout"]
    assert main(["--spec", str(spec), "--rank", "4"]) == 2  # outside the layout's 4 ranks
