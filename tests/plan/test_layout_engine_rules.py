"""Every layout rule the engine enforces is a rule of `plan.layout.layout_problems`, met there first.

The engine's guards are found by walking its source (a `raise` that names a parallel axis); GUARDS
lists each with the cases (spec changes) that reach it, or why no spec can. Each case must be
refused by layout_problems, naming its field (so POST /v1/spec/validate answers 422), and then by
the engine on the same spec and layout: built on the meta device with a rank-0 ParallelState that
has no process groups (every guard runs before any collective). Guards that call the rule functions
themselves must refuse with the very same words.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import megatrain.engine
from megatrain.engine.build import build_model
from megatrain.engine.config import t5_config, transformer_config
from megatrain.engine.microbatch import context_parallel_index
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.models.moe import moe_layers
from megatrain.engine.parallel.expert import AllToAllDispatcher, shard_experts
from megatrain.engine.parallel.moe_tensor import parallelize_moe_layer
from megatrain.engine.parallel.schedules import check_schedule
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.train import check_runnable
from megatrain.plan.layout import AXES, Layout, check_layout, layout_problems, resolve_layout
from megatrain.spec import JobSpec, ParallelismSpec, SpecError, parse_spec

BASE: dict[str, Any] = {"name": "rules", "data": {"train": [{"path": "file:///data/corpus.jsonl"}]}}
BYTE_VOCAB = 257
ENGINE = Path(megatrain.engine.__file__).parent
RULE_FUNCTIONS = {"model_problems", "expert_problems", "context_problems", "layout_problems", "check_layout"}


def spec_of(model: dict[str, Any] | None = None, parallelism: Any = None, **training: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["model"] = model or {}
    data["training"] = training
    if parallelism is not None:
        data["parallelism"] = parallelism
    return data


LANES_V2 = {"pp": 2, "dp": 2, "ep": 2, "virtual_stages": 2, "moe_overlap_microbatches": True}


def layout_of(spec: JobSpec) -> Layout:
    """The spec's explicit layout as written (resolve_layout would refuse it: that is the point)."""
    par = spec.parallelism
    assert isinstance(par, ParallelismSpec)
    return Layout(
        tp=par.tp,
        pp=par.pp,
        dp=par.dp if isinstance(par.dp, int) else 1,
        cp=par.cp,
        ep=par.ep,
        virtual_stages=par.virtual_stages,
        sequence_parallel=par.sequence_parallel,
        pipeline_schedule=par.pipeline_schedule,
        pipeline_layers=tuple(par.pipeline_layers) if par.pipeline_layers is not None else None,
    )


def state_of(layout: Layout) -> ParallelState:
    return ParallelState(layout, 0, torch.device("cpu"), {a: None for a in (*AXES, "mp", "dp_cp")})


# -- the engine, as each guard is reached --------------------------------------------------------


def build(spec: JobSpec, layout: Layout) -> None:
    """The engine's model build (parallelize, experts, context, pipeline stages) on this layout."""
    config = t5_config if spec.model.arch == "t5" else transformer_config
    build_model(config(spec, BYTE_VOCAB), state_of(layout), 0, "meta")


def moe_tensor(spec: JobSpec, layout: Layout) -> None:
    """parallel.moe_tensor on its own (parallelize_model checks the same widths first)."""
    with torch.device("meta"):
        model = GPTModel(transformer_config(spec, BYTE_VOCAB))
    cfg = model.config
    parallelize_moe_layer(next(iter(moe_layers(model))), state_of(layout), cfg.activation == "swiglu")


def expert_shards(spec: JobSpec, layout: Layout) -> None:
    """The expert-parallel pieces below parallelize_experts, which refuses first."""
    num_experts = spec.model.moe.num_experts if spec.model.moe is not None else 0
    with pytest.raises(ValueError, match="not divisible by ep"):
        AllToAllDispatcher(num_experts, None, layout.ep, 0)
    shard_experts(torch.zeros(num_experts, 1), state_of(layout))


def expert_groups(spec: JobSpec, layout: Layout) -> None:
    """ParallelState.build's expert groups (what refuses ep not dividing dp×cp at tp=1)."""
    layout.expert_group_ranks("ep")


def cp_chunks(spec: JobSpec, layout: Layout) -> None:
    """The context-parallel batch split (engine.microbatch)."""
    context_parallel_index(spec.model.seq_length, 0, layout.cp)


