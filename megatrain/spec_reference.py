"""The JobSpec reference, generated from the pydantic models in megatrain/spec.py.

Every field's dotted name, type, default, bounds and docstring come from the models themselves, so
the reference cannot drift from what the API accepts; the rules *between* fields live in RULES,
each with a spec that breaks it (tests/test_spec_reference.py checks that each really fails on its
field). `python -m megatrain.spec_reference > docs/spec-reference.md` regenerates the committed
copy; the API serves a fresh one at GET /v1/spec/reference. Torch-free.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, Literal, Union

import annotated_types as at
from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from megatrain.spec import JobSpec, SpecError, parse_spec

REGENERATE = "python -m megatrain.spec_reference > docs/spec-reference.md"


# -- the model tree ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldDoc:
    name: str
    """Dotted path from the spec's root (`model.rope_scaling.factor`; list items as `data.train[]`)."""
    type: str
    default: str
    bounds: str
    doc: str
    aliases: tuple[str, ...] = ()


@dataclass
class Section:
    path: str
    """Dotted path of the object ('' for the top level)."""
    model: type[BaseModel]
    fields: list[FieldDoc] = field(default_factory=list)


# Fields whose spec.py declaration has no docstring yet (tests/test_spec_reference.py fails once
# one gains a docstring, so that this table only ever shrinks: spec.py owns the truth).
MISSING_DOCSTRINGS: dict[str, str] = {
    "name": "The job's name: letters, digits, `.`, `_`, `-` (not unique; jobs are known by their id).",
    "kind": "pretrain: next-token loss on every token. finetune: loss on responses / assistant turns "
    "only, starting from model.init_from (required). dpo: preference training on {prompt | messages, "
    "chosen, rejected} records (training.dpo), from model.init_from (required), which is also the "
    "reference. serve: the model server behind /openai/v1/chat/completions (the API submits it): "
    "holds model.init_from, answers with it and the LoRA adapters trained on it; reads no data.",
    "model": "The network: its architecture and shape, and the weights it starts from.",
    "data": "What the job trains on, and how text becomes tokens.",
    "training": "Steps, batch sizes, optimizer, precision, checkpoints, logging and evaluation.",
    "parallelism": "How the model is split over processes: auto, or the degrees and their options.",
    "resources": "Where the job runs, on how many processes, for how long, how urgently.",
    "data.tokenizer": "An object as below, or the shorthand string byte, hf:URL, tiktoken:NAME or "
    "sentencepiece:URL.",
    "data.train": "One or more sources, sampled in proportion to their weights (none for kind serve).",
    "model.num_layers": "Transformer layers.",
    "model.hidden_size": "Width of the residual stream; divisible by num_attention_heads.",
    "model.num_attention_heads": "Query heads; head size is hidden_size / num_attention_heads.",
    "model.seq_length": "Tokens per sample (the context length trained on).",
    "model.hidden_dropout": "Dropout after attention and MLP outputs.",
    "model.attention_dropout": "Dropout on attention probabilities.",
    "model.norm_eps": "Epsilon of LayerNorm / RMSNorm.",
    "model.rope_theta": "RoPE base frequency (llama).",
    "model.init_method_std": "Standard deviation of the normal initialisation of weights.",
    "model.rope_scaling.factor": "How much the context is stretched (e.g. 8.0 in Llama 3.1).",
    "data.tokenizer.path": "hf: a tokenizer.json; sentencepiece: a .model file; tiktoken: an optional "
    ".tiktoken ranks file. A URL (file:///abs/path or s3://bucket/key).",
    "data.train[].weight": "Relative sampling weight of this source when several are blended.",
    "data.valid[].weight": "Relative sampling weight of this held-out source in the validation blend.",
    "training.train_iters": "Optimizer steps to train for.",
    "training.global_batch_size": "Samples per optimizer step, over all data-parallel ranks.",
    "training.lr": "Peak learning rate, reached at the end of warmup.",
    "training.min_lr": "Learning rate at the end of the decay.",
    "training.lr_schedule": "Decay from lr to min_lr after warmup, over the remaining steps.",
    "training.warmup_iters": "Steps of linear warmup from 0 to lr.",
    "training.weight_decay": "AdamW weight decay.",
    "training.adam_beta1": "AdamW β1.",
    "training.adam_beta2": "AdamW β2.",
    "training.adam_eps": "AdamW ε.",
    "training.min_loss_scale": "fp16 only: the dynamic loss scale never drops below this.",
    "training.log_interval": "Report loss, throughput and memory every N steps.",
    "training.eval_iters": "Validation batches per evaluation.",
    "training.seed": "Seeds initialisation, data order and dropout: equal seeds, equal runs.",
    "parallelism.sequence_parallel": "Split layer norms and dropout along the sequence over the tp ranks "
    "(saves activation memory); needs tp > 1 to do anything.",
    "resources.pool": "The node pool to run on.",
    "resources.priority": "Higher runs first; capped per tenant by the operator.",
    "resources.max_runtime_s": "Wall-clock limit of one attempt; past it the job fails.",
    "resources.max_retries": "Attempts after a failed one (each resumes from the latest checkpoint).",
}


