"""Every error a spec has, in one answer.

Pydantic stops at a sub-model's field errors: its cross-field rules (`mode="after"` validators) run
only once those fields are valid, so a user would fix a spec in rounds. `collect_errors` instead
drops each failing value (its default stands in), validates again, and repeats until nothing new
turns up. Cross-field rules report through `report_rules`: with a collector's sink in the
validation context they add every broken rule and let the model be built; without one (a plain
`model_validate`, an assignment) they raise the first, so a built model is always a valid one.

A dropped value is *unknown*: a later error that names it (as its field, or in its message) is
about the stand-in, not about the user's spec, and is left out (`Findings`).
"""

from __future__ import annotations

import copy
import difflib
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, ValidationInfo

Problem = dict[str, str]
"""{"field": "model.hidden_size", "message": "..."}: one broken rule."""

RULES_SINK = "megatrain.rule_problems"
"""The validation-context key under which a collector gathers the cross-field rules' problems."""

MAX_ROUNDS = 10
"""Validations per spec: each round drops at least one value, and a spec has few levels."""

_NAMED_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+)(?:=| is | must | exceeds)")
# Location segments pydantic adds for union branches; no spec field has these names.
_UNION_TAGS = {"ParallelismSpec", "int", "str", "float", "bool", "none"}
_MENTION = re.compile(r"\b[a-z_]+(?:\.(?:[a-z_][a-z0-9_]*|\d+))+")


class SpecError(ValueError):
    """A spec that breaks a rule; `errors` lists each as {"field": "a.b", "message": "..."}."""

    def __init__(self, errors: list[Problem]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))


def report_rules(info: ValidationInfo, problems: list[Problem]) -> None:
    """A model validator's broken cross-field rules: into the collector's sink when one asked for
    every error, else the first raised (pydantic names it by the model's location)."""
    if not problems:
        return
    sink = info.context.get(RULES_SINK) if isinstance(info.context, dict) else None
    if sink is None:
        raise ValueError(problems[0]["message"])
    sink.extend(problems)


def collecting(info: ValidationInfo) -> bool:
    """Whether a collector validates (a rule reported elsewhere may then stay quiet here)."""
    return isinstance(info.context, dict) and RULES_SINK in info.context


def related(a: str, b: str) -> bool:
    """Whether one field is the other or holds it ("model" holds "model.hidden_size")."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@dataclass
class Findings:
    """The errors found so far, and the fields whose given values were dropped (unknown)."""

    sections: tuple[str, ...] = ()
    """Top-level field names: a dotted word in a message starting with one names a field."""
    errors: list[Problem] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)
    _seen: set[tuple[str, str]] = field(default_factory=set, repr=False)
    """(field, message) of every error: a hostile body's thousands of errors are no quadratic work."""

    def names(self, problem: Problem) -> set[str]:
        """The fields a problem is about: its own, and every field its message names."""
        mentioned = {m for m in _MENTION.findall(problem["message"]) if m.split(".")[0] in self.sections}
        return {problem["field"], *mentioned}

    def depends_on_unknown(self, *fields: str) -> bool:
        return any(related(f, u) for f in fields for u in self.unknown)

    def has_error(self, *fields: str) -> bool:
        """Whether an error found so far (or an unknown value) concerns one of `fields`."""
        found = {n for e in self.errors for n in self.names(e)} | self.unknown
        return any(related(f, g) for f in fields for g in found)

    def add(self, problems: Iterable[Problem], unknown: Iterable[str] = ()) -> None:
        """Record problems (each once; none judging an unknown value), then mark `unknown`."""
        for problem in problems:
            key = (problem["field"], problem["message"])
            if key not in self._seen and not (self.unknown and self.depends_on_unknown(*self.names(problem))):
                self._seen.add(key)
                self.errors.append(problem)
        self.unknown.update(unknown)

    def add_for_new_fields(self, problems: Iterable[Problem]) -> None:
        """Record the problems of fields that have none yet: a field's first error is enough where
        a later rule restates it ("10 is not divisible by 3", then "... by 3×2")."""
        seen = {e["field"] for e in self.errors}
        self.add(p for p in problems if p["field"] not in seen)

    def raise_if_any(self) -> None:
        if self.errors:
            raise SpecError(self.errors)


@dataclass(frozen=True)
class _Failure:
    path: tuple[str | int, ...]
    """Where the failing value sits in the submitted data (union branch tags removed)."""
    kind: str
    """Pydantic's error type ("missing", "int_parsing", ...)."""
    problem: Problem


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type holds: itself, or inside Optional, unions, lists and Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _field_names_at(model: type[BaseModel], path: tuple[str | int, ...]) -> list[str]:
    """The field names of the model(s) at `path` in data validated as `model` (list indices skipped),
    and those one level further down, dotted ("moe.num_experts" beside "num_layers" in model)."""
    models = [model]
    for key in path:
        if isinstance(key, str):
            fields = [m.model_fields[key] for m in models if key in m.model_fields]
            models = [inner for f in fields for inner in _models_in(f.annotation)]
    names = {name for m in models for name in m.model_fields}
    for m in models:
        for name, info in m.model_fields.items():
            names |= {f"{name}.{inner}" for sub in _models_in(info.annotation) for inner in sub.model_fields}
    return sorted(names)


