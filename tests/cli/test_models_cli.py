"""`megatrain models register|list|show|delete` through typer's CliRunner against a live API: a
table that fits 80 columns, one red line (never a traceback) for every refused request."""

from __future__ import annotations

import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app

transformers = pytest.importorskip("transformers")


def run(*args: str, columns: int = 80) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_register_list_show_delete(live_api: LiveApi) -> None:
    folder = live_api.data_path.parent / "gpt2"
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=260, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    code, out = run("models", "register", folder.as_uri(), "--name", "a-rather-long-model-name-v2")
    assert code == 0 and "gpt2, 1 layer, hidden 32, vocab 260" in out, out
    code, out = run("models", "list")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 80, out
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "TYPE", "LAYERS", "HIDDEN", "HEADS", "VOCAB", "SEQ", "SHARED"]
    assert row.split() == ["a-rather-long-model-name-v2", "gpt2", "1", "32", "2", "260", "32"], out
    code, out = run("models", "show", "a-rather-long-model-name-v2", columns=300)
    assert code == 0 and folder.as_uri() in out and "model.tie_embeddings" in out, out
    for args, expected in [
        (("models", "register", folder.as_uri(), "--name", "a-rather-long-model-name-v2"), "already exists"),
        (("models", "register", "file:///nowhere/at/all", "--name", "x"), "url: "),
        (("models", "show", "missing"), "not found"),
    ]:
        code, out = run(*args)
        assert code == 1 and expected in out and len(out.strip().splitlines()) == 1, out
    code, out = run("models", "delete", "a-rather-long-model-name-v2")
    assert code == 0 and "deleted" in out, out
    code, out = run("models", "list")
    assert code == 0 and "no models yet" in out, out
    # The operator's share (straight to the database): every tenant lists it as shared.
    code, out = run("models", "share", folder.as_uri(), "--name", "common")
    assert code == 0 and "shared model common registered" in out, out
    code, out = run("models", "list")
    assert code == 0 and out.splitlines()[1].split()[-1] == "yes", out
    code, out = run("models", "delete", "common")
    assert code == 1 and "shared by the operator" in out, out
