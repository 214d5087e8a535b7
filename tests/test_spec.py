"""JobSpec validation: every rule, the field each error names, YAML/JSON loading, schema, round trip."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from megatrain.spec import (
    JobSpec,
    ParallelismSpec,
    SpecError,
    dump_spec,
    load_spec,
    parse_spec,
    spec_json_schema,
)

BASE: dict[str, Any] = {"name": "tiny", "data": {"train": [{"path": "file:///data/corpus.jsonl"}]}}


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """BASE with the dotted `path` set to `value` (list indices as digits)."""
    spec = copy.deepcopy(base or BASE)
    cur: Any = spec
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur.setdefault(k, {})
    cur[keys[-1]] = value
    return spec


def errors_of(spec: Any) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert str(info.value)  # the exception text lists the errors too
    return info.value.errors


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = parse_spec(BASE)
    assert spec.kind == "pretrain" and spec.parallelism == "auto"
    assert spec.model.arch == "llama" and spec.model.query_groups == spec.model.num_attention_heads
    assert spec.model.head_dim == 256 // 8
    assert spec.model.ffn_size == 704  # 8/3·256 = 682.67, rounded up to a multiple of 64
    assert spec.model.tied is False
    assert parse_spec(with_("model.arch", "gpt2")).model.ffn_size == 1024
    assert parse_spec(with_("model.arch", "gpt2")).model.tied is True
    assert spec.data.tokenizer.type == "byte" and spec.data.split_fractions == (0.98, 0.02, 0.0)
    assert spec.resources.pool == "default" and spec.resources.devices is None


# (dotted path to change, new value, field the error must name, text the message must contain)
RULES: list[tuple[str, Any, str, str]] = [
    ("name", "bad name!", "name", "pattern"),
    ("name", "", "name", "pattern"),
    ("name", "x" * 101, "name", "pattern"),
    ("kind", "distill", "kind", "pretrain"),
    ("kind", "finetune", "model.init_from", "required when kind is 'finetune'"),
    ("model.arch", "roberta", "model.arch", "llama"),
    ("model.num_layers", 0, "model.num_layers", "greater than or equal to 1"),
    ("model.num_layers", 10**30, "model.num_layers", "less than or equal"),
    ("model.hidden_size", 250, "model.hidden_size", "not divisible by model.num_attention_heads=8"),
    ("model.num_query_groups", 3, "model.num_attention_heads", "model.num_query_groups=3"),
    ("model.num_experts", 2, "model.num_experts", "unknown field; did you mean moe.num_experts?"),
    ("training.trainiters", 5, "training.trainiters", "unknown field; did you mean train_iters?"),
    ("tp", 2, "tp", "unknown field; did you mean parallelism.tp?"),
    ("data.train.0.wieght", 2, "data.train.0.wieght", "unknown field; did you mean weight?"),
    ("model.moe", {"num_experts": 1}, "model.moe.num_experts", "greater than or equal to 2"),
    ("model.moe", {"num_experts": 4, "router_topk": 5}, "model.moe.router_topk", "exceeds"),
    (
        "model.moe",
        {"num_experts": 6, "router_num_groups": 4, "router_group_topk": 2},
        "model.moe.router_num_groups",
        "not divisible",
    ),
    ("model.moe", {"num_experts": 8, "router_num_groups": 4}, "model.moe.router_group_topk", "go together"),
    ("model.moe", {"num_experts": 4, "shared_expert_gate": True}, "model.moe.shared_expert_gate", "a shared"),
    (
        "model.moe",
        {"num_experts": 4, "router_score_function": "sigmoid", "router_pre_softmax": True},
        "model.moe.router_pre_softmax",
        "softmax",
    ),
    ("model.init_from", "hf:gpt2", "model.init_from", "checkpoint:JOB_ID"),
    ("model.hidden_dropout", 1.0, "model.hidden_dropout", "less than 1"),
    ("model.norm_eps", 0, "model.norm_eps", "greater than 0"),
    ("model.seq_length", "long", "model.seq_length", "valid integer"),
    ("model.flash", True, "model.flash", "unknown field"),
    ("data.tokenizer", {"type": "hf"}, "data.tokenizer.path", "required"),
    ("data.tokenizer", {"type": "byte", "path": "t.json"}, "data.tokenizer.path", "must be empty"),
    ("data.tokenizer", {"type": "sentencepiece"}, "data.tokenizer.path", "required"),
    ("data.tokenizer", {"type": "wordpiece"}, "data.tokenizer.type", "byte"),
    ("data.tokenizer", {"type": "tiktoken"}, "data.tokenizer.name", "required"),
    ("data.tokenizer", "hf", "data.tokenizer", "must be byte, hf:PATH"),
    ("data.train", [{"weight": 2}], "data.train.0", "a path or a dataset name"),
    ("data.train", [], "data.train", "at least 1 item"),
    ("data.train", [{"path": "", "weight": 1}], "data.train.0.path", "at least 1 character"),
    ("data.train.0.weight", 0, "data.train.0.weight", "greater than 0"),
    ("data.split", "a,b,c", "data.split", "comma-separated numbers"),
    ("data.split", "98,2", "data.split", "3 non-negative parts"),
    ("data.split", "0,1,1", "data.split", "positive train part"),
    ("data.split", "98,-2,4", "data.split", "non-negative"),
    ("training.global_batch_size", 10, "training.global_batch_size", "training.micro_batch_size=4"),
    ("training.micro_batch_size", 0, "training.micro_batch_size", "'auto' or an integer in [1, 1048576]"),
    ("training.micro_batch_size", "some", "training.micro_batch_size", "'auto' or an integer"),
    ("training.warmup_iters", 1000, "training.warmup_iters", "exceeds training.train_iters=200"),
    ("training.min_lr", 1.0, "training.min_lr", "exceeds training.lr"),
    ("training.lr", 0, "training.lr", "greater than 0"),
    ("training.precision", "fp4", "training.precision", "fp8"),
    ("training.fp8_recipe", "blockwise", "training.fp8_recipe", "rowwise"),
    ("training.recompute", "some", "training.recompute", "selective"),
    ("training.lr_schedule", "step", "training.lr_schedule", "cosine"),
    ("training.adam_beta2", 1.0, "training.adam_beta2", "less than 1"),
    ("training.seed", -1, "training.seed", "greater than or equal to 0"),
    ("training.log_interval", 0, "training.log_interval", "greater than or equal to 1"),
    ("parallelism", {"tp": 0}, "parallelism.tp", "greater than or equal to 1"),
    ("parallelism", {"dp": 0}, "parallelism.dp", "'auto' or an integer"),
    ("parallelism", {"dp": "many"}, "parallelism.dp", "'auto' or an integer"),
    ("parallelism", {"dp": True}, "parallelism.dp", "'auto' or an integer"),
    ("parallelism", {"cp": 2000}, "parallelism.cp", "less than or equal to 1024"),
    ("parallelism", {"virtual_stages": 65}, "parallelism.virtual_stages", "less than or equal to 64"),
    ("parallelism", {"moe_overlap_chunks": 9}, "parallelism.moe_overlap_chunks", "less than or equal to 8"),
    ("parallelism", {"moe_dispatch": "everywhere"}, "parallelism.moe_dispatch", "'pairs' or 'nodes'"),
    (
        "parallelism",
        {"pp": 2, "pipeline_layers": [5, -1]},
        "parallelism.pipeline_layers.1",
        "greater than or equal to 0",
    ),
    ("parallelism", {"pipeline_schedule": "zb"}, "parallelism.pipeline_schedule", "'1f1b'"),
    ("parallelism", {"tensor": 2}, "parallelism.tensor", "unknown field"),
    ("parallelism", "manual", "parallelism", "'auto'"),
    ("resources.pool", "a b", "resources.pool", "pattern"),
    ("resources.devices", 0, "resources.devices", "greater than or equal to 1"),
    ("resources.priority", 5000, "resources.priority", "less than or equal to 1000"),
    ("resources.max_runtime_s", 0, "resources.max_runtime_s", "greater than or equal to 1"),
    ("resources.max_retries", -1, "resources.max_retries", "greater than or equal to 0"),
    ("queue", "fast", "queue", "unknown field"),  # nothing near it: no guess
]


@pytest.mark.parametrize(
    ("path", "value", "field", "text"), RULES, ids=[f"{r[0]}={r[1]!r}"[:60] for r in RULES]
)
def test_each_rule_names_its_field(path: str, value: Any, field: str, text: str) -> None:
    errors = errors_of(with_(path, value))
    assert [e["field"] for e in errors] == [field] * len(errors), errors
    assert any(text in e["message"] for e in errors), errors


# Rules that need two fields changed together.
CROSS_RULES: list[tuple[dict[str, Any], str, str]] = [
    (
        {"kind": "finetune", "model": {"init_from": None}},
        "model.init_from",
        "required when kind is 'finetune'",
    ),
    (
        {"model": {"activation": "geglu", "moe": {"num_experts": 4}}},
        "model.activation",
        "geglu is for dense models",
    ),
]


@pytest.mark.parametrize(("changes", "field", "text"), CROSS_RULES)
def test_cross_field_rules(changes: dict[str, Any], field: str, text: str) -> None:
    errors = errors_of({**copy.deepcopy(BASE), **changes})
    assert errors == [{"field": field, "message": errors[0]["message"]}]
    assert text in errors[0]["message"]


def test_the_same_values_pass_when_the_rule_is_met() -> None:
    # Guards against rules that refuse everything: each cross rule's fixed-up twin validates.
    ok = parse_spec(
        {
            **BASE,
            "kind": "finetune",
            "model": {"num_query_groups": 4, "seq_length": 248, "init_from": "checkpoint:17@100"},
            "parallelism": {"tp": 4, "pp": 2, "dp": 2, "sequence_parallel": True},
        }
    )
    assert isinstance(ok.parallelism, ParallelismSpec) and ok.parallelism.dp == 2
    assert parse_spec(with_("parallelism", {"dp": "3"})).parallelism.dp == 3  # type: ignore[union-attr]
    assert parse_spec(with_("model.activation", "geglu")).model.mlp_activation == "geglu"  # dense: allowed
    assert parse_spec(with_("parallelism", {"dp": "auto"})).parallelism.dp == "auto"  # type: ignore[union-attr]


def test_several_errors_are_all_reported() -> None:
    spec = with_("model.num_layers", 0, with_("training.lr", -1, with_("resources.devices", 0)))
    fields = sorted(e["field"] for e in errors_of(spec))
    assert fields == ["model.num_layers", "resources.devices", "training.lr"]


def test_field_errors_do_not_hide_the_rules_between_fields() -> None:
    # Pydantic runs a section's cross-field rules only once its fields are valid; parse_spec does
    # not stop there: the bad value is dropped and the rest judged.
    spec = with_("model", {"num_layers": 0, "hidden_size": 250, "num_attention_heads": 8,
                           "num_query_groups": 3})  # fmt: skip
    spec = with_("name", "not a name", with_("kind", "finetune", spec))
    assert [e["field"] for e in errors_of(spec)] == [
        "name",
        "model.num_layers",
        "model.hidden_size",
        "model.num_attention_heads",
        "model.init_from",
    ]


def test_every_broken_rule_of_a_section() -> None:
    spec = with_("training", {"global_batch_size": 10, "micro_batch_size": 4, "warmup_iters": 300,
                              "min_lr": 1.0, "lr": 0.1})  # fmt: skip
    spec = with_("data.tokenizer", {"type": "byte", "name": "gpt2"}, spec)
    spec = with_("data.train", [{"weight": 2}, {"path": "file:///x.jsonl"}, {}], spec)
    assert [e["field"] for e in errors_of(spec)] == [
        "data.tokenizer.name",
        "data.train.0",
        "data.train.2",
        "training.global_batch_size",
        "training.warmup_iters",
        "training.min_lr",
    ]


def test_no_error_about_a_value_that_stands_in() -> None:
    # hidden_size 'x' gives way to its default 256, which 12 heads do not divide: not the user's error.
    errors = errors_of(with_("model", {"hidden_size": "x", "num_attention_heads": 12}))
    assert [e["field"] for e in errors] == ["model.hidden_size"]
    # 0 heads give way to 8; 250 % 8 names num_attention_heads in its message: left out too.
    assert [
        e["field"] for e in errors_of(with_("model", {"hidden_size": 250, "num_attention_heads": 0}))
    ] == ["model.num_attention_heads"]
    # A bad rope_scaling part drops the whole (required parts can't take defaults): one error each.
    errors = errors_of(with_("model.rope_scaling", {"type": "llama3", "factor": -1}))
    assert [e["field"] for e in errors] == ["model.rope_scaling.factor"], errors


def test_a_plain_model_validate_still_stops_at_the_first_rule() -> None:
    # Outside parse_spec a built model is always a valid one (the engine and assignments rely on it).
    bad = with_("training", {"global_batch_size": 10, "micro_batch_size": 4, "warmup_iters": 300})
    with pytest.raises(ValidationError) as ei:
        JobSpec.model_validate(bad)
    assert len(ei.value.errors()) == 1 and "global_batch_size=10" in str(ei.value)


def test_required_and_non_mapping() -> None:
    assert errors_of({"name": "x"}) == [{"field": "data", "message": "Field required"}]
    assert errors_of({"data": BASE["data"]})[0]["field"] == "name"
    for bad in ([1, 2], "name: x", None, 3):
        assert errors_of(bad) == [
            {"field": "spec", "message": "a job spec must be a mapping (YAML or JSON object)"}
        ]


def test_validate_assignment_keeps_the_tree_valid() -> None:
    spec = parse_spec(BASE)
    with pytest.raises(ValueError):
        spec.training.micro_batch_size = 0


# --- loading, schema, round trip --------------------------------------------------------------

YAML_SPEC = """\
name: llama-tiny-pretrain
kind: pretrain
model:
  arch: llama
  num_layers: 4
  hidden_size: 256
  num_attention_heads: 8
  num_query_groups: 4
  seq_length: 128
