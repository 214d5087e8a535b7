"""`megatrain download JOB[@STEP] --weights-only` of a real engine checkpoint through a live API:
the copy lacks the optimizer state and still loads as the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine.helpers import tiny_spec, write_corpus
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Client
from megatrain.db.models import Checkpoint
from megatrain.db.session import session_scope
from megatrain.storage import open_store


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_weights_only_download_loads(live_api: LiveApi, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from megatrain.engine.checkpoint import load_checkpoint
    from megatrain.engine.train import run as train
    from megatrain.spec import parse_spec

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    spec = parse_spec(tiny_spec(corpus, train_iters=2, checkpoint_interval=2, eval_interval=0))
    train(spec, tmp_path / "r")
    full = tmp_path / "r" / "checkpoints" / "iter_0000002"
    with Client() as c:
        job_id = c.submit(live_api.spec("weights")).id
    # Put the engine's folder where the shard runner would have uploaded it, with its DB row.
    store = open_store(live_api.settings.resolved_storage_url)
    prefix = f"jobs/{job_id}/checkpoints/iter_0000002"
    for f in full.iterdir():
        store.put_bytes(f"{prefix}/{f.name}", f.read_bytes())
    with session_scope(live_api.settings.resolved_database_url) as s:
        s.add(Checkpoint(job_id=job_id, step=2, uri=f"{store.url}/{prefix}", size_bytes=1))

    code, out = run("download", f"{job_id}@2", "--weights-only", "--to", str(tmp_path / "w"))
    assert code == 0 and "weights of step 2" in out, out
    got = {f.name for f in (tmp_path / "w").iterdir()}
    assert {f.name for f in full.iterdir()} - got == {"state_00000_000.bin"}, got
    a, _ = load_checkpoint(full)
    b, _ = load_checkpoint(tmp_path / "w")
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)

    code, out = run("download", f"{job_id}@2", "--to", str(tmp_path / "all"))
    assert code == 0 and {f.name for f in (tmp_path / "all").iterdir()} == {f.name for f in full.iterdir()}
    code, out = run("download", f"{job_id}@7", "--weights-only", "--to", str(tmp_path / "x"))
    assert code == 1 and "404" in out and "its checkpoints: 2" in out, out
    code, out = run("download", f"{job_id}@x")
    assert code == 1 and "JOB@STEP" in out, out
