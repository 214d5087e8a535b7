"""The JobSpec reference, generated from the pydantic models in megatrain/spec.py.

Every field's dotted name, type, default, bounds and docstring come from the models themselves, so
the reference cannot drift from what the API accepts; the rules *between* fields live in RULES
(spec_rule_reference.py), each with a spec that breaks it (tests/test_spec_reference.py checks that
each really fails on its field). `python -m megatrain.spec_reference > docs/spec-reference.md`
regenerates the committed copy; the API serves a fresh one at GET /v1/spec/reference. Torch-free.
"""

from __future__ import annotations

import ast
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

from megatrain.spec import JobSpec
from megatrain.spec_rule_reference import BASE_SPEC, RULES, SUBMISSION_CHECKS
from megatrain.spec_rule_reference import Rule as Rule  # re-exported: the reference's whole surface
from megatrain.spec_rule_reference import rule_errors as rule_errors

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
    "kind": "pretrain: next-token loss on every token (arch bert: masked-LM and sentence order; t5: "
    "span corruption). finetune: loss on responses / assistant turns only (arch bert: a sequence "
    "classifier, model.bert.num_labels; t5: on targets), starting from model.init_from (required). "
    "dpo: preference training on {prompt | messages, chosen, rejected} records (training.dpo), from "
    "model.init_from (required), which is also the reference. serve: the model server behind "
    "/openai/v1/chat/completions (arch bert: /openai/v1/embeddings; the API submits it): holds "
    "model.init_from, answers with it and the LoRA adapters trained on it; reads no data.",
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
    "secrets": "Tenant secrets (PUT /v1/secrets/NAME) the job's processes get as environment "
    "variables of those names; their values are redacted from its logs and events.",
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


# -- the rules between fields: megatrain/spec_rule_reference.py


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
