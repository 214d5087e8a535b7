from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from megatrain.engine.checkpoint import (
    WEIGHT_FILES,
    CheckpointReader,
    CorruptCheckpoint,
    UnsupportedCheckpoint,
    complete_steps,
    find_latest,
    load_checkpoint,
    model_entries,
    open_folder,
    retained,
    save_model,
    save_state,
)
from megatrain.engine.checkpoint.shards import Box, Entry, flat_range_boxes
from megatrain.engine.config import transformer_config
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.train import run
from megatrain.spec import parse_spec
from megatrain.storage import open_store

from .helpers import read_jsonl, tiny_spec


def _model(raw: dict) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(transformer_config(parse_spec(raw), 257))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_round_trip(tmp_path: Path, corpus: Path, arch: str) -> None:
    raw = tiny_spec(corpus)
    raw["model"].update(arch=arch, num_query_groups=None if arch == "gpt2" else 2)
    model = _model(raw)
    root = (tmp_path / "ckpt").as_uri()
    saved = save_model(root, 5, model, parse_spec(raw), {"consumed_samples": 40})
    folder = tmp_path / "ckpt" / "iter_0000005"
    assert saved.uri == folder.as_uri()
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "metadata.json", "model_00000_000.bin", "spec.json", "trainer_state.json"
    ]  # fmt: skip
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "megatrain-checkpoint-v2" and manifest["step"] == 5
    names = {e["name"] for e in manifest["files"]}
    assert names == {"metadata.json", "model_00000_000.bin", "spec.json", "trainer_state.json"}
    assert (
        saved.size_bytes
        == sum(e["size"] for e in manifest["files"]) + (folder / "manifest.json").stat().st_size
    )
    assert (tmp_path / "ckpt" / "latest").read_text() == "5\n"

    loaded, spec = load_checkpoint(folder)  # a plain path
    assert spec.name == "tiny" and not loaded.training
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    reader = CheckpointReader(tmp_path / "ckpt")  # a root means its latest step
    assert reader.step == 5 and reader.model_config == model.config
    assert ("lm_head.weight" in reader.names()) == (arch == "llama")  # a tied head is stored once
    assert torch.equal(reader.tensor("layers.1.mlp.fc1.weight"), model.layers[1].mlp.fc1.weight)


def test_files_hold_raw_tensor_bytes_and_json(tmp_path: Path, corpus: Path) -> None:
    """Nothing in a checkpoint is a pickle: a box is the tensor's bytes at the offset metadata.json
    names, with its crc32."""
    raw = tiny_spec(corpus)
    model = _model(raw)
    save_model(tmp_path.as_uri(), 1, model, parse_spec(raw))
    folder = tmp_path / "iter_0000001"
    meta = json.loads((folder / "metadata.json").read_text())
    box = next(b for b in meta["boxes"] if b["fqn"] == "model/final_norm.weight")
    data = (folder / box["file"]).read_bytes()[box["at"] : box["at"] + box["length"]]
    assert data == model.final_norm.weight.detach().numpy().tobytes()
    assert zlib.crc32(data) == box["crc32"]
    assert meta["tensors"]["model/embed.weight"] == {
        "dtype": "float32", "size": [384, 32], "chunks": [{"offsets": [0, 0], "sizes": [384, 32]}]
    }  # fmt: skip


