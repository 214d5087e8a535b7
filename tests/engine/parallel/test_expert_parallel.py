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

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from megatrain.engine.checkpoint.sharded import open_folder
from megatrain.engine.checkpoint.shards import global_shape, param_boxes, slice_boxes
from megatrain.engine.checkpoint.training import load_training_state
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.expert import _chunk_order
from megatrain.engine.parallel.mappings import is_expert_parallel, mark_expert_parallel, mark_tensor_parallel
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.train import run
from megatrain.plan.layout import Layout
from megatrain.spec import parse_spec

from ..helpers import read_jsonl, tiny_spec
from ._ep_common import Stack, all_workers, options, reference_run, train_steps, trainable
from ._launch import run_distributed

pytestmark = pytest.mark.distributed

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOL = {"rtol": 1e-4, "atol": 5e-5}
SAVE_AT = 5


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The parent's one-process runs on one thread: the tiny shapes gain nothing from more, which
    would only contend with the ranks (and other work) for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def _state(layout: Layout, rank: int) -> ParallelState:
    """A rank's state without process groups (nothing here runs a collective)."""
    return ParallelState(layout, rank, torch.device("cpu"), {a: None for a in ("tp", "cp", "dp", "pp", "mp")})


def test_expert_boxes_sit_at_their_ep_ranks_experts() -> None:
    # ep=2 × dp=2: rank 1 holds experts 2..3 of 4; tp=2 on top splits fc1's [gate; up] rows.
    p = nn.Parameter(torch.zeros(2, 6, 5))
    mark_expert_parallel(p)
    state = _state(Layout(dp=2, ep=2), 1)
    assert global_shape(p, state) == (4, 6, 5)
    assert [b.offsets for b in param_boxes(p, p.detach(), state)] == [(2, 0, 0)]
    mark_tensor_parallel(p, 1, stride=2)  # local [gate_r; up_r], 3 rows each, of [gate; up] (12 rows)
    state = _state(Layout(tp=2, dp=2, ep=2), 3)  # tp rank 1, ep rank 1
    assert global_shape(p, state) == (4, 12, 5)
    assert [b.offsets for b in param_boxes(p, p.detach(), state)] == [(2, 3, 0), (2, 9, 0)]
    # A flat range of the distributed optimizer, local expert 1's rows 2..5 (gate row 2, up rows 0..2),
    # is placed the same way: global expert 3, gate rows 3 + 2, up rows 9..11.
    boxes = slice_boxes(p, 40, torch.zeros(20), state)
    assert [(b.offsets, tuple(b.data.shape)) for b in boxes] == [
        ((3, 5, 0), (1, 1, 5)),
        ((3, 9, 0), (1, 3, 5)),
    ]


def test_expert_buckets_are_reduced_and_sharded_over_edp() -> None:
    # dp=4, ep=2: dense buckets over dp (4 ranks), expert buckets over edp (2 ranks), never mixed.
    torch.manual_seed(0)
    model = Stack()
    state = _state(Layout(dp=4, ep=2), 2)  # ep rank 0, edp rank 1
    for name in ("fc1_weight", "fc2_weight"):
        mark_expert_parallel(getattr(model.moe.experts, name))
    ddp = DataParallel(model, state, bucket_elements=10_000_000, use_distributed_optimizer=True)
    kinds = [(b.expert, b.size, b.rank, b.numel % b.size) for b in ddp.buckets]
    assert kinds == [(False, 4, 2, 0), (True, 2, 1, 0), (False, 4, 2, 0)]
    assert all(is_expert_parallel(p) == b.expert for b in ddp.buckets for p in b.params)
    # The expert bucket is [fc2 (4·16·24 = 1536), fc1 (4·48·16 = 3072)] in backward order; edp rank 1
    # updates its second half, elements [2304, 4608): none of fc2, fc1's elements [768, 3072).
    owned = {id(s.param): (s.start, s.end) for s in ddp.owned_slices()}
    assert id(model.moe.experts.fc2_weight) not in owned
    assert owned[id(model.moe.experts.fc1_weight)] == (768, 3072)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    url = tmp_path_factory.mktemp("ep_ckpt").as_uri()
    opts = options(dp=2, ep=2, save_at=(url, SAVE_AT))
    ranks = run_distributed(all_workers, 2, ["exchange", opts])
    return {"exchange": [r[0] for r in ranks], "trained": [r[1] for r in ranks], "url": url, "opts": opts}


LAYER_KEYS = ("layer_forward", "layer_input_grad", "router_grad", "fc1_weight_grad", "fc2_weight_grad")


