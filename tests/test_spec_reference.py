"""The generated JobSpec reference: committed copy current, every field and rule in it, each rule's
example really broken on its field, and served by the API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from megatrain import spec_reference as ref
from megatrain.spec import JobSpec, ModelSpec, TrainingSpec

ROOT = Path(__file__).resolve().parents[1]


def test_committed_reference_is_current() -> None:
    committed = (ROOT / "docs" / "spec-reference.md").read_text()
    assert committed == ref.render_markdown(), (
        f"docs/spec-reference.md is out of date with megatrain/spec.py; regenerate it: {ref.REGENERATE}"
    )


def test_every_field_is_listed_with_its_type_default_and_bounds() -> None:
    rows = {f.name: f for f in ref.all_fields()}
    # The whole tree, nested objects and list items included.
    for name in ("name", "model.rope_scaling.original_max_position_embeddings", "data.train[].dataset",
                 "data.tokenizer.type", "training.precision", "parallelism.pipeline_layers",
                 "resources.max_retries"):  # fmt: skip
        assert name in rows, name
    assert len(rows) == sum(1 for s in ref.sections() for _ in s.fields)
    layers = rows["model.num_layers"]
    info = ModelSpec.model_fields["num_layers"]
    assert (layers.type, layers.default) == ("int", str(info.default))
    assert layers.bounds == "≥ 1, ≤ 1024"
    assert rows["training.precision"].type == '"auto" | "fp32" | "bf16" | "fp16" | "fp8"'
    assert rows["training.precision"].default == f'"{TrainingSpec.model_fields["precision"].default}"'
    # Empty only for kind serve (a rule between fields says so), so the field itself defaults to [].
    assert rows["data.train"].default == "[]" and "length ≤ 64" in rows["data.train"].bounds
    assert rows["parallelism.dp"].type == 'int | "auto"'
    assert rows["name"].bounds.startswith("matches `^")
    # Docstrings come from spec.py itself.
    assert rows["training.clip_grad"].doc == "Global gradient-norm clip; 0 disables it."
    text = ref.render_markdown()
    for name in rows:
        assert f"| `{name}` |" in text, name


def test_every_field_has_a_description() -> None:
    assert [f.name for f in ref.all_fields() if not f.doc] == []


def test_fallback_descriptions_only_cover_fields_spec_py_leaves_undocumented() -> None:
    """spec.py owns the truth: once a field gains a docstring there, drop it from MISSING_DOCSTRINGS."""
    documented = set()
    for section in ref.sections():
        docs = ref.field_docstrings(section.model)
        prefix = f"{section.path}." if section.path else ""
        documented |= {prefix + name for name in docs}
    known = {f.name for f in ref.all_fields()}
    for name in ref.MISSING_DOCSTRINGS:
        assert name in known, f"{name} is not a JobSpec field"
        assert name not in documented, f"{name} now has a docstring in spec.py; remove its fallback"


def test_the_base_spec_passes_every_rule() -> None:
    assert ref.rule_errors(ref.BASE_SPEC) == []
    JobSpec.model_validate(ref.BASE_SPEC)


@pytest.mark.parametrize("rule", ref.RULES, ids=lambda r: f"{r.field}:{r.rule[:40]}")
def test_each_rule_example_fails_on_its_field(rule: ref.Rule) -> None:
    errors = ref.rule_errors(rule.example())
    fields = [e["field"] for e in errors]
    assert any(f == rule.field or f.startswith(rule.field + ".") for f in fields), (rule, errors)


def test_rules_name_real_fields() -> None:
    known = {f.name.replace("[]", ".0") for f in ref.all_fields()}
    known |= {s.path.replace("[]", ".0") for s in ref.sections()}  # a list item: data.train.0
    for rule in ref.RULES:
        assert rule.field in known, rule.field
        for dotted in rule.breaks:
            assert dotted in known, (rule.field, dotted)


@pytest.fixture
def client(megatrain_home: Path) -> Iterator[TestClient]:
    from megatrain.api.app import create_app
    from megatrain.settings import get_settings

    with TestClient(create_app(get_settings())) as c:
        yield c


def test_api_serves_the_reference(client: TestClient) -> None:
    resp = client.get("/v1/spec/reference")  # no key: it holds no tenant data
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/markdown")
    assert resp.text == ref.render_markdown()

    html = client.get("/v1/spec/reference", headers={"Accept": "text/html"})
    assert html.headers["content-type"].startswith("text/html")
    assert "<table>" in html.text and "<code>model.num_layers</code>" in html.text
    assert client.get("/v1/spec/reference?format=html").text == html.text
    assert client.get("/v1/spec/reference?format=pdf").status_code == 422


def test_openapi_description_links_the_reference(client: TestClient) -> None:
    info = client.get("/openapi.json").json()["info"]
    assert "/v1/spec/reference" in info["description"]


def test_readme_links_the_reference_and_examples() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/spec-reference.md" in readme and "examples/" in readme
