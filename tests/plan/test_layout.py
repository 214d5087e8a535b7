"""The one layout type: Megatron's rank order, every rule a layout must meet, "auto" resolved once."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest

from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import (
    Layout,
    LayoutError,
    check_layout,
    micro_batch_size,
    model_problems,
    resolve_layout,
    with_micro_batch_size,
)
from megatrain.spec import SpecError, parse_spec

BASE: dict[str, Any] = {"name": "tiny", "data": {"train": [{"path": "file:///data/corpus.jsonl"}]}}


def test_rank_order_is_tp_fastest_then_cp_dp_pp() -> None:
    d = Layout(tp=2, cp=1, dp=2, pp=2)
    assert d.world_size == 8
    assert [tuple(vars(d.coords(r)).values()) for r in range(4)] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 0, 1, 0), (1, 0, 1, 0)
    ]  # fmt: skip
    assert d.coords(5).pp == 1 and d.coords(5).tp == 1 and d.coords(5).dp == 0
    for r in range(8):
        c = d.coords(r)
        assert d.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r


def test_groups_partition_the_world() -> None:
    d = Layout(tp=2, cp=2, dp=2, pp=2)
    assert d.group_ranks("tp")[0] == [0, 1]
    assert d.group_ranks("cp")[0] == [0, 2]
    assert d.group_ranks("dp")[0] == [0, 4]
    assert d.group_ranks("pp")[0] == [0, 8]
    assert d.group_ranks("tp", "pp")[0] == [0, 1, 8, 9]
    for axes in (("tp",), ("cp",), ("dp",), ("pp",), ("tp", "pp")):
        groups = d.group_ranks(*axes)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(16)), axes
        size = 1
        for name in axes:
            size *= d.size(name)
        assert {len(g) for g in groups} == {size}
    with pytest.raises(LayoutError, match="unknown axes"):
        d.group_ranks("ep")


def test_expert_groups_are_carved_from_dp_cp_in_megatrons_order() -> None:
    # dp=4, ep=2: ep groups are neighbouring dp ranks, edp the ranks holding the same experts.
    d = Layout(dp=4, ep=2)
    assert d.expert_group_ranks("ep") == [[0, 1], [2, 3]]
    assert d.expert_group_ranks("edp") == [[0, 2], [1, 3]]
    assert [d.expert_coords(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert d.edp == 2
    # tp=2: each tp rank has its own ep groups (tp stays fastest); pp repeats them per stage.
    d = Layout(tp=2, dp=2, pp=2, ep=2)
    assert d.expert_group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.expert_group_ranks("edp") == [[0], [1], [2], [3], [4], [5], [6], [7]]
    # cp is the fastest part of the dp×cp index: ep=2 over cp=2 pairs the cp ranks first.
    d = Layout(cp=2, dp=2, ep=2)
    assert d.expert_group_ranks("ep") == [[0, 1], [2, 3]]
    assert d.expert_group_ranks("edp") == [[0, 2], [1, 3]]
    d = Layout(tp=2, cp=2, dp=2, ep=4)
    assert d.expert_group_ranks("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.edp == 1
    for layout in (Layout(dp=8, ep=4), Layout(tp=2, cp=2, dp=2, pp=2, ep=2), Layout(dp=2)):
        ep, edp = layout.expert_group_ranks("ep"), layout.expert_group_ranks("edp")
        for groups, size in ((ep, layout.ep), (edp, layout.edp)):
            assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
            assert all(len(g) == size for g in groups)
        # Expert groups stay inside one dp×cp group (same tp and pp coordinate).
        dp_cp = {r: i for i, g in enumerate(layout.group_ranks("cp", "dp")) for r in g}
        assert all(len({dp_cp[r] for r in g}) == 1 for g in ep + edp)
        # An ep group and an edp group meet in exactly one rank.
        assert all(len(set(a) & set(b)) == 1 for a in ep for b in edp if dp_cp[a[0]] == dp_cp[b[0]])
    with pytest.raises(LayoutError, match="does not divide"):
        Layout(dp=3, ep=2).expert_group_ranks("ep")
    with pytest.raises(LayoutError, match="unknown expert axis"):
        Layout().expert_group_ranks("dp")


def test_model_rules_name_every_broken_one() -> None:
    problems = model_problems(Layout(tp=4, dp=2), num_attention_heads=6, num_query_groups=2, vocab_size=258)
    messages = [p["message"] for p in problems]
    assert messages == [
        "num_attention_heads=6 is not divisible by tp=4",
        "num_query_groups=2 is not divisible by tp=4",
        "the embedding's 258 rows are not divisible by tp=4",
    ]
    [sp] = model_problems(Layout(tp=4, sequence_parallel=True), seq_length=30)
    assert "seq_length=30 is not divisible by tp=4" in sp["message"]
    [pp] = model_problems(Layout(pp=4), num_layers=6)
    assert "num_layers=6 is not divisible by pp×virtual_stages=4×1" in pp["message"]
    assert model_problems(Layout(tp=2, dp=2), num_attention_heads=4, num_query_groups=2, vocab_size=256) == []


def test_bad_degrees_and_single_process_state() -> None:
    with pytest.raises(LayoutError, match="tp=0"):
        Layout(tp=0)
    with pytest.raises(LayoutError, match="pipeline_schedule='zb'"):
        Layout(pipeline_schedule="zb")
    assert Layout(tp=1, sequence_parallel=True).sequence_parallel is False
    s = ParallelState.single()
    assert s.tp_size == s.dp_size == s.pp_size == 1 and s.tp_group is None and s.group("mp") is None
    assert ParallelState.build(Layout()).rank == 0
    with pytest.raises(LayoutError, match="needs 2 processes"):
        ParallelState.build(Layout(dp=2))


def test_round_trip_through_plain_data() -> None:
    layout = Layout(tp=2, pp=2, dp=3, virtual_stages=2, pipeline_layers=(1, 2, 2, 1))
    data = layout.as_dict()
    assert data["pipeline_layers"] == [1, 2, 2, 1]
    assert Layout.from_dict(data) == layout
    with pytest.raises(LayoutError, match="unknown layout fields"):
        Layout.from_dict({**data, "zz": 1})
    assert layout.chunk_layers(6) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert Layout(pp=2, virtual_stages=2).chunk_layers(8) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_layout_module_imports_without_torch() -> None:
    code = "import sys, megatrain.plan.layout; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# -- resolution of a spec ---------------------------------------------------------------------


def spec_with(
    parallelism: Any = "auto", gpus: int | None = None, gbs: int = 16, mbs: int | str = 4, **model: Any
) -> Any:
    return parse_spec(
        {
            "name": "p",
            "data": {"train": [{"path": "file:///d.jsonl"}]},
            "model": {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, **model},
            "training": {"global_batch_size": gbs, "micro_batch_size": mbs},
            "parallelism": parallelism,
            "resources": {"devices": gpus},
        }
    )


@pytest.mark.parametrize(
    ("parallelism", "gpus", "gbs", "mbs", "expected"),
    [
        ("auto", None, 16, 4, Layout()),
        ("auto", 4, 16, 4, Layout(dp=4)),
        ("auto", 2, 16, 8, Layout(dp=2)),
        ({"tp": 2}, None, 16, 4, Layout(tp=2)),
        ({"tp": 2}, 8, 16, 4, Layout(tp=2, dp=4)),
        ({"tp": 2, "pp": 2, "dp": "auto"}, 8, 16, 4, Layout(tp=2, pp=2, dp=2)),
        ({"tp": 2, "pp": 2, "dp": 2}, 8, 16, 4, Layout(tp=2, pp=2, dp=2)),
        ({"tp": 2, "pp": 2, "dp": 2}, None, 16, 4, Layout(tp=2, pp=2, dp=2)),
        ({"tp": 4, "sequence_parallel": True}, 4, 4, 4, Layout(tp=4, sequence_parallel=True)),
        ({"pp": 8, "dp": 1}, 8, 8, 1, Layout(pp=8)),
    ],
)
def test_resolve_layout(parallelism: Any, gpus: int | None, gbs: int, mbs: int, expected: Layout) -> None:
    layout = resolve_layout(spec_with(parallelism, gpus, gbs, mbs))
    assert layout == expected
    assert layout.world_size == expected.tp * expected.pp * expected.dp
    if gpus is not None:
        assert layout.world_size == gpus


def test_dp_auto_fills_the_world_when_the_engine_runs_on_its_own() -> None:
    assert resolve_layout(spec_with({"tp": 2}), world_size=4) == Layout(tp=2, dp=2)
    # resources.devices, when given, is what the job asked for; the world must then match it.
    assert resolve_layout(spec_with({"tp": 2}, gpus=2), world_size=4) == Layout(tp=2)
    with pytest.raises(SpecError, match="but the world has 4 processes"):
        check_layout(spec_with({"tp": 2}, gpus=2), Layout(tp=2), world_size=4)
    check_layout(spec_with({"tp": 2}, gpus=2), Layout(tp=2), world_size=2)


def test_layout_as_dict() -> None:
    assert Layout(tp=2, dp=3).as_dict() == {
        "tp": 2,
        "pp": 1,
        "dp": 3,
        "cp": 1,
        "ep": 1,
        "virtual_stages": 1,
        "sequence_parallel": False,
        "pipeline_schedule": "1f1b",
        "pipeline_layers": None,
    }


@pytest.mark.parametrize(
    ("parallelism", "gpus", "gbs", "mbs", "field", "text"),
    [
        (
            {"tp": 2, "pp": 2},
            6,
            16,
            4,
            "resources.devices",
            "resources.devices=6 is not divisible by tp×pp×cp=2×2×1",
        ),
        ({"tp": 4}, 2, 16, 4, "resources.devices", "not divisible"),
        ({"tp": 2, "dp": 2}, 8, 16, 4, "resources.devices", "resources.devices=8 does not equal tp×pp×cp×dp"),
        ({"dp": 4}, 2, 16, 4, "resources.devices", "does not equal"),
        ("auto", 3, 16, 4, "training.global_batch_size", "micro_batch_size×dp=4×3"),
        ("auto", 8, 16, 4, "training.global_batch_size", "training.global_batch_size=16 is not divisible"),
        ({"tp": 2, "dp": 3}, None, 10, 2, "training.global_batch_size", "micro_batch_size×dp=2×3"),
        # 24 / (4×1) = 6 micro-batches cannot enter a 4-stage interleaved pipeline in groups of 4.
        ({"pp": 4, "virtual_stages": 2, "dp": 1}, None, 24, 4, "parallelism.virtual_stages", "= 6, divisib"),
    ],
)
def test_resolve_layout_errors_name_the_field(
    parallelism: Any, gpus: int | None, gbs: int, mbs: int, field: str, text: str
) -> None:
    with pytest.raises(SpecError) as info:
        resolve_layout(spec_with(parallelism, gpus, gbs, mbs))
    assert [e["field"] for e in info.value.errors] == [field]
    assert text in info.value.errors[0]["message"]


LANES = {"moe_overlap_microbatches": True}
FLAG = "parallelism.moe_overlap_microbatches"
MOE = {"moe": {"num_experts": 4, "router_topk": 2}}


@pytest.mark.parametrize(
    ("parallelism", "gbs", "mbs", "model", "field", "text"),
    [
        ({"dp": 2, **LANES}, 16, 4, {}, FLAG, "but the model has no model.moe"),
        ({"dp": 2, **LANES}, 16, 4, MOE, FLAG, "but parallelism.ep is 1"),
        ({"dp": 2, "pp": 2, "ep": 2, "pipeline_schedule": "zb-h1", **LANES}, 16, 4, MOE, FLAG,
         "with parallelism.pp > 1 it needs pipeline_schedule 1f1b (not zb-h1) and virtual_stages 1"),
        ({"dp": 2, "ep": 2, **LANES}, 8, 4, MOE, "training.global_batch_size",
         "needs 2 or more micro-batches per step on each rank (pp + 1, for a forward beside a "
         "backward); training.global_batch_size / (micro_batch_size × dp) is 1"),
        ({"dp": 2, "pp": 2, "ep": 2, **LANES}, 16, 4, MOE, "training.global_batch_size",
         "needs 3 or more micro-batches"),
        ({"dp": 2, "ep": 2, **LANES}, 16, 4, {**MOE, "hidden_dropout": 0.1}, "model.hidden_dropout",
         "parallelism.moe_overlap_microbatches needs model.hidden_dropout 0 (not 0.1)"),
    ],
)  # fmt: skip
def test_two_microbatches_in_flight_need_experts_apart_no_pipeline_and_no_dropout(
    parallelism: dict[str, Any], gbs: int, mbs: int, model: dict[str, Any], field: str, text: str
) -> None:
    with pytest.raises(SpecError) as info:
        resolve_layout(spec_with(parallelism, None, gbs, mbs, **model))
    assert [e["field"] for e in info.value.errors] == [field]
    assert text in info.value.errors[0]["message"]
    for pp in (1, 2):  # 4 micro-batches per rank: enough for lanes at pp 1 and 2
        fine = {**parallelism, "pp": pp, "ep": 2, "pipeline_schedule": "1f1b"}
        layout = resolve_layout(spec_with(fine, None, 32, 4, **MOE))
        assert (layout.dp, layout.ep, layout.pp) == (2, 2, pp)


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """BASE with the dotted `path` set to `value`."""
    spec = copy.deepcopy(base or BASE)
    cur: Any = spec
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value
    return spec


def layout_errors_of(data: dict[str, Any]) -> list[dict[str, str]]:
    spec = parse_spec(data)  # a valid spec on its own: the layout is what breaks a rule
    with pytest.raises(SpecError) as info:
        resolve_layout(spec)
    return info.value.errors


# (spec changes, field the error must name, text the message must contain)
RULES: list[tuple[dict[str, Any], str, str]] = [
    (with_("parallelism", {"tp": 3}), "model.num_attention_heads", "not divisible by parallelism.tp=3"),
    (with_("parallelism", {"pp": 8}), "parallelism.pp", "exceeds model.num_layers=4"),
    (with_("parallelism", {"virtual_stages": 2}), "parallelism.virtual_stages", "needs parallelism.pp > 1"),
    (
        with_("parallelism", {"pp": 2, "virtual_stages": 4}),
        "model.num_layers",
        "pipeline_layers for an uneven",
    ),
    (with_("parallelism", {"pp": 2, "pipeline_layers": [1, 2]}), "parallelism.pipeline_layers", "sums to 3"),
    (
        with_("parallelism", {"pp": 2, "pipeline_layers": [4]}),
        "parallelism.pipeline_layers",
        "entries, not 1",
    ),
    (
        {**BASE, "model": {"num_attention_heads": 8, "num_query_groups": 2}, "parallelism": {"tp": 4}},
        "model.num_query_groups",
        "model.num_query_groups=2 is not divisible by parallelism.tp=4",
    ),
    (
        {**BASE, "model": {"ffn_hidden_size": 1001}, "parallelism": {"tp": 2}},
        "model.ffn_hidden_size",
        "model.ffn_hidden_size=1001 is not divisible by parallelism.tp=2",
    ),
    (
        {**BASE, "model": {"seq_length": 250}, "parallelism": {"tp": 4, "sequence_parallel": True}},
        "model.seq_length",
        "sequence parallelism",
    ),
    (
        {
            **BASE,
            "model": {
                "hidden_size": 384,
                "num_attention_heads": 6,
                "ffn_hidden_size": 1536,
                "vocab_size": 1001,
            },
            "parallelism": {"tp": 3},
        },
        "model.vocab_size",
        "the embedding's 1024 rows are not divisible by parallelism.tp=3",
    ),
    (with_("parallelism", {"cp": 3}), "model.seq_length", "not divisible by 2×parallelism.cp=6"),
    (with_("parallelism", {"ep": 2, "dp": 2}), "parallelism.ep", "needs model.moe"),
    (with_("parallelism", {"ep": 4, "dp": 2}), "parallelism.ep", "does not divide dp×cp=2×1"),
    (
        {**BASE, "model": {"moe": {"num_experts": 6}}, "parallelism": {"ep": 4, "dp": 4}},
        "model.moe.num_experts",
        "model.moe.num_experts=6 is not divisible by parallelism.ep=4",
    ),
]


@pytest.mark.parametrize(("data", "field", "text"), RULES, ids=[r[1] + ":" + r[2][:30] for r in RULES])
def test_each_layout_rule_names_its_field(data: dict[str, Any], field: str, text: str) -> None:
    errors = layout_errors_of(data)
    # The first problem is the rule under test; tp=3 also breaks the other tp rules, all reported.
    assert errors[0]["field"] == field, errors
    assert text in errors[0]["message"]


def test_every_broken_rule_is_reported_at_once() -> None:
    data = {
        **BASE,
        "model": {"num_attention_heads": 6, "hidden_size": 192, "seq_length": 250},
        "parallelism": {"tp": 4, "sequence_parallel": True},
        "training": {"global_batch_size": 9, "micro_batch_size": 3},
        "resources": {"devices": 8},
    }
    fields = [e["field"] for e in layout_errors_of(data)]
    assert fields == ["model.num_attention_heads", "model.num_query_groups", "model.seq_length",
                      "training.global_batch_size"]  # fmt: skip


def test_the_same_values_pass_when_the_rule_is_met() -> None:
    ok = parse_spec(
        {
            **BASE,
            "model": {"num_query_groups": 4, "seq_length": 248},
            "parallelism": {"tp": 4, "pp": 2, "dp": 2, "sequence_parallel": True},
        }
    )
    assert resolve_layout(ok) == Layout(tp=4, pp=2, dp=2, sequence_parallel=True)


def test_an_auto_micro_batch_size_no_planner_chose_is_the_largest_up_to_4() -> None:
    auto = spec_with({"dp": 2}, gbs=16, mbs="auto")
    assert micro_batch_size(auto, Layout(dp=2)) == 4  # 8 per rank
    assert micro_batch_size(spec_with({"dp": 2}, gbs=6, mbs="auto"), Layout(dp=2)) == 3
    # Interleaved: 8 per rank in micro-batches of 4 is 2, not a multiple of pp=4; of 2, it is 4.
    interleaved = Layout(pp=4, virtual_stages=2)
    assert micro_batch_size(spec_with({"pp": 4, "virtual_stages": 2}, gbs=8, mbs="auto"), interleaved) == 2
    resolved = with_micro_batch_size(auto, layout=Layout(dp=2))
    assert resolved.training.micro_batch_size == 4 and auto.training.micro_batch_size == "auto"
    assert with_micro_batch_size(auto, 8).training.micro_batch_size == 8  # a planner's choice
    written = spec_with({"dp": 2}, gbs=16, mbs=2)
    assert with_micro_batch_size(written, 8) is written  # a number written is kept
    assert resolve_layout(auto) == Layout(dp=2)