def test_all_to_all_dispatcher_and_full_weights_match_gathered_references(two_ranks: dict[str, Any]) -> None:
    for rank, errors in enumerate(two_ranks["exchange"]):
        assert errors["a2a_forward"] == 0 and errors["a2a_backward"] == 0, (rank, errors)
        for key in LAYER_KEYS:
            assert errors[key] < 1e-6, (rank, key, errors[key])
            # Pipelined over 3 token chunks (expert_overlap), and so inside a recomputed region.
            assert errors[f"overlap_{key}"] < 1e-6, (rank, key, errors[f"overlap_{key}"])
            assert errors[f"overlap_recompute_{key}"] < 1e-6, (rank, key, errors[f"overlap_recompute_{key}"])
            assert errors[f"overlap_offload_{key}"] < 1e-6, (rank, key, errors[f"overlap_offload_{key}"])
            # Two nodes of one ep rank (plain, hop 1 pipelined in 3 chunks, recomputed, offloaded),
            # one node of two.
            for how in (
                "nodes1",
                "nodes1_overlap",
                "nodes1_overlap_recompute",
                "nodes1_overlap_offload",
                "nodes2",
            ):
                assert errors[f"{how}_{key}"] < 1e-6, (rank, how, key, errors[f"{how}_{key}"])
            # Every token to rank 0's experts: rank 1's run on no rows (and would skip the reverse
            # exchange, hanging rank 0, were their empty output not tied to their input).
            for how in ("starved_pairs", "starved_overlap", "starved_nodes1", "starved_nodes1_overlap"):
                assert errors[f"{how}_{key}"] < 1e-6, (rank, how, key, errors[f"{how}_{key}"])
        assert errors["overlap_rows"] > 0
        # Recomputed, the pipelined layer keeps what the plain one keeps (its input, not counted)
        # and its chunks' row indices, not its experts' activations (22 KB here unrecomputed).
        held = {k: v for k, v in errors.items() if k.endswith("held")}
        assert errors["overlap_recompute_held"] < 0.05 * errors["overlap_held"], (rank, held)
        assert errors["pairs_recompute_held"] < 0.05 * errors["overlap_held"], (rank, held)
        assert errors["nodes1_overlap_recompute_held"] < 0.05 * errors["nodes1_overlap_held"], (rank, held)
        assert errors["nodes1_overlap_off_node"] == errors["nodes1_off_node"]  # the same rows, in chunks
        # Unrecomputed, every dispatch holds what the pairs dispatch holds, as the planner counts:
        # each chunk's expert output and received rows are let go once its combine is done
        # (without that: +21% and +15% here), and the two hops' sums (kernels.moe_combine) keep
        # no fp32 copies of their rows (+16%).
        wide = {k: v for k, v in errors.items() if k.startswith("wide")}
        for how in ("overlap", "nodes1", "nodes1_overlap"):
            assert errors[f"wide_{how}_held"] < 1.03 * errors["wide_pairs_held"], (rank, how, wide)
        # Each of the 3 chunks' experts run once plainly; recomputed, once more in the checkpoint's
        # rerun, whose small graphs the backward takes (not a third time); offloaded, once more.
        for how in ("overlap", "nodes1_overlap"):
            calls = [errors[f"{how}{kind}_expert_calls"] for kind in ("", "_recompute", "_offload")]
            assert calls == [3, 6, 6], (rank, how, calls)
        # A token whose two experts share a rank now travels once: fewer rows than one per pair.
        assert errors["nodes1_rows_saved"] > 0 and errors["nodes2_rows_saved"] > 0
        assert errors["starved_received"] == (30 if rank == 0 else 0), (rank, errors["starved_received"])
        assert errors["load_slice"] == 0 and errors["round_trip"] == 0, (rank, errors)


def test_ep2_dp2_matches_one_process(two_ranks: dict[str, Any]) -> None:
    opts = two_ranks["opts"]
    ref = reference_run(opts, stop=SAVE_AT)
    got = two_ranks["trained"][0]
    _matches(got, ref)
    # Each rank holds half of the experts.
    full = sum(t.numel() * 4 for n, t in ref["params"].items() if ".experts." in n)
    assert [r["expert_bytes"] for r in two_ranks["trained"]] == [full // 2, full // 2]


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1(two_ranks: dict[str, Any], one_thread: None) -> None:
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
    # The zero-bubble schedules split each backward in B and W (the experts' grouped GEMMs get their
    # weight gradients in B); zbv's V holds two one-layer chunks per stage. The exchange pipelined.
    "ep2_pp2_zbh1_overlap2": options(
        model="llama4", pp=2, dp=2, ep=2, distributed_optimizer=True, schedule="zb-h1", overlap_chunks=2
    ),
    "ep2_pp2_zbv": options(model="llama4", pp=2, dp=2, ep=2, schedule="zbv", virtual_stages=2),
    # 1F1B's steady pairs (4 micro-batches per rank) in lanes, the forward of one beside the backward
    # of another: plain, and with two hops, the hop across nodes in 2 chunks.
    "ep2_pp2_lanes": options(model="llama4", pp=2, dp=2, ep=2, global_batch=16, lanes=True),
    "ep2_pp2_lanes_nodes_overlap2": options(
        model="llama4", pp=2, dp=2, ep=2, global_batch=16, lanes=True, overlap_chunks=2, ep_ranks_per_node=1
    ),
    # Two hops with the ep ranks on two nodes, the hop across them pipelined in 2 chunks, zb-h1.
    "ep2_pp2_zbh1_nodes_overlap2": options(
        model="llama4", pp=2, dp=2, ep=2, schedule="zb-h1", overlap_chunks=2, ep_ranks_per_node=1
    ),
}


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, dict[str, Any]]:
    results = run_distributed(all_workers, 4, [*FOUR_RANKS.values(), "exchange"], timeout=240)
    out = dict(zip([*FOUR_RANKS, "exchange"], results[0], strict=True))
    out["exchange"] = [r[-1] for r in results]  # every rank's errors
    return out