data:
  tokenizer: {type: byte}
  train:
    - {path: "file:///data/a.jsonl.gz", weight: 2}
    - {path: "s3://bucket/b.jsonl"}
  split: 98,2,0     # unquoted: YAML reads it as a string
training:
  train_iters: 200
  global_batch_size: 16
  micro_batch_size: 4
  lr: 3e-4          # PyYAML reads this as a string; pydantic still takes it as a float
  warmup_iters: 20
  precision: bf16
parallelism: {tp: 2, pp: 1, dp: auto}
resources: {pool: default, devices: 4}
"""


def test_load_yaml(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(YAML_SPEC)
    spec = load_spec(path)
    assert spec.name == "llama-tiny-pretrain"
    assert spec.training.lr == pytest.approx(3e-4)
    assert spec.data.split == "98,2,0"
    assert [s.weight for s in spec.data.train] == [2.0, 1.0]
    assert isinstance(spec.parallelism, ParallelismSpec) and spec.parallelism.tp == 2
    assert spec.resources.devices == 4


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(yaml.safe_load(YAML_SPEC)))
    assert load_spec(path) == load_spec_text(tmp_path, YAML_SPEC)


def load_spec_text(tmp_path: Path, text: str) -> JobSpec:
    path = tmp_path / "other.yaml"
    path.write_text(text)
    return load_spec(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: [unclosed", "not valid YAML/JSON"),
        ('{"name": "x",', "not valid YAML/JSON"),
        ("- a\n- b\n", "must be a mapping"),
        ("", "must be a mapping"),
    ],
)
def test_load_refuses_bad_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec_text(tmp_path, text)
    assert info.value.errors[0]["field"] == "spec"
    assert message in info.value.errors[0]["message"]


def test_load_reports_field_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec_text(tmp_path, YAML_SPEC.replace("num_attention_heads: 8", "num_attention_heads: 6"))
    assert info.value.errors[0]["field"] == "model.hidden_size"


def test_json_schema_export() -> None:
    schema = spec_json_schema()
    json.dumps(schema)  # serialisable as is (served by the API, used by editors)
    assert set(schema["required"]) == {"name", "data"}
    assert set(schema["properties"]) == set(JobSpec.model_fields)
    assert schema["additionalProperties"] is False
    par = json.dumps(schema["properties"]["parallelism"])
    assert "auto" in par and "ParallelismSpec" in par
    model = schema["$defs"]["ModelSpec"]["properties"]
    assert model["num_layers"]["minimum"] == 1 and model["arch"]["enum"] == ["gpt2", "llama", "bert", "t5"]


@pytest.mark.parametrize(
    "raw",
    [
        BASE,
        yaml.safe_load(YAML_SPEC),
        {**BASE, "kind": "finetune", "model": {"init_from": "checkpoint:3"}, "parallelism": {"dp": 2}},
    ],
)
def test_round_trip_through_json(raw: dict[str, Any]) -> None:
    spec = parse_spec(raw)
    text = dump_spec(spec)
    again = parse_spec(json.loads(text))
    assert again == spec
    assert dump_spec(again) == text  # stable, so it can be stored and compared


BERT = {
    **copy.deepcopy(BASE),
    "model": {"arch": "bert"},
    "data": {
        "train": [{"path": "file:///data/corpus.jsonl"}],
        "tokenizer": {"type": "hf", "path": "/t.json"},
    },
}
# (changes to a valid BERT spec, the one field its error names, text the message must contain)
FAMILY_RULES: list[tuple[dict[str, Any], str, str]] = [
    ({"data": {**BERT["data"], "tokenizer": {"type": "byte"}}}, "data.tokenizer", "WordPiece"),
    ({"kind": "dpo", "model": {"arch": "bert", "init_from": "hf:/models/bert"}}, "kind", "needs a decoder"),
    (
        {
            "kind": "eval",
            "model": {"arch": "bert", "init_from": "hf:/models/bert"},
            "eval": {"tasks": ["x"]},
            "data": {"tokenizer": {"type": "hf", "path": "/t.json"}},
        },
        "kind",
        "needs a decoder",
    ),  # fmt: skip
    ({"training": {"method": "lora"}}, "training.method", "trains in full"),
    ({"data": {**BERT["data"], "packing": True}}, "data.packing", "sentence-pair"),
    ({"training": {"eval_tasks": ["file:///t.yaml"]}}, "training.eval_tasks", "lm-eval"),
    ({"model": {"arch": "bert", "moe": {"num_experts": 4}}}, "model.moe", "not available for arch bert"),
    ({"model": {"arch": "bert", "activation": "swiglu"}}, "model.activation", "GELU"),
    ({"model": {"arch": "llama", "bert": {"binary_head": False}}}, "model.bert", "only for arch bert"),
    ({"model": {"arch": "bert", "t5": {}}}, "model.t5", "only for arch t5"),
]


def test_a_bert_spec_takes_the_arch_s_defaults() -> None:
    spec = parse_spec(BERT)
    m = spec.model
    assert m.ffn_size == 4 * m.hidden_size and m.mlp_activation == "gelu" and m.tied
    assert m.bert_block.binary_head and not m.bert_block.post_layernorm and m.bert_block.num_tokentypes == 2


@pytest.mark.parametrize(("changes", "field", "text"), FAMILY_RULES)
def test_family_rules_name_their_field(changes: dict[str, Any], field: str, text: str) -> None:
    errors = errors_of({**copy.deepcopy(BERT), **changes})
    assert [e["field"] for e in errors] == [field], errors
    assert text in errors[0]["message"], errors


T5 = {
    **copy.deepcopy(BASE),
    "model": {"arch": "t5", "num_layers": 2},
    "data": {
        "train": [{"path": "file:///data/corpus.jsonl"}],
        "tokenizer": {"type": "hf", "path": "/t.json"},
    },
}
# (changes to a valid T5 spec, the one field its error names, text the message must contain)
T5_RULES: list[tuple[dict[str, Any], str, str]] = [
    ({"data": {**T5["data"], "tokenizer": {"type": "byte"}}}, "data.tokenizer", "sentinels"),
    ({"kind": "dpo", "model": {"arch": "t5", "init_from": "hf:/models/t5"}}, "kind", "needs a decoder"),
    (
        {
            "kind": "serve",
            "model": {"arch": "t5", "init_from": "hf:/models/t5"},
            "data": {"tokenizer": "hf:/t.json"},
        },
        "kind",
        "decoder",
    ),  # fmt: skip
    ({"training": {"method": "lora"}}, "training.method", "trains in full"),
    ({"data": {**T5["data"], "packing": True}}, "data.packing", "one input/target pair"),
    ({"training": {"eval_tasks": ["file:///t.yaml"]}}, "training.eval_tasks", "lm-eval"),
    ({"training": {"compile": True}}, "training.compile", "not available for arch t5"),
    ({"model": {"arch": "t5", "attention_backend": "flex"}}, "model.attention_backend", "SDPA"),
    ({"model": {"arch": "t5", "moe": {"num_experts": 4}}}, "model.moe", "not available for arch t5"),
    ({"model": {"arch": "t5", "activation": "gelu"}}, "model.activation", "model.t5.feed_forward"),
    ({"parallelism": {"pp": 2, "cp": 2, "dp": 1}}, "parallelism.cp", "model.arch t5"),
    ({"parallelism": {"pp": 2, "virtual_stages": 2, "dp": 1}}, "parallelism.virtual_stages", "model.arch t5"),
    ({"parallelism": {"pp": 2, "pipeline_split_rank": 2, "dp": 1}}, "parallelism.pipeline_split_rank", "[1,"),
    ({"parallelism": {"pipeline_split_rank": 1}}, "parallelism.pipeline_split_rank", "pp > 1"),
    (
        {"parallelism": {"pp": 4, "pipeline_split_rank": 3, "dp": 1}},
        "parallelism.pipeline_split_rank",
        "every stage needs a layer",
    ),  # fmt: skip
    (
        {"parallelism": {"pp": 2, "pipeline_split_rank": 1, "pipeline_layers": [1, 3], "dp": 1}},
        "parallelism.pipeline_layers",
        "boundary",
    ),  # fmt: skip
]


def test_a_t5_spec_trains_and_takes_the_arch_s_defaults() -> None:
    """arch t5 pretrains and fine-tunes (no "not wired" refusal): gated GELU, an untied head."""
    spec = parse_spec(T5)
    m = spec.model
    assert m.mlp_activation == "geglu" and not m.tied and m.t5_block.decoder_seq_length is None
    assert (
        parse_spec({**T5, "kind": "finetune", "model": {**T5["model"], "init_from": "hf:/models/t5"}}).kind
        == "finetune"
    )
    for mode in ("full", "selective"):  # recompute runs on T5's layers (models.t5_layers)
        training = {"recompute": mode, "recompute_every": 2}
        assert parse_spec({**T5, "training": training}).training.recompute == mode
    assert parse_spec({**T5, "training": {"precision": "fp8"}}).training.precision == "fp8"


@pytest.mark.parametrize(("changes", "field", "text"), T5_RULES)
def test_t5_rules_name_their_field(changes: dict[str, Any], field: str, text: str) -> None:
    from megatrain.plan.layout import resolve_layout

    raw = {**copy.deepcopy(T5), **changes}
    if "parallelism" in changes:  # a layout rule: the spec itself is valid, its layout is not
        with pytest.raises(SpecError) as info:
            resolve_layout(parse_spec(raw))
        errors = info.value.errors
    else:
        errors = errors_of(raw)
    assert [e["field"] for e in errors] == [field], errors
    assert text in errors[0]["message"], errors


def test_pipeline_split_rank_is_for_t5() -> None:
    from megatrain.plan.layout import resolve_layout

    raw = {**copy.deepcopy(BASE), "parallelism": {"pp": 2, "pipeline_split_rank": 1, "dp": 1}}
    with pytest.raises(SpecError) as info:
        resolve_layout(parse_spec(raw))
    assert [e["field"] for e in info.value.errors] == ["parallelism.pipeline_split_rank"]
    assert "only for model.arch t5" in info.value.errors[0]["message"]


def test_pipeline_split_rank_becomes_the_layouts_pipeline_layers() -> None:
    """The encoder's layers over the stages before the split, the decoder's over the rest; without
    it, the layout's own boundary (pp // 2 for stacks of equal depth)."""
    from megatrain.plan.layout import resolve_layout
    from megatrain.plan.split_rank import layout_split_rank

    def layout(**par: Any) -> Any:
        return resolve_layout(parse_spec({**copy.deepcopy(T5), "parallelism": {"dp": 1, **par}}))

    lay = layout(pp=3, pipeline_split_rank=2)
    assert lay.pipeline_layers == (1, 1, 2) and layout_split_rank(2, 2, lay) == 2
    lay = layout(pp=3, pipeline_split_rank=1)
    assert lay.pipeline_layers == (2, 1, 1) and layout_split_rank(2, 2, lay) == 1
    assert layout(pp=2).pipeline_layers is None and layout_split_rank(2, 2, layout(pp=2)) == 1
    assert layout_split_rank(2, 2, layout(pp=1)) is None