def schedule(spec: JobSpec, layout: Layout) -> None:
    tr = spec.training
    lanes = isinstance(spec.parallelism, ParallelismSpec) and spec.parallelism.moe_overlap_microbatches
    check_schedule(layout.pipeline_schedule, layout.pp, layout.micro_batches(tr.global_batch_size,
                   tr.micro_batch_size), layout.virtual_stages, lanes)  # fmt: skip


def world(spec: JobSpec, layout: Layout) -> None:
    """More processes started than the layout has (torchrun's world against the stored layout)."""
    check_runnable(layout, layout.world_size + 1)


def t5_spec(model: dict[str, Any] | None = None, parallelism: Any = None) -> dict[str, Any]:
    """An arch t5 spec (its WordPiece tokenizer named, never read: the layout is what breaks)."""
    data = spec_of({"arch": "t5", **(model or {})}, parallelism)
    data["data"]["tokenizer"] = {"type": "hf", "path": "/tokenizers/t5.json"}
    return data


Engine = Callable[[JobSpec, Layout], None]

# name: (spec, the field layout_problems must name, its words, the engine's guard, same words?)
CASES: dict[str, tuple[dict[str, Any], str, str, Engine, bool]] = {
    "heads": (spec_of(parallelism={"tp": 3}), "model.num_attention_heads",
              "model.num_attention_heads=8 is not divisible by parallelism.tp=3", build, True),
    "query_groups": (spec_of({"num_query_groups": 2}, {"tp": 4}), "model.num_query_groups",
                     "model.num_query_groups=2 is not divisible by parallelism.tp=4", build, True),
    "ffn": (spec_of({"ffn_hidden_size": 1001}, {"tp": 2}), "model.ffn_hidden_size",
            "model.ffn_hidden_size=1001 is not divisible by parallelism.tp=2", build, True),
    "vocab": (spec_of({"hidden_size": 384, "num_attention_heads": 6, "ffn_hidden_size": 1536,
                       "vocab_size": 1001}, {"tp": 3}), "model.vocab_size",
              "the embedding's 1024 rows are not divisible by parallelism.tp=3", build, True),
    "sequence_parallel": (spec_of({"seq_length": 250}, {"tp": 4, "sequence_parallel": True}),
                          "model.seq_length", "model.seq_length=250 is not divisible by parallelism.tp=4",
                          build, True),
    "moe_ffn": (spec_of({"moe": {"num_experts": 4, "ffn_hidden_size": 177}}, {"tp": 2}),
                "model.moe.ffn_hidden_size",
                "model.moe.ffn_hidden_size=177 is not divisible by parallelism.tp=2", build, True),
    "moe_ffn_layer": (spec_of({"moe": {"num_experts": 4, "ffn_hidden_size": 177}}, {"tp": 2}),
                      "model.moe.ffn_hidden_size",
                      "model.moe.ffn_hidden_size=177 is not divisible by parallelism.tp=2", moe_tensor, True),
    "moe_shared": (spec_of({"moe": {"num_experts": 4, "shared_expert_ffn_hidden_size": 177}}, {"tp": 2}),
                   "model.moe.shared_expert_ffn_hidden_size",
                   "model.moe.shared_expert_ffn_hidden_size=177 is not divisible by parallelism.tp=2",
                   moe_tensor, True),
    "pp_exceeds_layers": (spec_of(parallelism={"pp": 8}), "parallelism.pp",
                          "parallelism.pp=8 exceeds model.num_layers=4", build, True),
    "pp_uneven": (spec_of(parallelism={"pp": 2, "virtual_stages": 4}), "model.num_layers",
                  "model.num_layers=4 is not divisible by parallelism.pp×virtual_stages=2×4", build, True),
    "pipeline_layers": (spec_of(parallelism={"pp": 2, "pipeline_layers": [1, 2]}),
                        "parallelism.pipeline_layers", "parallelism.pipeline_layers=[1, 2] sums to 3", build,
                        True),
    "virtual_without_pp": (spec_of(parallelism={"virtual_stages": 2}), "parallelism.virtual_stages",
                           "parallelism.virtual_stages=2 needs parallelism.pp > 1", schedule, False),
    "interleaved_batches": (spec_of(parallelism={"pp": 4, "virtual_stages": 2, "dp": 1}, global_batch_size=24,
                                    micro_batch_size=4, ), "parallelism.virtual_stages",
                            "= 6, divisible by parallelism.pp=4", schedule, False),
    "experts_over_ep": (spec_of({"moe": {"num_experts": 6}}, {"ep": 4, "dp": 4}), "model.moe.num_experts",
                        "model.moe.num_experts=6 is not divisible by parallelism.ep=4", build, True),
    "expert_shards": (spec_of({"moe": {"num_experts": 6}}, {"ep": 4, "dp": 4}), "model.moe.num_experts",
                      "model.moe.num_experts=6 is not divisible by parallelism.ep=4", expert_shards, False),
    "ep_over_dp_cp": (spec_of({"moe": {"num_experts": 4}}, {"ep": 4, "dp": 2}), "parallelism.ep",
                      "parallelism.ep=4 does not divide dp×cp=2×1", expert_groups, False),
    "cp_chunks": (spec_of(parallelism={"cp": 3}), "model.seq_length",
                  "model.seq_length=256 is not divisible by 2×parallelism.cp=6", cp_chunks, False),
    "cp_dropout": (spec_of({"attention_dropout": 0.1}, {"cp": 2}), "model.attention_dropout",
                   "model.attention_dropout=0.1 is not supported with parallelism.cp=2", build, True),
    "cp_backend": (spec_of({"attention_backend": "flex"}, {"cp": 2}), "model.attention_backend",
                   "attention_backend='flex' is not used with parallelism.cp=2", build, True),
    "t5_heads": (t5_spec(parallelism={"tp": 3}), "model.num_attention_heads",
                 "model.num_attention_heads=8 is not divisible by parallelism.tp=3", build, True),
    "t5_decoder_sp": (t5_spec({"t5": {"decoder_seq_length": 250}}, {"tp": 4, "sequence_parallel": True}),
                      "model.t5.decoder_seq_length",
                      "model.t5.decoder_seq_length=250 is not divisible by parallelism.tp=4", build, False),
    "t5_virtual": (t5_spec(parallelism={"pp": 2, "virtual_stages": 2}), "parallelism.virtual_stages",
                   "parallelism.virtual_stages=2 is not supported for model.arch t5", build, False),
    "zb_h1_virtual": (spec_of(parallelism={"pp": 2, "virtual_stages": 2, "pipeline_schedule": "zb-h1"}),
                      "parallelism.virtual_stages", "runs one chunk per stage", schedule, False),
    "zbv_virtual": (spec_of(parallelism={"pp": 2, "pipeline_schedule": "zbv"}), "parallelism.virtual_stages",
                    "pipeline_schedule=zbv runs two chunks per stage in a V", schedule, False),
    "lanes_v2": (spec_of({"moe": {"num_experts": 4}}, LANES_V2, global_batch_size=16, micro_batch_size=2),
                 "parallelism.moe_overlap_microbatches", "virtual_stages 1 (not 2)", schedule, False),
    "t5_split": (t5_spec(parallelism={"pp": 4, "pipeline_layers": [2, 1, 3, 2]}),
                 "parallelism.pipeline_layers",
                 "the layers per stage ([2, 1, 3, 2]) must put the boundary after layer 4", build, False),
}  # fmt: skip