SUGGEST_CUTOFF = 0.75
"""difflib's similarity a known name needs to be suggested: trainiters → train_iters (0.95), not
iters → eval_iters (0.67)."""


def _unknown_field(key: str | int, known: list[str]) -> str:
    """The message for an unknown `key`, with the nearest known name when one is near: a field of a
    section below by its exact name (num_experts in model: moe.num_experts), else a typo's here."""
    below = [name for name in known if name.rpartition(".")[2] == key and "." in name]
    here = [name for name in known if "." not in name]
    close = below[:1] or difflib.get_close_matches(str(key), here, n=1, cutoff=SUGGEST_CUTOFF)
    return f"unknown field; did you mean {close[0]}?" if close else "unknown field"


def _failures(
    exc: ValidationError, prefix: tuple[str | int, ...] = (), model: type[BaseModel] | None = None
) -> list[_Failure]:
    items: list[tuple[_Failure, bool]] = []
    for err in exc.errors(include_url=False):
        raw = (*prefix, *err["loc"])
        # "Input should be 'auto'" from the literal branch of a union such as `parallelism`.
        literal_branch = bool(raw) and str(raw[-1]).startswith("literal[")
        # Unions add the branch name ('ParallelismSpec', 'int', "literal['auto']") to the location.
        path = tuple(p for p in raw if str(p) not in _UNION_TAGS and not str(p).startswith("literal["))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            known = _field_names_at(model, path[len(prefix) : -1]) if model is not None and path else []
            msg = _unknown_field(path[-1] if path else "", known)
        # Rules name their field first ("model.hidden_size=250 is not …"); point at it.
        named = _NAMED_FIELD.match(msg)
        name = ".".join(str(p) for p in path)
        if named and (not name or named.group(1).startswith(name)):
            name = named.group(1)
        items.append((_Failure(path, err["type"], {"field": name or "spec", "message": msg}), literal_branch))
    # The literal branch's complaint is noise when the other branch named a problem inside the
    # field ({"parallelism": {"tp": 0}} is not meant to be 'auto').
    inside = [f.problem["field"] for f, lb in items if not lb]
    return [f for f, lb in items if not (lb and any(g.startswith(f.problem["field"] + ".") for g in inside))]


def format_validation_errors(
    exc: ValidationError, prefix: tuple[str | int, ...] = (), model: type[BaseModel] | None = None
) -> list[Problem]:
    """Pydantic errors as [{"field": "model.hidden_size", "message": ...}], the shape every caller shows;
    with the `model` validated, an unknown field's message names the nearest known one."""
    return [f.problem for f in _failures(exc, prefix, model)]


def _drop(
    data: dict[str, Any], path: tuple[str | int, ...], kind: str, placeholders: Mapping[str, Any]
) -> str | None:
    """Remove the value at `path` so its default stands in; the dotted field now unknown, or None
    when nothing could be dropped. A list element takes its list along (dropping one would shift
    the indices later errors are named by); a missing required field takes its parent along, up to
    a top-level field, which gets its placeholder."""
    while path:
        parent: Any = data
        for p in path[:-1]:
            try:
                parent = parent[p]
            except (KeyError, IndexError, TypeError):
                return None  # an enclosing value was dropped already
        key = path[-1]
        if isinstance(parent, list):
            path, kind = path[:-1], "list"
            continue
        if not isinstance(parent, dict):
            return None
        if key in parent and kind != "missing":
            if len(path) == 1 and key in placeholders:
                parent[key] = copy.deepcopy(placeholders[key])
            else:
                del parent[key]
            return ".".join(str(p) for p in path)
        if kind != "missing":
            return None  # dropped already, by an earlier failure of this round
        if len(path) == 1:
            if key not in placeholders:
                return None
            parent[key] = copy.deepcopy(placeholders[key])
            return str(key)
        path, kind = path[:-1], "parent"
    return None


M = TypeVar("M", bound=BaseModel)


def collect_errors(
    model: type[M], data: dict[str, Any], placeholders: Mapping[str, Any], findings: Findings
) -> M | None:
    """`data` validated into `model`, every error added to `findings`; the model built with
    defaults (or `placeholders`, for required top-level fields) standing in for the failing values
    (those are in `findings.unknown`), or None when even that could not be built."""
    current = copy.deepcopy(data)
    for _ in range(MAX_ROUNDS):
        sink: list[Problem] = []
        try:
            built = model.model_validate(current, context={RULES_SINK: sink})
            failures: list[_Failure] = []
        except ValidationError as exc:
            built, failures = None, _failures(exc, model=model)
        findings.add([f.problem for f in failures] + sink)
        if not failures:
            return built
        dropped = {_drop(current, f.path, f.kind, placeholders) for f in failures} - {None}
        if not dropped:
            return None
        findings.unknown.update(d for d in dropped if d)
    return None