def test_a_rank_writes_parts_in_parallel(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus)
    model = _model(raw)
    save_state(tmp_path.as_uri(), 1, model_entries(model), {"model_config": model.config.to_dict()},
               parse_spec(raw), part_bytes=20_000)  # fmt: skip
    parts = sorted(p.name for p in (tmp_path / "iter_0000001").glob("model_*.bin"))
    assert len(parts) > 3 and parts[0] == "model_00000_000.bin"
    loaded, _ = load_checkpoint(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_latest_ignores_incomplete_and_names_corruption(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus)
    model = _model(raw)
    root = tmp_path / "ckpt"
    for step in (3, 6):
        save_model(root.as_uri(), step, model, parse_spec(raw))
    assert find_latest(root.as_uri()) == 6
    (root / "iter_0000006" / "manifest.json").unlink()  # died before its manifest
    assert complete_steps(root.as_uri()) == [3]
    assert find_latest(root.as_uri()) == 3  # `latest` still says 6, but that folder is incomplete
    shard = root / "iter_0000003" / "model_00000_000.bin"
    good = shard.read_bytes()

    shard.write_bytes(good[:-10])
    with pytest.raises(CorruptCheckpoint, match=r"model_00000_000\.bin is \d+ bytes but the manifest says"):
        load_checkpoint(root / "iter_0000003")
    flipped = bytearray(good)
    flipped[100] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(
        CorruptCheckpoint,
        match=r"model_00000_000\.bin \(bytes .* of model/embed\.weight\): the bytes do not match",
    ):
        load_checkpoint(root / "iter_0000003")
    with pytest.raises(CorruptCheckpoint, match=r"model_00000_000\.bin: sha256 mismatch \(manifest "):
        open_folder(root / "iter_0000003", deep=True)
    shard.unlink()
    with pytest.raises(CorruptCheckpoint, match=r"model_00000_000\.bin is missing"):
        load_checkpoint(root)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nothing")


def test_a_weights_only_copy_loads(tmp_path: Path, corpus: Path) -> None:
    """Without the optimizer state's files a checkpoint still loads as a model (a weights-only
    download), while a training resume needs every file."""
    spec = parse_spec(tiny_spec(corpus, train_iters=2, checkpoint_interval=2, eval_interval=0))
    run(spec, tmp_path / "run")
    full = tmp_path / "run" / "checkpoints" / "iter_0000002"
    copy = tmp_path / "weights" / "iter_0000002"
    copy.mkdir(parents=True)
    for f in full.iterdir():
        if f.name.startswith(WEIGHT_FILES):
            shutil.copy(f, copy / f.name)
    assert {f.name for f in full.iterdir()} - {f.name for f in copy.iterdir()} == {"state_00000_000.bin"}
    a, _ = load_checkpoint(full)
    b, _ = load_checkpoint(copy)
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    with pytest.raises(CorruptCheckpoint, match=r"state_00000_000\.bin is missing"):
        open_folder(copy)


def test_an_old_format_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    (folder / "manifest.json").write_text(
        json.dumps({"format": "megatrain-checkpoint-v1", "step": 1, "files": []})
    )
    with pytest.raises(
        UnsupportedCheckpoint, match="'megatrain-checkpoint-v1' checkpoint; this megatrain reads"
    ):
        load_checkpoint(tmp_path)


def test_flat_range_boxes_tile_the_range() -> None:
    shape = (3, 4, 5)
    for start, end in [(0, 60), (7, 8), (3, 57), (20, 40), (19, 41), (0, 1), (59, 60), (4, 26)]:
        seen = []
        for offsets, sizes in flat_range_boxes(shape, start, end):
            idx = torch.arange(60).view(shape)
            for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                idx = idx.narrow(d, o, s)
            flat = idx.reshape(-1).tolist()
            assert flat == list(range(flat[0], flat[0] + len(flat)))  # each box is contiguous
            seen += flat
        assert seen == list(range(start, end)), (start, end)


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


def test_resume_falls_back_past_a_corrupt_checkpoint(tmp_path: Path, corpus: Path) -> None:
    spec = parse_spec(tiny_spec(corpus, train_iters=6, checkpoint_interval=2, eval_interval=0))
    straight = tmp_path / "straight"
    run(spec, straight)
    losses = [r["loss"] for r in read_jsonl(straight / "metrics.jsonl") if "loss" in r]
    out = tmp_path / "run"
    shutil.copytree(straight / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / "iter_0000006" / "manifest.json").unlink()
    state = out / "checkpoints" / "iter_0000004" / "state_00000_000.bin"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the optimizer state
    state.write_bytes(bytes(data))
    run(spec, out)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["loss"] for r in rows if "loss" in r] == losses[2:]  # resumed from step 2, exactly
    events = read_jsonl(out / "events.jsonl")
    corrupt = [e for e in events if e["event"] == "checkpoint_corrupt"]
    assert [e["step"] for e in corrupt] == [4] and "do not match their checksum" in corrupt[0]["reason"]
    assert events[1]["event"] == "started" and events[1]["resumed_from"] == 2


