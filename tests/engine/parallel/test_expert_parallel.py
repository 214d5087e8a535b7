"""Expert parallelism (megatrain/engine/parallel/expert.py) on gloo against one process.

Two spawns: two ranks (the all-to-all Function, one MoE layer, and ep=2 × dp=2 training that saves a
checkpoint the parent resumes at ep=1), and four ranks (ep=2 with dp=4 (edp=2) with and without the
distributed optimizer, ep=2 × tp=2, ep=2 × pp=2 with the distributed optimizer).

Tolerances: the all-to-all only moves rows, so it is exact. An expert's matmuls see the rows of both
ranks' micro-batches at once and gradients are summed across ranks in another order than one process
accumulates them, so results differ by fp32 rounding (~1e-7 relative per step), which AdamW's
normalised steps carry over a few steps: the data-parallel tests' bounds (losses 1e-5, weights 1e-4).
The routers are scaled up so that no top-k choice is within rounding of a tie (_ep_common).
A test fails at once if any expert is missing, counted twice or reduced over the wrong group: the
losses then differ from the first update on by far more (1e-3 and up).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.engine.checkpoint.sharded import open_folder
from megatrain.engine.checkpoint.training import load_training_state
from megatrain.engine.parallel.expert import _chunk_order
from megatrain.engine.parallel.state import ParallelState

from ._ep_common import all_workers, options, reference_run, train_steps, trainable
from ._launch import run_distributed

pytestmark = pytest.mark.distributed

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOL = {"rtol": 1e-4, "atol": 5e-5}
SAVE_AT = 3


def _matches(got: dict[str, Any], ref: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=1e-6)
    assert got["params"].keys() == ref["params"].keys()
    for name, t in ref["params"].items():
        torch.testing.assert_close(got["params"][name], t, **PARAM_TOL, msg=name)


def test_chunk_order_regroups_source_major_rows_expert_major() -> None:
    # Two sources × three experts; rows labelled by (source, expert).
    sizes = torch.tensor([[1, 0, 2], [2, 1, 0]])
    labels = [(s, e) for s in range(2) for e in range(3) for _ in range(int(sizes[s, e]))]
    order = _chunk_order(sizes).tolist()
    assert [labels[i] for i in order] == sorted(labels, key=lambda se: (se[1], se[0]))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    url = tmp_path_factory.mktemp("ep_ckpt").as_uri()
    opts = options(dp=2, ep=2, save_at=(url, SAVE_AT))
    ranks = run_distributed(all_workers, 2, ["exchange", opts])
    return {"exchange": [r[0] for r in ranks], "trained": [r[1] for r in ranks], "url": url, "opts": opts}


def test_all_to_all_dispatcher_and_full_weights_match_gathered_references(two_ranks: dict[str, Any]) -> None:
    for rank, errors in enumerate(two_ranks["exchange"]):
        assert errors["a2a_forward"] == 0 and errors["a2a_backward"] == 0, (rank, errors)
        for key in ("layer_forward", "layer_input_grad", "router_grad", "fc1_weight_grad", "fc2_weight_grad"):
            assert errors[key] < 1e-6, (rank, key, errors[key])
        assert errors["load_slice"] == 0 and errors["round_trip"] == 0, (rank, errors)


def test_ep2_dp2_matches_one_process(two_ranks: dict[str, Any]) -> None:
    opts = two_ranks["opts"]
    ref = reference_run(opts, stop=SAVE_AT)
    got = two_ranks["trained"][0]
    _matches(got, ref)
    # Each rank holds half of the experts.
    full = sum(t.numel() * 4 for n, t in ref["params"].items() if ".experts." in n)
    assert [r["expert_bytes"] for r in two_ranks["trained"]] == [full // 2, full // 2]


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1(two_ranks: dict[str, Any]) -> None:
    opts = {**two_ranks["opts"], "dp": 1, "ep": 1, "save_at": None}
    train = trainable(opts, ParallelState.single())
    progress = load_training_state(open_folder(two_ranks["url"]), train, distributed=False)
    assert progress.step == SAVE_AT and train.optimizer.steps == SAVE_AT
    losses, norms = train_steps(opts, train, SAVE_AT, opts["steps"])
    ref = reference_run(opts)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"][SAVE_AT:]), **LOSS_TOL)
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(ref["norms"][SAVE_AT:]), rtol=1e-4, atol=1e-6
    )


FOUR_RANKS = {
    "ep2_dp4": options(model="gpt2", dp=4, ep=2),
    "ep2_dp4_distopt": options(model="gpt2", dp=4, ep=2, distributed_optimizer=True),
    "ep2_tp2": options(model="stack", tp=2, dp=2, ep=2),
    "ep2_pp2_distopt": options(model="llama4", pp=2, dp=2, ep=2, distributed_optimizer=True),
}


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, dict[str, Any]]:
    results = run_distributed(all_workers, 4, list(FOUR_RANKS.values()), timeout=240)
    return dict(zip(FOUR_RANKS, results[0], strict=True))


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_layouts_match_one_process(four_ranks: dict[str, dict[str, Any]], name: str) -> None:
    _matches(four_ranks[name], reference_run(FOUR_RANKS[name]))
