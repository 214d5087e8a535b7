"""Pipeline parallelism (gloo ranks on CPU) against a one-process reference on the same batches.

Each layout trains 6 AdamW steps of a 4-layer model on 8 samples per step (4 micro-batches of 2)
and must reproduce the reference's losses, global gradient norms (clipping is active) and final
weights. Only the fp32 summation order differs (micro-batch gradients accumulated one by one, split
matmuls under tp, dp sums), ~1e-7 relative per op; a wrong stage hand-off, a lost micro-batch, a tied
embedding out of sync or a gradient counted twice moves losses by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from ._launch import run_distributed
from ._pp_common import options, pp_worker, reference_run

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOL = {"rtol": 1e-4, "atol": 5e-5}

pytestmark = pytest.mark.distributed


def assert_matches_reference(opts: dict, world_size: int) -> dict:
    got = run_distributed(pp_worker, world_size, opts, timeout=180)[0]
    ref = reference_run(opts)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=1e-6)
    assert got["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, **PARAM_TOL, msg=name)
    return got


# Two stages (world 2).
PP2 = {
    "pp2-1f1b-llama": options(),
    "pp2-tied-gpt2": options(model="gpt2"),
    "pp2-interleaved-gpt2": options(model="gpt2", virtual_stages=2),
    "pp2-all-forward-all-backward-uneven": options(schedule="all_forward_all_backward", layer_split=[1, 3]),
    # Zero bubble: backward split into input gradients (B) and weight gradients (W, deferred).
    "pp2-zb-h1-llama": options(schedule="zb-h1", global_batch=12),
    # The V: stage 0 holds the embedding and the tied head (one Parameter), stage 1 turns round.
    "pp2-zbv-tied-gpt2": options(model="gpt2", schedule="zbv", virtual_stages=2),
}
# Four processes.
PP4 = {
    "pp4-1f1b": options(pp=4, global_batch=16, micro_batch=2),
    "pp2-tp2-sp-fp16-scaler": options(tp=2, sequence_parallel=True, loss_scale=2.0**12),
    # One bucket per stage: the tied weight sits at different offsets of the two stages' dp shards.
    "pp2-dp2-distopt-tied": options(model="gpt2", dp=2, distributed_optimizer=True, bucket_elements=10**6),
    "pp4-zb-h1": options(pp=4, schedule="zb-h1", global_batch=16, micro_batch=2),
    "pp4-zbv-8-layers": options(pp=4, schedule="zbv", virtual_stages=2, layers=8, global_batch=16),
    "pp2-zbv-tp2-sp": options(tp=2, sequence_parallel=True, schedule="zbv", virtual_stages=2),
    "pp2-zb-h1-dp2-distopt": options(schedule="zb-h1", dp=2, distributed_optimizer=True),
}


@pytest.mark.parametrize("name", list(PP2))
def test_two_stages_match_single_process(name: str) -> None:
    assert_matches_reference(PP2[name], 2)


@pytest.mark.parametrize("name", list(PP4))
def test_four_processes_match_single_process(name: str) -> None:
    got = assert_matches_reference(PP4[name], 4)
    if PP4[name]["loss_scale"]:
        # The scale reached the gradients through every stage and was taken off again: no step skipped.
        assert all(s == 2.0**12 for s in got["scales"])


def test_bubble_is_measured() -> None:
    got = run_distributed(pp_worker, 2, options(steps=2), timeout=120)
    for r in got:
        assert r["compute_s"] > 0 and r["wait_s"] > 0 and 0 < r["bubble"] < 1