@cache
def field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """{field: docstring} from the string literal under each annotated field in the class body
    (the convention spec.py follows; pydantic reads the same with use_attribute_docstrings)."""
    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return out


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside an annotation (X, X | None, list[X], X | Literal[...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _submodels(arg)]


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))


def type_text(annotation: Any) -> str:
    """An annotation as a spec writer reads it: `int`, `"a" | "b"`, `list[object]`, `null`."""
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is list:
        return f"list[{type_text(args[0])}]"
    if origin is typing.Annotated:
        inner = type_text(args[0])
        bounds = _bounds([m for a in args[1:] for m in (a.metadata if isinstance(a, FieldInfo) else [a])])
        return f"{inner} ({bounds})" if bounds else inner
    return getattr(annotation, "__name__", str(annotation))


def _number(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    return str(v)


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:
        if isinstance(m, at.Ge):
            parts.append(f"≥ {_number(m.ge)}")
        elif isinstance(m, at.Gt):
            parts.append(f"> {_number(m.gt)}")
        elif isinstance(m, at.Le):
            parts.append(f"≤ {_number(m.le)}")
        elif isinstance(m, at.Lt):
            parts.append(f"< {_number(m.lt)}")
        elif isinstance(m, at.MinLen):
            parts.append(f"length ≥ {m.min_length}")
        elif isinstance(m, at.MaxLen):
            parts.append(f"length ≤ {m.max_length}")
        elif getattr(m, "pattern", None):
            parts.append(f"matches `{m.pattern}`")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        made = info.default_factory()  # type: ignore[call-arg]
        return "(its defaults)" if isinstance(made, BaseModel) else json.dumps(made)
    if info.default is PydanticUndefined:
        return "required"
    if isinstance(info.default, BaseModel):
        return "(its defaults)"
    return json.dumps(info.default)


def _aliases(name: str, info: FieldInfo) -> tuple[str, ...]:
    found: list[str] = []
    if isinstance(info.alias, str):
        found.append(info.alias)
    va = info.validation_alias
    if isinstance(va, str):
        found.append(va)
    elif isinstance(va, AliasChoices):
        found += [c for c in va.choices if isinstance(c, str)]
    return tuple(dict.fromkeys(a for a in found if a != name))


def sections(model: type[BaseModel] = JobSpec, path: str = "") -> Iterator[Section]:
    """Every object of the spec, depth first: its own fields, then its sub-objects' sections."""
    section = Section(path, model)
    docs = field_docstrings(model)
    children: list[tuple[str, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        dotted = f"{path}.{name}" if path else name
        subs = _submodels(info.annotation)
        child = dotted + ("[]" if _is_list(info.annotation) else "")
        doc = docs.get(name) or MISSING_DOCSTRINGS.get(dotted, "")
        if subs:
            doc = f"{doc} Its fields are under `{child}` below.".lstrip()
        section.fields.append(
            FieldDoc(
                name=dotted,
                type=type_text(info.annotation),
                default=_default(info),
                bounds=_bounds(info.metadata),
                doc=doc,
                aliases=_aliases(name, info),
            )
        )
        children += [(child, sub) for sub in subs]
    yield section
    for child_path, sub in children:
        yield from sections(sub, child_path)


def all_fields() -> list[FieldDoc]:
    return [f for s in sections() for f in s.fields]


# -- the rules between fields --------------------------------------------------------------------

BASE_SPEC: dict[str, Any] = {
    "name": "rule-example",
    "data": {"train": [{"path": "file:///data/corpus.jsonl"}]},
}
"""A valid spec (every other field its default: llama, 4 layers, hidden 256, 8 heads, seq 256,
global batch 16 of micro-batches of 4, parallelism auto); each rule's example changes it."""


@dataclass(frozen=True)
class Rule:
    field: str
    """The field the error names."""
    rule: str
    breaks: dict[str, Any]
    """Dotted field → value, applied to BASE_SPEC: a spec that breaks the rule."""
    where: str = "spec"
    """spec: megatrain/spec.py; layout: megatrain/plan/layout.py (resolve_layout), at submission."""

    def example(self) -> dict[str, Any]:
        spec = copy.deepcopy(BASE_SPEC)
        for dotted, value in self.breaks.items():
            node = spec
            *parents, leaf = dotted.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):
                    node[p] = {}  # e.g. `parallelism: auto` becomes an object
                node = node[p]
            node[leaf] = value
        return spec


_LLAMA3 = {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
RULES: tuple[Rule, ...] = (
    Rule("model.hidden_size", "hidden_size is divisible by num_attention_heads",
         {"model.hidden_size": 100, "model.num_attention_heads": 8}),
    Rule("model.num_attention_heads", "num_attention_heads is divisible by num_query_groups",
         {"model.num_query_groups": 3}),
    Rule("model.rope_scaling", "rope_scaling only with arch llama (gpt2 has learned positions)",
         {"model.arch": "gpt2", "model.rope_scaling": {"type": "linear", "factor": 2.0}}),
    Rule("model.rope_scaling", "type llama3 needs low_freq_factor, high_freq_factor and "
         "original_max_position_embeddings", {"model.rope_scaling": {"type": "llama3", "factor": 8.0}}),
    Rule("model.rope_scaling.low_freq_factor", "the llama3 fields are refused with type linear",
         {"model.rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}),
    Rule("model.rope_scaling.high_freq_factor", "high_freq_factor exceeds low_freq_factor",
         {"model.rope_scaling": {**_LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}}),
    Rule("model.attention_backend", "attention_backend flex runs no attention dropout",
         {"model.attention_backend": "flex", "model.attention_dropout": 0.1}),
    Rule("model.attention_backend", "attention_backend flash or te needs training.precision other than fp32",
         {"model.attention_backend": "flash", "training.precision": "fp32"}),
    Rule("model.init_from", "init_from is null, checkpoint:JOB_ID[@STEP], hf:NAME (registered) or "
         "hf:URL (file:///abs/path or s3://bucket/prefix)", {"model.init_from": "gpt2"}),
    Rule("model.init_from", "kind finetune needs model.init_from", {"kind": "finetune"}),
    Rule("model.init_from", "kind dpo needs model.init_from", {"kind": "dpo"}),
    Rule("model.init_from", "kind serve needs model.init_from", {"kind": "serve", "data.train": []}),
    Rule("data.train", "at least one data source (kind serve: none)", {"data.train": []}),
    Rule("data.train", "kind serve reads no data", {"kind": "serve", "model.init_from": "hf:/m"}),
    Rule("data.tokenizer.path", "tokenizer type hf or sentencepiece needs a path",
         {"data.tokenizer": {"type": "hf"}}),
    Rule("data.tokenizer.name", "tokenizer type tiktoken needs a name",
         {"data.tokenizer": {"type": "tiktoken"}}),
    Rule("data.tokenizer.path", "tokenizer type byte takes no path",
         {"data.tokenizer": {"type": "byte", "path": "file:///data/tokenizer.json"}}),
    Rule("data.tokenizer.name", "a tokenizer name only with type tiktoken",
         {"data.tokenizer": {"type": "hf", "path": "file:///data/tokenizer.json", "name": "cl100k_base"}}),
    Rule("data.train.0", "every data source has a path or a dataset name", {"data.train": [{"weight": 1.0}]}),
    Rule("training.lora", "training.lora only with training.method lora",
         {"training.lora": {"rank": 8}}),
    Rule("training.lora.targets", "no target listed twice",
         {"training.method": "lora", "training.lora": {"targets": ["qkv", "qkv"]}}),
    Rule("training.lora.targets", "a target the model has (experts needs model.moe; fc1/fc2 a dense "
         "MLP or a shared expert)", {"training.method": "lora", "training.lora": {"targets": ["experts"]}}),
    Rule("training.lora.dropout", "dropout 0 when the targets include experts",
         {"training.method": "lora", "training.lora": {"targets": ["experts"], "dropout": 0.1}}),
    Rule("training.dpo", "training.dpo only with kind dpo", {"training.dpo": {"beta": 0.1}}),
    Rule("training.dpo.label_smoothing", "label_smoothing only with loss_type sigmoid",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.micro_batch_size": 2,
          "training.dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}),
    Rule("training.micro_batch_size", "kind dpo needs an even micro_batch_size (auto picks an even one)",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.micro_batch_size": 1}),
    Rule("training.global_batch_size", "kind dpo with micro_batch_size auto needs an even global_batch_size",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.global_batch_size": 9}),
    Rule("data.packing", "kind dpo runs without packing",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.micro_batch_size": 2, "data.packing": True}),
    Rule("training.global_batch_size", "global_batch_size is divisible by micro_batch_size",
         {"training.global_batch_size": 10, "training.micro_batch_size": 4}),
    Rule("training.warmup_iters", "warmup_iters ≤ train_iters",
         {"training.train_iters": 10, "training.warmup_iters": 20}),
    Rule("training.min_loss_scale", "min_loss_scale ≤ initial_loss_scale",
         {"training.initial_loss_scale": 1024.0, "training.min_loss_scale": 4096.0}),
    Rule("training.min_lr", "min_lr ≤ lr", {"training.lr": 1e-4, "training.min_lr": 1e-3}),
    Rule("resources.devices", "with dp auto, the processes asked for are a multiple of tp×pp×cp",
         {"parallelism.tp": 2, "resources.devices": 3}, "layout"),
    Rule("resources.devices", "with dp given, the processes asked for equal tp×pp×cp×dp",
         {"parallelism.tp": 2, "parallelism.dp": 2, "resources.devices": 2}, "layout"),
    Rule("model.num_attention_heads", "num_attention_heads is divisible by tp",
         {"parallelism.tp": 16}, "layout"),
    Rule("model.num_query_groups", "num_query_groups is divisible by tp",
         {"model.num_query_groups": 2, "parallelism.tp": 4}, "layout"),
    Rule("model.ffn_hidden_size", "ffn_hidden_size is divisible by tp",
         {"model.ffn_hidden_size": 1002, "parallelism.tp": 4}, "layout"),
    Rule("model.moe.ffn_hidden_size", "each routed expert's width is divisible by tp",
         {"model.moe": {"num_experts": 4, "ffn_hidden_size": 177}, "parallelism.tp": 2}, "layout"),
    Rule("model.moe.shared_expert_ffn_hidden_size", "the shared expert's width is divisible by tp",
         {"model.moe": {"num_experts": 4, "shared_expert_ffn_hidden_size": 177}, "parallelism.tp": 2},
         "layout"),
    Rule("model.moe.num_experts", "num_experts is divisible by ep",
         {"model.moe": {"num_experts": 6}, "parallelism.ep": 4, "parallelism.dp": 4}, "layout"),
    Rule("parallelism.ep", "ep divides dp×cp (experts are split over ranks carved from them)",
         {"model.moe": {"num_experts": 4}, "parallelism.ep": 4, "parallelism.dp": 2}, "layout"),
    Rule("parallelism.ep", "ep > 1 needs model.moe", {"parallelism.ep": 2, "parallelism.dp": 2}, "layout"),
    Rule("model.vocab_size", "the embedding's rows (vocab_size rounded up to a multiple of 128) are "
         "divisible by tp",
         {"model.hidden_size": 96, "model.num_attention_heads": 3, "model.ffn_hidden_size": 96,
          "model.vocab_size": 256, "parallelism.tp": 3}, "layout"),
    Rule("model.seq_length", "with sequence_parallel, seq_length is divisible by tp",
         {"model.seq_length": 255, "parallelism.tp": 2, "parallelism.sequence_parallel": True}, "layout"),
    Rule("model.seq_length", "with cp > 1, seq_length is divisible by 2×cp (each rank holds two chunks)",
         {"model.seq_length": 250, "parallelism.cp": 2}, "layout"),
    Rule("model.seq_length", "with cp > 1 and sequence_parallel, seq_length is divisible by 2×cp×tp",
         {"model.seq_length": 252, "parallelism.cp": 2, "parallelism.tp": 2,
          "parallelism.sequence_parallel": True}, "layout"),
    Rule("model.attention_dropout", "cp > 1 runs no attention dropout (ring attention)",
         {"model.attention_dropout": 0.1, "parallelism.cp": 2}, "layout"),
    Rule("model.attention_backend", "cp > 1 runs ring attention: attention_backend auto or sdpa",
         {"model.attention_backend": "flex", "parallelism.cp": 2}, "layout"),
    Rule("parallelism.pp", "pp ≤ num_layers", {"parallelism.pp": 8}, "layout"),
    Rule("parallelism.virtual_stages", "virtual_stages > 1 needs pp > 1", {"parallelism.virtual_stages": 2},
         "layout"),
    Rule("model.num_layers", "without pipeline_layers, num_layers is divisible by pp×virtual_stages",
         {"model.num_layers": 5, "parallelism.pp": 2}, "layout"),
    Rule("parallelism.pipeline_layers", "pipeline_layers has pp×virtual_stages entries",
         {"parallelism.pp": 2, "parallelism.pipeline_layers": [4]}, "layout"),
    Rule("parallelism.pipeline_layers", "pipeline_layers sums to num_layers",
         {"parallelism.pp": 2, "parallelism.pipeline_layers": [1, 2]}, "layout"),
    Rule("training.global_batch_size", "global_batch_size is divisible by micro_batch_size×dp",
         {"parallelism.dp": 3}, "layout"),
    Rule("parallelism.virtual_stages", "interleaved 1F1B (virtual_stages > 1) needs the micro-batches "
         "per step, global_batch_size/(micro_batch_size×dp), divisible by pp",
         {"model.num_layers": 8, "parallelism.pp": 2, "parallelism.virtual_stages": 2,
          "training.global_batch_size": 12}, "layout"),
)  # fmt: skip

SUBMISSION_CHECKS: tuple[tuple[str, str], ...] = (
    ("resources.pool", "names a pool the cluster has"),
    ("resources.devices", "the job's processes fit the pool's nodes"),
    ("model", "the planner's per-device memory estimate fits a device of the pool"),
    ("data.train.N.path, data.tokenizer.path", "lie where the tenant may read: its own storage prefix, "
     "the shared datasets, or an allowed data root (the user's home and the checkout's examples/ in the "
     "embedded default, and those MEGATRAIN_ALLOWED_DATA_ROOTS adds)"),
    ("data.train.N.path, data.tokenizer.path, data.chat_template", "exist and are readable (a JSONL "
     "file; an indexed dataset's PREFIX.bin and PREFIX.idx), checked at submission so a job never "
     "fails on a missing file"),
    ("data.train.N.dataset", "names a dataset registered with `megatrain datasets upload` (own or shared)"),
    ("model.init_from", "checkpoint:JOB_ID names one of the tenant's own jobs; hf:NAME a registered "
     "model (`megatrain models register`); an hf: folder holds a config.json we can build"),
    ("model.*", "with an hf: init_from, every model field given agrees with the folder's config.json "
     "(the others are filled from it)"),
    ("resources.priority", "at most the tenant's priority cap"),
    ("model.attention_backend", "flash and te need their package installed (flash-attn, "
     "transformer-engine: `pip install megatrain[gpu]`)"),
)  # fmt: skip


def rule_errors(data: dict[str, Any]) -> list[dict[str, str]]:
    """The errors the spec and layout rules give `data` ([] when it passes both)."""
    from megatrain.plan.layout import resolve_layout

    try:
        resolve_layout(parse_spec(data))
    except SpecError as exc:
        return list(exc.errors)
    return []


# -- Markdown -----------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _breaks_text(breaks: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {json.dumps(v)}" for k, v in breaks.items())


@lru_cache(maxsize=1)
def render_markdown() -> str:
    """The whole reference as GitHub-flavoured Markdown."""
    out = [
        "# JobSpec reference",
        "",
        f"<!-- Generated from megatrain/spec.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "A job spec is a YAML or JSON object (`megatrain submit SPEC`, `POST /v1/jobs`). Unknown fields "
        "are refused; every rule below is checked before anything runs, and a spec that breaks one gets "
        "a 422 naming the field (`megatrain validate SPEC` runs every check without submitting). "
        "Copyable specs, commented line by line, are in [examples/](../examples/). The API serves this "
        "page at `GET /v1/spec/reference` and the JSON Schema at `GET /v1/spec/schema`.",
        "",
        "Defaults are JSON values (`null` = not set). In a spec file, data paths written without a scheme "
        "(`data/chat.jsonl`) are resolved against the file's folder into `file:///…` URLs by "
        "`megatrain submit`/`validate` and the SDK; the API itself takes only `file:///abs/path` and "
        "`s3://bucket/key`.",
        "",
        "## Fields",
    ]
    for section in sections():
        title = section.path or "top level"
        out += ["", f"### {_code(title) if section.path else title}", ""]
        doc = inspect.cleandoc(section.model.__doc__ or "") if section.model.__doc__ else ""
        if doc and not doc.startswith(section.model.__name__ + "("):
            out += [" ".join(doc.split()), ""]
        out += ["| Field | Type | Default | Bounds | Description |", "|---|---|---|---|---|"]
        for f in section.fields:
            desc = f.doc + (
                f" Also accepted as {', '.join(f'`{a}`' for a in f.aliases)}." if f.aliases else ""
            )
            default = f.default if f.default in ("required", "(its defaults)") else _code(f.default)
            out.append(
                f"| {_code(f.name)} | {_code(f.type)} | {default} | {_cell(f.bounds)} | {_cell(desc)} |"
            )
    out += [
        "",
        "## Rules between fields",
        "",
        "Each rule with the field its error names and a change that breaks it, made to this valid "
        f"spec: {_code(json.dumps(BASE_SPEC))}. `spec` rules are checked by megatrain/spec.py; `layout` "
        "ones when the parallel layout is resolved (megatrain/plan/layout.py), also at submission.",
        "",
        "| Field | Rule | Checked by | Broken by |",
        "|---|---|---|---|",
    ]
    for r in RULES:
        out.append(f"| {_code(r.field)} | {_cell(r.rule)} | {r.where} | {_code(_breaks_text(r.breaks))} |")
    out += [
        "",
        "## Checked at submission, against the service",
        "",
        "These depend on the cluster and the tenant, so only `POST /v1/jobs` and `POST /v1/spec/validate` "
        "check them:",
        "",
    ]
    out += [f"- {_code(f)}: {text}." for f, text in SUBMISSION_CHECKS]
    return "\n".join(out) + "\n"


@lru_cache(maxsize=1)
def render_html() -> str:
    """The reference as a standalone HTML page (markdown-it-py, which rich already depends on)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(render_markdown())
    style = (
        "body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;"
        "line-height:1.45}table{border-collapse:collapse;font-size:.9rem}td,th{border:1px solid #ccc;"
        "padding:.3rem .5rem;vertical-align:top}code{font-size:.85em}"
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>JobSpec reference</title>'
        f"<style>{style}</style></head><body>{body}</body></html>"
    )


if __name__ == "__main__":
    import sys

    sys.stdout.write(render_markdown())
