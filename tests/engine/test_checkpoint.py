from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.engine.checkpoint import (
    UnsafeCheckpoint,
    complete_steps,
    find_latest,
    load_checkpoint,
    model_state_for_save,
    plain_data,
    read_checkpoint,
    restore_training_state,
    save_checkpoint,
    write_checkpoint,
)
from megatrain.engine.config import train_config, transformer_config
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec


def _model_and_optimizer(raw: dict) -> tuple[GPTModel, torch.optim.Optimizer]:
    spec = parse_spec(raw)
    torch.manual_seed(0)
    model = GPTModel(transformer_config(spec, 257))
    opt = torch.optim.AdamW(model.parameters(), lr=train_config(spec, 1).lr)
    tokens = torch.randint(0, 257, (2, 33))
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_round_trip(tmp_path: Path, corpus: Path, arch: str) -> None:
    raw = tiny_spec(corpus)
    raw["model"].update(arch=arch, num_query_groups=None if arch == "gpt2" else 2)
    model, opt = _model_and_optimizer(raw)
    root = (tmp_path / "ckpt").as_uri()
    saved = save_checkpoint(root, 5, model, opt, {"consumed_samples": 40}, parse_spec(raw))
    folder = tmp_path / "ckpt" / "iter_0000005"
    assert saved.uri == folder.as_uri()
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "model.safetensors", "optimizer.pt", "spec.json", "trainer_state.json"
    ]  # fmt: skip
    manifest = json.loads((folder / "manifest.json").read_text())
    assert {e["name"] for e in manifest["files"]} == {
        "model.safetensors", "optimizer.pt", "spec.json", "trainer_state.json"
    }  # fmt: skip
    assert saved.size_bytes == sum(p.stat().st_size for p in folder.iterdir())
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "5"

    loaded, spec = load_checkpoint(folder)  # a plain path
    assert spec.model.arch == arch
    assert loaded.config == model.config
    if arch == "gpt2":
        assert loaded.lm_head.weight is loaded.embed.weight  # tying survives safetensors
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # A checkpoint root resolves to its latest complete step; a file:// URL works too.
    again, _ = load_checkpoint(root)
    assert torch.equal(again.embed.weight, model.embed.weight)

    model2, opt2 = _model_and_optimizer(raw)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    state = restore_training_state(root, 5, model2, opt2)
    assert state["consumed_samples"] == 40 and state["step"] == 5
    assert torch.equal(model2.embed.weight, model.embed.weight)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_incomplete_and_corrupt_folders(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus)
    model, opt = _model_and_optimizer(raw)
    root = (tmp_path / "ckpt").as_uri()
    for step in (3, 6):
        save_checkpoint(root, step, model, opt, {"consumed_samples": 0}, parse_spec(raw))
    assert find_latest(root) == 6
    (tmp_path / "ckpt" / "iter_0000006" / "manifest.json").unlink()  # a crash before the manifest
    assert complete_steps(root) == [3]
    assert find_latest(root) == 3  # `latest` still says 6, but that folder is incomplete
    model_file = tmp_path / "ckpt" / "iter_0000003" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="does not match its manifest"):
        load_checkpoint(tmp_path / "ckpt" / "iter_0000003")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nothing")