def test_the_corrupt_fault_is_found_on_resume(tmp_path: Path, corpus: Path) -> None:
    """What an operator's `corrupt:` fault does to a checkpoint (megatrain.faults) is what a resume
    catches: the damaged checkpoint is skipped for the one before it."""
    from megatrain.faults import corrupt_checkpoint

    spec = parse_spec(tiny_spec(corpus, train_iters=4, checkpoint_interval=2, eval_interval=0))
    out = tmp_path / "run"
    run(spec, out)
    (out / "checkpoints" / "iter_0000004" / "manifest.json").unlink()  # as if it died saving 4
    before = {p.name: p.read_bytes() for p in (out / "checkpoints" / "iter_0000002").iterdir()}
    key = corrupt_checkpoint(open_store((out / "checkpoints" / "iter_0000002").as_uri()))
    after = {p.name: p.read_bytes() for p in (out / "checkpoints" / "iter_0000002").iterdir()}
    assert key is not None and [n for n in before if before[n] != after[n]] == [key]
    assert key == max(before, key=lambda n: len(before[n]) if n != "manifest.json" else -1)
    with pytest.raises(CorruptCheckpoint, match="do not match their checksum"):
        run(spec, out)  # its only complete checkpoint is damaged: nothing silent


def test_retention_policy() -> None:
    steps = list(range(10, 110, 10))
    assert retained(steps, 0, 0) == set(steps)  # keep_last=0: everything
    assert retained(steps, 2, 0) == {90, 100}
    assert retained(steps, 2, 40) == {40, 80, 90, 100}
    assert retained([], 3, 5) == set()


def test_retention_deletes_from_storage(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus, train_iters=8, checkpoint_interval=1, eval_interval=0,
                    checkpoint_keep_last=2, checkpoint_keep_every=4)  # fmt: skip
    run(parse_spec(raw), tmp_path / "out")
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "iter_0000004",
        "iter_0000007",
        "iter_0000008",
        "latest",
    ]
    deleted = [
        e["steps"]
        for e in read_jsonl(tmp_path / "out" / "events.jsonl")
        if e["event"] == "checkpoints_deleted"
    ]
    assert sorted(s for batch in deleted for s in batch) == [1, 2, 3, 5, 6]


_CRASH = """
import os, sys
from pathlib import Path
from megatrain.engine.checkpoint import dcp
from megatrain.engine.train import run
from megatrain.spec import load_spec

real = dcp.ShardWriter.write_data
def write_then_die(self, plan, planner):
    out = real(self, plan, planner)
    if self.store.url.endswith("iter_0000004"):
        os._exit(9)  # every shard is stored, the manifest is not: a crash mid-save
    return out
dcp.ShardWriter.write_data = write_then_die
run(load_spec(sys.argv[1]), Path(sys.argv[2]))
"""


def test_a_crash_during_an_async_save_leaves_no_complete_checkpoint(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=2, eval_interval=0)
    assert parse_spec(raw).training.async_checkpoint
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path / "spec.json"), str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ})  # fmt: skip
    assert proc.returncode == 9, proc.stderr[-2000:]
    folder = out / "checkpoints" / "iter_0000004"
    assert (folder / "model_00000_000.bin").exists() and not (folder / "manifest.json").exists()
    assert find_latest((out / "checkpoints").as_uri()) == 2
    run(parse_spec(raw), out)  # the retry resumes from step 2 and rewrites step 4 whole
    started = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "started"]
    assert started[-1]["resumed_from"] == 2
    assert complete_steps((out / "checkpoints").as_uri()) == [2, 4, 6]
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert steps[-4:] == [3, 4, 5, 6]


