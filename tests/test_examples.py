"""examples/: every spec passes the API's real validation (POST /v1/spec/validate) with the data it
names present (the shipped files, a registered and preprocessed dataset, a registered model folder);
relative data paths in spec files; `megatrain demo --write-spec x.yaml`; the README's SDK snippet."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app as cli_app
from megatrain.client import load_spec_file
from megatrain.settings import Settings, get_settings, reset_settings_cache

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# What each example must resolve to (a new example file needs an entry: see test_every_example_is_listed).
EXPECTED_LAYOUT: dict[str, dict[str, Any]] = {
    "pretrain_jsonl.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "pretrain_indexed.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "finetune_hf_chat.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "finetune_lora.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "dpo.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "layout_3d.yaml": {"tp": 2, "pp": 2, "dp": 2, "virtual_stages": 2, "sequence_parallel": True},
    "auto.yaml": {"tp": 1, "pp": 1, "dp": 2},
    "moe.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "eval.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "bert_pretrain.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "bert_serve.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "t5_pretrain.yaml": {"tp": 1, "pp": 1, "dp": 1},
    "t5_finetune.yaml": {"tp": 1, "pp": 1, "dp": 1},
}
# The demo's model as `megatrain export` writes its config.json (megatrain.demo.demo_spec's shape).
DEMO_LLAMA_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
    "num_hidden_layers": 6, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 352, "max_position_embeddings": 128, "vocab_size": 257,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


@pytest.fixture
def api(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, Settings]]:
    """An API whose tenant may read the test's own folder besides the embedded default's roots (the
    checkout's examples/ among them, wherever the checkout lies), with a CPU pool of 8 slots."""
    from megatrain.api.app import create_app
    from megatrain.api.auth import create_api_key
    from megatrain.db.session import session_scope
    from megatrain.worker.nodes import ensure_local_pool

    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", tmp_path.as_uri())
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", "8")  # layout_3d asks for 8 processes
    reset_settings_cache()
    settings = get_settings()
    with session_scope(db_url) as session:
        ensure_local_pool(session, settings)
        key = create_api_key(session, "acme", "test")
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client, settings


def _register_demo_model(client: TestClient, folder: Path) -> None:
    """What the walk-through does: the demo's export registered as `demo-llama`."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(DEMO_LLAMA_CONFIG))
    (folder / "model.safetensors").write_bytes(b"")  # registration checks the weights exist
    resp = client.post("/v1/models", json={"name": "demo-llama", "url": folder.as_uri()})
    assert resp.status_code == 201, resp.text


def _register_demo_bert(client: TestClient, folder: Path) -> None:
    """bert_serve.yaml's model: bert_pretrain.yaml's shape, exported and registered as `demo-bert`."""
    folder.mkdir(parents=True)
    config = {"model_type": "bert", "architectures": ["BertForPreTraining"], "vocab_size": 128,
              "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 512, "max_position_embeddings": 64, "hidden_act": "gelu"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    resp = client.post("/v1/models", json={"name": "demo-bert", "url": folder.as_uri()})
    assert resp.status_code == 201, resp.text


def _register_demo_t5(client: TestClient, folder: Path) -> None:
    """t5_finetune.yaml's model: t5_pretrain.yaml's, as `megatrain export` writes its config.json
    (interop.hf_t5.t5_hf_config), registered as `demo-t5`."""
    folder.mkdir(parents=True)
    config = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 211,
              "d_model": 128, "d_kv": 32, "d_ff": 512, "num_layers": 4, "num_decoder_layers": 4,
              "num_heads": 4, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
              "scale_decoder_outputs": False, "layer_norm_epsilon": 1e-6, "n_positions": 64,
              "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
              "is_encoder_decoder": True, "decoder_start_token_id": 5, "eos_token_id": 6}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    resp = client.post("/v1/models", json={"name": "demo-t5", "url": folder.as_uri()})
    assert resp.status_code == 201, resp.text


def _upload_tiny_corpus(client: TestClient, settings: Settings) -> None:
    """`megatrain datasets upload examples/data/corpus.jsonl --name tiny-corpus --tokenizer byte`,
    then the worker's preprocessing, run here: the dataset is really ready (PREFIX.bin/.idx exist)."""
    from megatrain.worker.datasets import preprocess_dataset

    resp = client.post(
        "/v1/datasets",
        params={"name": "tiny-corpus", "tokenizer": "byte"},
        content=(EXAMPLES / "data" / "corpus.jsonl").read_bytes(),
        headers={"Content-Type": "application/x-ndjson"},
    )
    assert resp.status_code == 201, resp.text
    assert preprocess_dataset(resp.json()["id"], settings) == "ready"


def test_every_example_is_listed() -> None:
    assert {p.name for p in example_files()} == set(EXPECTED_LAYOUT)


def test_every_example_passes_the_apis_validation(api: tuple[TestClient, Settings], tmp_path: Path) -> None:
    client, settings = api
    _register_demo_model(client, tmp_path / "models" / "demo-llama")
    _register_demo_bert(client, tmp_path / "models" / "demo-bert")
    _register_demo_t5(client, tmp_path / "models" / "demo-t5")
    _upload_tiny_corpus(client, settings)
    for path in example_files():
        data = load_spec_file(path)  # what `megatrain validate/submit PATH` and the SDK send
        resp = client.post("/v1/spec/validate", json=data)
        assert resp.status_code == 200, (path.name, resp.text)
        body = resp.json()
        assert body["valid"] and body["spec"]["name"] == data["name"], path.name
        layout = {k: body["layout"][k] for k in EXPECTED_LAYOUT[path.name]}
        assert layout == EXPECTED_LAYOUT[path.name], path.name
        for src in body["spec"]["data"]["train"]:
            # Every source is an absolute URL of something that exists (a file, or a preprocessed prefix).
            local = Path(src["path"].removeprefix("file://"))
            assert local.is_file() or Path(f"{local}.idx").is_file(), (path.name, src)


def test_the_finetune_example_takes_its_model_from_the_registered_folder(
    api: tuple[TestClient, Settings], tmp_path: Path
) -> None:
    client, _ = api
    folder = tmp_path / "models" / "demo-llama"
    data = load_spec_file(EXAMPLES / "finetune_hf_chat.yaml")
    resp = client.post("/v1/spec/validate", json=data)
    assert resp.status_code == 422 and "model.init_from" in resp.text, resp.text  # not registered yet
    _register_demo_model(client, folder)
    spec = client.post("/v1/spec/validate", json=data).json()["spec"]
    assert spec["kind"] == "finetune" and spec["model"]["init_from"] == f"hf:{folder.as_uri()}"
    assert (spec["model"]["num_layers"], spec["model"]["seq_length"]) == (6, 128)


def test_the_shipped_data_is_what_make_data_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("make_data", EXAMPLES / "data" / "make_data.py")
    assert module_spec and module_spec.loader
    make_data = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(make_data)
    monkeypatch.setattr(make_data, "HERE", tmp_path)
    make_data.main()
    for name in ("corpus.jsonl", "chat.jsonl", "preferences.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name
    chats = [json.loads(line) for line in (EXAMPLES / "data" / "chat.jsonl").read_text().splitlines()]
    assert len(chats) >= 200 and all(c["messages"][-1]["role"] == "assistant" for c in chats)
    total = sum(p.stat().st_size for p in (EXAMPLES / "data").glob("*.jsonl"))
    assert total < 400_000


def test_the_shipped_t5_data_is_what_make_t5_vocab_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("make_t5", EXAMPLES / "data" / "make_t5_vocab.py")
    assert module_spec and module_spec.loader
    make_t5 = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(make_t5)
    monkeypatch.setattr(make_t5, "HERE", tmp_path)
    (tmp_path / "corpus.jsonl").write_bytes((EXAMPLES / "data" / "corpus.jsonl").read_bytes())
    make_t5.main()
    for name in ("t5_pairs.jsonl", "t5_wordpiece.json"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name


def test_the_shipped_eval_tasks_are_what_make_tasks_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("make_tasks", EXAMPLES / "eval" / "make_tasks.py")
    assert module_spec and module_spec.loader
    make_tasks = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(make_tasks)
    monkeypatch.setattr(make_tasks, "HERE", tmp_path)
    make_tasks.main()
    for name in ("corpus_mc.jsonl", "corpus_cloze.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "eval" / name).read_bytes(), name
    items = [json.loads(line) for line in (EXAMPLES / "eval" / "corpus_mc.jsonl").read_text().splitlines()]
    assert len(items) == 200 and all(i["choices"][i["answer"]] == " follows it." for i in items)
    assert {i["answer"] for i in items} == {0, 1, 2, 3}  # the right ending is not always first


# -- relative data paths in spec files -----------------------------------------------------------


def test_relative_paths_resolve_against_the_spec_files_folder(tmp_path: Path) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    spec = {
        "name": "rel",
        "data": {
            "tokenizer": "hf:tok/tokenizer.json",
            "train": [
                {"path": "data/a.jsonl"},
                {"path": "../shared/b.jsonl.gz"},
                {"path": "s3://bucket/c.jsonl"},
                {"path": "file:///abs/d.jsonl"},
                {"dataset": "wiki"},
            ],
            "chat_template": "chatml",
        },
    }
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    data = load_spec_file(path)
    train = [src.get("path") for src in data["data"]["train"]]
    assert train == [
        (folder / "data" / "a.jsonl").as_uri(),
        (tmp_path / "shared" / "b.jsonl.gz").as_uri(),  # `..` folded: the API refuses `..` segments
        "s3://bucket/c.jsonl",
        "file:///abs/d.jsonl",
        None,
    ]
    assert data["data"]["tokenizer"] == f"hf:{(folder / 'tok' / 'tokenizer.json').as_uri()}"
    assert data["data"]["chat_template"] == "chatml"  # a built-in name, not a file

    spec["data"]["tokenizer"] = {"type": "sentencepiece", "path": "sp.model"}
    spec["data"]["chat_template"] = "tokenizer_config.json"
    path.write_text(json.dumps(spec))
    data = load_spec_file(path)
    assert data["data"]["tokenizer"]["path"] == (folder / "sp.model").as_uri()
    assert data["data"]["chat_template"] == (folder / "tokenizer_config.json").as_uri()


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_cli_validate_resolves_a_relative_path_from_any_directory(
    live_api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = live_api.spec("relative")
    spec["data"]["train"] = [{"path": live_api.data_path.name}]  # beside the spec file
    path = live_api.data_path.parent / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out = _cli("validate", str(path))
    assert code == 0 and "is valid" in out, out
    code, out = _cli("submit", str(path))
    assert code == 0 and "submitted job" in out, out


# -- megatrain demo --write-spec ------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_demo_write_spec_writes_yaml_for_a_yaml_suffix(
    megatrain_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    import megatrain.demo as demo_mod

    build = demo_mod.build_stdlib_corpus
    monkeypatch.setattr(demo_mod, "build_stdlib_corpus", lambda dest: build(dest, max_bytes=20_000))
    target = tmp_path / f"demo{suffix}"
    code, out = _cli("demo", "--write-spec", str(target))
    assert code == 0 and "torchrun" in out, out
    text = target.read_text()
    if suffix == ".json":
        spec = json.loads(text)
    else:
        assert not text.lstrip().startswith("{") and "\nmodel:\n" in text, text[:200]
        spec = yaml.safe_load(text)
    assert spec == demo_mod.demo_spec(spec["data"]["train"][0]["path"])


# -- the README's SDK snippet ----------------------------------------------------------------------


def readme_sdk_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    snippets = [b for b in blocks if "from megatrain.client import Client" in b]
    assert len(snippets) == 1, "README.md should hold one SDK snippet"
    return snippets[0]


def test_readme_documents_the_real_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("MEGATRAIN_API_URL", "MEGATRAIN_API_KEY"):
        field = name.removeprefix("MEGATRAIN_").lower()
        assert name in readme and field in Settings.model_fields, name
    assert Settings.model_fields["api_url"].default in readme  # the documented default is the real one


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL adds nothing here but time
def test_readme_sdk_snippet_runs(
    live_stack: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The snippet as written, on a live stack, with a tiny spec in place of the example's."""
    pytest.importorskip("megatrain.engine.train", reason="the engine is needed to run a job")
    snippet = readme_sdk_snippet()
    assert "examples/pretrain_jsonl.yaml" in snippet
    spec_path = tmp_path / "tiny.yaml"
    spec_path.write_text(yaml.safe_dump(live_stack.spec("readme-sdk")))
    monkeypatch.chdir(tmp_path)  # the snippet downloads into a relative folder
    monkeypatch.setattr(sys, "argv", ["snippet"])
    exec(compile(snippet.replace("examples/pretrain_jsonl.yaml", str(spec_path)), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "succeeded" in out, out
    assert any((tmp_path / "checkpoint").iterdir())


def test_what_the_readme_sdk_snippet_writes_is_ignored_by_git() -> None:
    """Run from the checkout, the snippet downloads into ./checkpoint: `git status` stays clean."""
    import shutil
    import subprocess

    [dest] = re.findall(r'download\([^)]*dest="([^"]+)"', readme_sdk_snippet())
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    check = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "-q", f"{dest}/model.safetensors"]
    )
    assert check.returncode == 0, f"{dest}/ (README's SDK snippet) is not in .gitignore"


# -- the walk-through's commands --------------------------------------------------------------------


def walkthrough_commands() -> list[list[str]]:
    import shlex

    text = (EXAMPLES / "README.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for ln in block.splitlines()]
    return [shlex.split(ln.split("  #")[0])[1:] for ln in lines if ln.startswith("megatrain ")]


def test_every_walkthrough_command_exists_with_its_options() -> None:
    """Each `megatrain …` line of examples/README.md names a real command, options it takes, and
    example files that exist."""
    import typer.main

    commands = walkthrough_commands()
    assert len(commands) >= 10
    named = {" ".join(args[:2]) for args in commands}
    for wanted in ("demo", "export JOB", "models register", "validate examples/finetune_hf_chat.yaml",
                   "submit examples/finetune_hf_chat.yaml", "generate JOB"):  # fmt: skip
        assert any(n.startswith(wanted) for n in named), wanted
    root = typer.main.get_command(cli_app)
    for args in commands:
        cmd, rest = root, list(args)
        # Groups (megatrain, megatrain models, ...) hold their subcommands by name.
        while getattr(cmd, "commands", None) is not None:
            sub = cmd.commands.get(rest[0])  # type: ignore[attr-defined]
            assert sub is not None, f"megatrain {' '.join(args)}: no command {rest[0]!r}"
            cmd, rest = sub, rest[1:]
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for word in rest:
            if word.startswith("--"):
                assert word.split("=")[0] in opts, f"megatrain {' '.join(args)}: no option {word}"
            elif word.startswith("examples/"):
                assert (ROOT / word).is_file(), word