def test_the_two_hop_dispatch_over_two_nodes_matches_the_full_layer(
    four_ranks: dict[str, Any],
) -> None:
    """ep=4 as two nodes of two ranks (both hops cross ranks), four nodes of one and one of four."""
    for rank, errors in enumerate(four_ranks["exchange"]):
        # (nodes1 and nodes2 also with hop 1 pipelined in 3 chunks, plainly and recomputed)
        hows = ("nodes1", "nodes2", "nodes4", "nodes1_overlap", "nodes2_overlap", "nodes2_overlap_recompute")
        for how in hows:
            for key in LAYER_KEYS:
                assert errors[f"{how}_{key}"] < 1e-6, (rank, how, key, errors[f"{how}_{key}"])
        # Across nodes a token travels once per node: two nodes of two ranks send fewer rows off
        # the node than four nodes of one (once per rank), and one node sends none.
        assert errors["nodes2_off_node"] < errors["nodes1_off_node"], (rank, errors)
        assert errors["nodes4_off_node"] == 0


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_rank_layouts_match_one_process(four_ranks: dict[str, dict[str, Any]], name: str) -> None:
    _matches(four_ranks[name], reference_run(FOUR_RANKS[name]))
    # In lanes the forward and backward take turns at each all-to-all and pipeline receive.
    assert (four_ranks[name]["hand_overs"] > 0) == FOUR_RANKS[name]["lanes"]


@pytest.mark.parametrize(
    "layout",
    [
        {"dp": 2, "ep": 2},
        {"dp": 2, "ep": 2, "moe_overlap_chunks": 2},
        {"dp": 2, "ep": 2, "moe_dispatch": "nodes"},
        {"dp": 2, "ep": 2, "moe_overlap_microbatches": True},
        {"cp": 2, "ep": 2},
        {"tp": 2, "dp": 2, "ep": 2, "sequence_parallel": True},
    ],
    ids=["dp2-ep2", "dp2-ep2-overlap2", "dp2-ep2-nodes", "dp2-ep2-lanes", "cp2-ep2", "tp2sp-dp2-ep2"],
)
def test_the_engine_runs_ep2_like_one_process(
    tmp_path: Path, corpus: Path, one_thread: None, layout: dict[str, int]
) -> None:
    """torchrun with ep=2 carved from dp=2 (its all-to-alls plain, pipelined behind the experts in two
    token chunks, or in two hops: once per node, then per rank, or each micro-batch's forward beside
    the one before's backward), or from cp=2 (the ranks hold halves
    of every sequence and exchange them with the experts), or beside tp=2 with sequence parallelism
    (each tp rank holds its slice of its ep rank's experts), through build_model, the distributed
    optimizer and the training loop, aux loss on: the one-process run's losses and grad norms."""
    raw = tiny_spec(corpus, train_iters=4, warmup_iters=1, checkpoint_interval=0, eval_interval=0)
    raw["model"]["moe"] = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32}
    run(parse_spec(raw), tmp_path / "single")
    world = 4 if "tp" in layout else 2
    raw["parallelism"], raw["resources"] = layout, {"devices": world}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    spec, out = str(tmp_path / "spec.json"), str(tmp_path / "ep")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "megatrain.engine.train", "--spec", spec, "--out", out]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    chunks = layout.get("moe_overlap_chunks", 1)
    how = f"pipelined behind the experts in {chunks} token chunks" if chunks > 1 else "not overlapped"
    if layout.get("moe_dispatch") == "nodes":  # one torchrun: one node, so the hop across ranks
        how = "in two hops, once per node, then per rank (2 ep ranks per node)"
    if layout.get("moe_overlap_microbatches"):  # global batch 8 = 2 micro-batches per rank
        how += "; each micro-batch's forward beside the one before's backward"
    assert f"experts: 2 of 4 per rank (ep=2) | all-to-all {how}" in proc.stdout + proc.stderr
    ref = [r for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if "loss" in r]
    got = [r for r in read_jsonl(tmp_path / "ep" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        # Under cp each rank routes half of every sequence; the aux loss still balances the whole
        # (counts summed over cp, as Megatron does), so it and its gradient equal one process's.
        assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], rel=1e-5)