def test_s3_over_http(tmp_path: Path, corpus: Path, s3_bucket_url: str) -> None:
    """A real HTTP S3 endpoint (moto's server): a save whose file is large enough for a multipart
    upload reads back exactly (by byte ranges), and a training run saving to s3:// resumes exactly."""
    raw = tiny_spec(corpus)
    model = _model(raw)
    big = torch.randn(4096, 1024)  # 16 MiB: boto3 uploads it in parallel parts
    state = {**model_entries(model), "model/extra": Entry((4096, 1024), [Box((0, 0), big)])}
    root = f"{s3_bucket_url}/jobs/j1/checkpoints"
    save_state(root, 2, state, {"model_config": model.config.to_dict()}, parse_spec(raw))
    assert find_latest(root) == 2
    reader = CheckpointReader(root)
    assert torch.equal(reader.tensor("extra"), big)
    assert torch.equal(reader.tensor("layers.1.mlp.fc2.weight"), model.layers[1].mlp.fc2.weight)

    spec = parse_spec(tiny_spec(corpus, train_iters=4, checkpoint_interval=2, eval_interval=0))
    ckpts = f"{s3_bucket_url}/jobs/j2/checkpoints"
    run(spec, tmp_path / "straight", checkpoint_url=ckpts)
    losses = [r["loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    open_store(ckpts).delete_prefix("iter_0000004/manifest.json")  # as if step 4's save died
    run(spec, tmp_path / "resumed", checkpoint_url=ckpts)
    assert [r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == losses[2:]


def test_exact_resume_in_bf16_with_separate_main_weights(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 keeps fp32 main weights apart from the model's: both come back, bit for bit."""
    from megatrain.settings import reset_settings_cache

    monkeypatch.setenv("MEGATRAIN_CPU_LOW_PRECISION", "1")
    reset_settings_cache()
    spec = parse_spec(
        tiny_spec(corpus, train_iters=4, checkpoint_interval=2, eval_interval=0, precision="bf16")
    )
    run(spec, tmp_path / "straight")
    losses = [r["loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    meta = json.loads((tmp_path / "straight" / "checkpoints" / "iter_0000002" / "metadata.json").read_text())
    assert meta["tensors"]["model/embed.weight"]["dtype"] == "bfloat16"
    assert meta["tensors"]["optim/param/embed.weight"]["dtype"] == "float32"
    shutil.copytree(tmp_path / "straight" / "checkpoints", tmp_path / "resumed" / "checkpoints")
    (tmp_path / "resumed" / "checkpoints" / "iter_0000004" / "manifest.json").unlink()
    run(spec, tmp_path / "resumed")
    assert [r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == losses[2:]


def test_a_killed_run_resumes_exactly(tmp_path: Path, corpus: Path) -> None:
    """SIGKILL mid-run (perhaps mid-save), run again: every step's loss equals the uninterrupted run's."""
    raw = tiny_spec(corpus, train_iters=120, checkpoint_interval=7, eval_interval=0, log_interval=1)
    straight = run(parse_spec(raw), tmp_path / "straight")
    assert straight["step"] == 120
    ref = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "megatrain.engine.train",
        "--spec",
        str(tmp_path / "spec.json"),
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 30):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    killed_at = len(metrics.read_text().splitlines())
    assert killed_at < 120
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    rows = read_jsonl(metrics)
    resumed_from = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "started"][-1][
        "resumed_from"
    ]
    assert resumed_from is not None and resumed_from % 7 == 0 and resumed_from <= killed_at
    last = {r["step"]: r["loss"] for r in rows}  # a step run twice (after the checkpoint) counts once
    assert last == ref
    assert [r["step"] for r in rows[killed_at:]] == list(range(resumed_from + 1, 121))