def test_exact_resume(tmp_path: Path, corpus: Path) -> None:
    """6 steps straight == 3 steps, a fresh process state resumed from step 3, then 3 more."""
    spec = parse_spec(tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=3))
    straight = tmp_path / "straight"
    run(spec, straight)
    losses = [r["loss"] for r in read_jsonl(straight / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6

    # Keep only the step-3 checkpoint: drop iter 6's manifest, as if the run died uploading it.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints", resumed / "checkpoints")
    (resumed / "checkpoints" / "iter_0000006" / "manifest.json").unlink()
    run(spec, resumed)
    rows = read_jsonl(resumed / "metrics.jsonl")
    assert [r["loss"] for r in rows if "loss" in r] == losses[3:]  # bit-identical on CPU fp32
    assert [r["consumed_samples"] for r in rows if "loss" in r] == [32, 40, 48]
    straight_val = [r["val_loss"] for r in read_jsonl(straight / "metrics.jsonl") if "val_loss" in r]
    assert [r["val_loss"] for r in rows if "val_loss" in r] == straight_val[1:]
    started = read_jsonl(resumed / "events.jsonl")[0]
    assert started["event"] == "started" and started["resumed_from"] == 3 and started["step"] == 3
    final_a, _ = load_checkpoint(straight / "checkpoints" / "iter_0000006")
    final_b, _ = load_checkpoint(resumed / "checkpoints" / "iter_0000006")
    for a, b in zip(final_a.state_dict().values(), final_b.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_s3_round_trip(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moto = pytest.importorskip("moto")
    import boto3

    monkeypatch.delenv("MEGATRAIN_S3_ENDPOINT_URL", raising=False)
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    raw = tiny_spec(corpus)
    model, opt = _model_and_optimizer(raw)
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="ckpts")
        root = "s3://ckpts/jobs/j1/checkpoints"
        saved = save_checkpoint(root, 2, model, opt, {"consumed_samples": 16}, parse_spec(raw))
        assert saved.uri == f"{root}/iter_0000002"
        assert find_latest(root) == 2
        loaded, spec = load_checkpoint(saved.uri)
        assert spec.name == "tiny"
        assert torch.equal(loaded.layers[1].mlp.fc2.weight, model.layers[1].mlp.fc2.weight)


class _WritesAMarker:
    """What an attacker with write access to storage could pickle: code that runs on unpickling."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")  # merely loading it creates the marker file


def _replace_file_and_manifest(folder: Path, name: str, payload: object) -> None:
    """Swap one file and re-sign the manifest, as someone able to write the bucket would."""
    torch.save(payload, folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == name:
            data = (folder / name).read_bytes()
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path: Path, corpus: Path) -> None:
    spec = parse_spec(tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=3))
    out = tmp_path / "run"
    run(parse_spec(tiny_spec(corpus, train_iters=3, checkpoint_interval=3, eval_interval=3)), out)
    folder = out / "checkpoints" / "iter_0000003"
    saved = torch.load(folder / "optimizer.pt", weights_only=True)  # what we write is plain data
    marker = tmp_path / "pwned"
    _replace_file_and_manifest(folder, "optimizer.pt", {**saved, "optimizer": _WritesAMarker(marker)})
    with pytest.raises(UnsafeCheckpoint, match=r"optimizer\.pt holds .* refusing .*io\.open"):
        run(spec, out)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpoint):
        read_checkpoint((out / "checkpoints").as_uri(), 3)
    assert not marker.exists()


def test_single_process_restore_loads_plain_data_only(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus)
    model, opt = _model_and_optimizer(raw)
    save_checkpoint(tmp_path.as_uri(), 1, model, opt, {"consumed_samples": 0}, parse_spec(raw))
    # Python's random state (nested tuples of ints) and torch's ByteTensor states load safely.
    extra = torch.load(tmp_path / "iter_0000001" / "optimizer.pt", weights_only=True)
    assert extra["rng"]["torch"].dtype == torch.uint8
    marker = tmp_path / "pwned"
    _replace_file_and_manifest(
        tmp_path / "iter_0000001", "optimizer.pt", {**extra, "rng": _WritesAMarker(marker)}
    )
    with pytest.raises(UnsafeCheckpoint):
        restore_training_state(tmp_path.as_uri(), 1, model, opt)
    assert not marker.exists()


def test_saved_data_is_made_plain_or_refused(tmp_path: Path, corpus: Path) -> None:
    np_state = np.random.get_state()  # ('MT19937', uint32 array, int, int, float)
    extra = {"rng": {"numpy": np_state, "python": random.getstate()}, "n": np.int64(3)}
    buf = io.BytesIO()
    torch.save(plain_data(extra), buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back["n"] == 3 and type(back["n"]) is int
    expected = np.random.rand(3)
    np.random.rand(5)
    np.random.set_state(back["rng"]["numpy"])  # the restored tuple is accepted as is
    assert np.array_equal(np.random.rand(3), expected)
    random.setstate(back["rng"]["python"])
    # An object that is not plain data is refused when saving, naming where it sits.
    raw = tiny_spec(corpus)
    model, _ = _model_and_optimizer(raw)
    with pytest.raises(TypeError, match=r"extra\['optimizer'\]\['hook'\] is a .*_WritesAMarker"):
        write_checkpoint(
            (tmp_path / "ckpt").as_uri(), 1, model_state_for_save(model), model.config,
            {"optimizer": {"hook": _WritesAMarker(tmp_path / "x")}}, {}, parse_spec(raw),
        )  # fmt: skip
    assert not (tmp_path / "ckpt").exists()  # nothing was uploaded