SHAPED = "a tensor the parallel layers shaped, after parallelize_model's rules passed"
# Every guard the walk finds, by (module, function): the cases that reach it, or why no spec can.
GUARDS: dict[tuple[str, str], list[str] | str] = {
    ("parallel/parallelize.py", "parallelize_model"): ["heads", "query_groups", "ffn", "vocab",
                                                        "sequence_parallel", "moe_ffn"],
    ("parallel/moe_tensor.py", "parallelize_moe_layer"): ["moe_ffn_layer", "moe_shared"],
    ("parallel/pipeline.py", "build_stage_modules"): ["pp_exceeds_layers", "pp_uneven", "pipeline_layers"],
    ("parallel/expert.py", "parallelize_experts"): ["experts_over_ep"],
    ("parallel/expert.py", "__init__"): ["expert_shards"],  # AllToAllDispatcher
    ("parallel/expert.py", "shard_experts"): ["expert_shards"],
    ("parallel/context.py", "parallelize_context"): ["cp_dropout", "cp_backend"],
    ("microbatch.py", "context_parallel_index"): ["cp_chunks"],
    ("parallel/schedules.py", "check_schedule"): ["virtual_without_pp", "interleaved_batches",
                                                  "zb_h1_virtual", "zbv_virtual", "lanes_v2"],
    ("parallel/state.py", "build"): ["world"],
    ("train.py", "check_runnable"): ["world"],
    # Below parallelize_model, whose rules (the tp cases above) refuse every width first.
    ("parallel/layers.py", "__init__"): ["heads", "ffn", "vocab"],
    ("parallel/layers.py", "forward"): ["sequence_parallel"],
    ("parallel/mappings.py", "_split"): SHAPED,
    ("parallel/mappings.py", "reduce_scatter_dim0"): SHAPED,
    ("parallel/mappings.py", "_reduce_scatter"): SHAPED,
    ("parallel/mappings.py", "shard_tensor"): SHAPED,
    ("parallel/schedules.py", "simulate"): "a deadlock is a schedule's bug, not a layout's",
    ("parallel/expert_dedup.py", "ep_ranks_on_node"): "how torchrun puts ranks on nodes (LOCAL_WORLD_SIZE), "
                                                      "not a spec field: an ep group spread unevenly",
    ("parallel/expert_dedup.py", "node_groups"): "its node size is ep_ranks_on_node's, which refuses first",
    ("parallel/data.py", "__init__"): "a ParallelState built by hand without its dp×cp group",
    ("parallel/parallelize_t5.py", "parallelize_t5"): ["t5_heads", "t5_decoder_sp"],
    ("parallel/pipeline_t5.py", "build_t5_stages"): ["t5_virtual"],
    ("parallel/pipeline_t5.py", "t5_stage_layers"): ["t5_split"],
}  # fmt: skip
SAME_RULE = {"parallelize_model", "parallelize_moe_layer", "build_stage_modules", "parallelize_experts",
             "parallelize_context"}  # fmt: skip
"""Guards that call the rule functions of plan.layout themselves."""

_AXIS = re.compile(r"\b(tp|pp|cp|ep|dp|virtual_stages|processes)\b|(Layout|Schedule)Error|UnsupportedLayout")


def engine_guards() -> dict[tuple[str, str], ast.FunctionDef]:
    """Every function of the engine that raises naming a parallel axis (or a layout error)."""
    found: dict[tuple[str, str], ast.FunctionDef] = {}
    for path in sorted(ENGINE.rglob("*.py")):
        source = path.read_text()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            raises = [n for n in ast.walk(fn) if isinstance(n, ast.Raise) and n.exc is not None]
            if any(_AXIS.search(ast.get_source_segment(source, r) or "") for r in raises):
                found[(path.relative_to(ENGINE).as_posix(), fn.name)] = fn
    return found


def test_every_engine_guard_is_listed_with_the_rule_that_refuses_first() -> None:
    found = engine_guards()
    new = sorted(set(found) - set(GUARDS))
    assert not new, (
        f"engine guards {new} are not in GUARDS: give each a case here and its rule in "
        "megatrain.plan.layout.layout_problems (or say why no spec can reach it)"
    )
    assert not sorted(set(GUARDS) - set(found)), "GUARDS lists guards the engine no longer has"
    for key, cases in GUARDS.items():
        assert isinstance(cases, str) or set(cases) <= {*CASES, "world"}, key
    for key, fn in found.items():
        if key[1] in SAME_RULE:
            called = [n.func for n in ast.walk(fn) if isinstance(n, ast.Call)]
            calls = {f.id for f in called if isinstance(f, ast.Name)}
            assert calls & RULE_FUNCTIONS, f"{key} enforces a layout rule, not with plan.layout's functions"


@pytest.mark.parametrize("name", list(CASES))
def test_layout_problems_refuses_first_and_the_engine_agrees(name: str) -> None:
    data, field, words, engine, same = CASES[name]
    spec = parse_spec(data)  # a valid spec on its own: the layout is what breaks a rule
    layout = layout_of(spec)
    problems = [p for p in layout_problems(spec, layout) if p["field"] == field]
    assert problems and words in problems[0]["message"], layout_problems(spec, layout)
    with pytest.raises(ValueError) as info:  # LayoutError, ScheduleError, UnsupportedLayout's kin
        engine(spec, layout)
    if same:
        assert problems[0]["message"] in str(info.value)


def test_the_world_size_is_checked_before_the_engine_starts() -> None:
    spec = parse_spec(spec_of(parallelism={"tp": 2}))
    with pytest.raises(SpecError, match="but the world has 3 processes"):
        check_layout(spec, Layout(tp=2), world_size=3)
    with pytest.raises(Exception, match="needs 2 processes but 3 were started"):
        world(spec, Layout(tp=2))


def test_the_moe_width_rule_is_a_422_at_validation() -> None:
    # issue 28, item 1: an explicit tp=2 with model.moe.ffn_hidden_size=177 passed validation.
    data = spec_of({"moe": {"num_experts": 4, "ffn_hidden_size": 177}}, {"tp": 2})
    with pytest.raises(SpecError) as info:
        resolve_layout(parse_spec(data))
    assert info.value.errors == [
        {
            "field": "model.moe.ffn_hidden_size",
            "message": "model.moe.ffn_hidden_size=177 is not divisible by parallelism.tp=2",
        }
    ]
