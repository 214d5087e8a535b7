from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatrain.engine.checkpoint import read_weights
from megatrain.engine.config import train_config
from megatrain.engine.optimizer import lr_at
from megatrain.engine.train import EXIT_USAGE, UnsupportedLayout, main, run
from megatrain.spec import parse_spec

from .helpers import assert_adam_weights_close, read_jsonl, tiny_spec, torchrun

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
               "model_state_bytes", "measured_params_bytes", "measured_grads_bytes",
               "measured_optimizer_bytes", "process_rss_bytes", "iter_time_s", "consumed_samples",
               "time", "skipped_iters", "data_time_s", "forward_time_s", "backward_time_s",
               "grad_sync_time_s", "optimizer_time_s", "cpu_util", "device_memory_used_bytes",
               "device_memory_total_bytes", "host_other_cores", "host_job_cores", "host_cores",
               "host_under_load", "token_accuracy", "trained_tokens"}  # fmt: skip
SPREAD_KEYS = {"rank_busy_time_min_s", "rank_busy_time_median_s", "rank_busy_time_max_s", "slowest_rank",
               "rank_wait_time_max_s"}  # fmt: skip
"""Several ranks: each rank's own work and waiting per step (engine.stragglers)."""
PIPELINE_KEYS = {"pipeline_bubble_fraction", "pipeline_wait_time_s", "pipeline_compute_time_s",
                 "pipeline_max_stage_wait_time_s"}  # fmt: skip


def _cfg(corpus: Path, **kw):
    return train_config(parse_spec(tiny_spec(corpus, **kw)), 1)


def test_lr_schedules(corpus: Path) -> None:
    cos = _cfg(corpus, train_iters=110, warmup_iters=10, lr=1.0, min_lr=0.1, lr_schedule="cosine")
    assert [lr_at(s, cos) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert lr_at(60, cos) == pytest.approx(0.55)  # halfway through the decay
    assert lr_at(110, cos) == pytest.approx(0.1)
    lin = _cfg(corpus, train_iters=110, warmup_iters=10, lr=1.0, min_lr=0.1, lr_schedule="linear")
    assert lr_at(60, lin) == pytest.approx(0.55) and lr_at(35, lin) == pytest.approx(0.775)
    const = _cfg(corpus, train_iters=110, warmup_iters=0, lr=1.0, min_lr=0.1, lr_schedule="constant")
    assert {lr_at(s, const) for s in range(1, 111)} == {1.0}


def test_unsupported_layout_exits_with_a_clear_message(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tiny_spec(corpus)
    raw["parallelism"] = {"pp": 2, "virtual_stages": 2}  # 2 layers cannot make 4 chunks
    raw["resources"] = {"devices": 2}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    assert main(["--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "out")]) == EXIT_USAGE
    assert "pipeline_layers for an uneven split" in capsys.readouterr().err
    # Nothing ran: the run folder holds only the failure's record (a user error: not retried).
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["failure.rank0.json"]
    assert json.loads((tmp_path / "out" / "failure.rank0.json").read_text())["kind"] == "user"


def test_layout_needing_more_processes_names_the_numbers(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus)
    raw["parallelism"] = {"tp": 2, "dp": 2}
    raw["resources"] = {"devices": 4}
    with pytest.raises(UnsupportedLayout, match="needs 4 processes but 1 were started"):
        run(parse_spec(raw), tmp_path / "out")


def test_an_auto_micro_batch_size_runs_as_the_largest_up_to_4(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tiny_spec(corpus, train_iters=1, warmup_iters=0, global_batch_size=6, micro_batch_size="auto",
                    eval_interval=0)  # fmt: skip
    run(parse_spec(raw), tmp_path / "out")  # the engine on its own: no planner chose one
    assert "2 micro-batches of 3 per dp rank" in capsys.readouterr().out


def test_bad_spec_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "spec.json").write_text(json.dumps({"name": "x"}))
    assert main(["--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "out")]) == EXIT_USAGE
    assert "data" in capsys.readouterr().err


def test_loss_decreases_and_gpt2_trains(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus, train_iters=30, log_interval=10, eval_interval=0, checkpoint_interval=0,
                    lr=1e-2, warmup_iters=3, lr_schedule="constant")  # fmt: skip
    raw["model"].update(arch="gpt2", num_query_groups=None)
    summary = run(parse_spec(raw), tmp_path / "out")
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")]
    assert summary["step"] == 30 and len(losses) == 3
    assert losses[-1] < 0.7 * losses[0]
    # checkpoint_interval=0 still saves at the end.
    assert (tmp_path / "out" / "checkpoints" / "iter_0000030" / "manifest.json").exists()


LAYOUTS = {
    "dp2": ({"dp": 2}, 2),
    "dp2-no-distopt": ({"dp": 2, "distributed_optimizer": False, "grad_bucket_elements": 2000}, 2),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, 2),
    "tp2-dp2": ({"tp": 2, "dp": 2, "grad_bucket_elements": 3000}, 4),
    "pp2-tp2-sp": ({"pp": 2, "tp": 2, "dp": 1, "sequence_parallel": True}, 4),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchrun_layouts_match_single_process(tmp_path: Path, corpus: Path, layout: str) -> None:
    """torchrun with gloo ranks in each layout reproduces the single-process run on the same batches.

    Every layout sees the same 8 samples per step. Only the fp32 summation order differs (split
    matmuls under tp, gradients summed across ranks under dp; ~1e-7 relative per element), and
    Adam's normalised update keeps parameter differences at that scale: measured, losses agree to
    ~1e-6 relative over these 6 steps. 1e-4 leaves room for other thread counts and BLAS builds,
    while a sharding mistake (a rank seeing the wrong samples, a missing average, a wrong shard)
    moves the loss by more than 1e-2.
    """
    parallelism, nproc = LAYOUTS[layout]
    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=3, log_interval=1)
    single = run(parse_spec(raw), tmp_path / "single")
    assert single["step"] == 6
    raw["parallelism"] = parallelism
    raw["resources"] = {"devices": nproc}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    proc = torchrun(nproc, tmp_path / "spec.json", tmp_path / "par")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    ref = read_jsonl(tmp_path / "single" / "metrics.jsonl")
    got = read_jsonl(tmp_path / "par" / "metrics.jsonl")
    train_rows = [r for r in got if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    keys = METRIC_KEYS | SPREAD_KEYS | (PIPELINE_KEYS if parallelism.get("pp", 1) > 1 else set())
    assert all(set(r) == keys for r in train_rows), set(train_rows[0]) ^ keys
    if parallelism.get("pp", 1) > 1:
        assert all(0 < r["pipeline_bubble_fraction"] < 1 for r in train_rows)
    for a, b in zip([r for r in ref if "loss" in r], train_rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["lr"] == a["lr"] and b["consumed_samples"] == a["consumed_samples"]
        # Counted on the last stage, summed over dp, once per tp group: a near-tie may flip a token.
        assert b["token_accuracy"] == pytest.approx(a["token_accuracy"], abs=2e-3)
    assert [r for r in ref if "loss" in r][-1]["token_accuracy"] > 0.05  # the corpus's commonest bytes
    val_ref = [r["val_loss"] for r in ref if "val_loss" in r]
    val_got = [r["val_loss"] for r in got if "val_loss" in r]
    assert len(val_got) == 2 and val_got == pytest.approx(val_ref, rel=1e-4)

    # A 'straggler' event is the host's timing (one rank 1.3x slower for 3 steps on a loaded 2-core
    # machine), not the layout's: tests/engine/test_stragglers.py judges those.
    everything = read_jsonl(tmp_path / "par" / "events.jsonl")
    # Each validation pause is timed for the goodput ledger (the worker keeps it off the job's events).
    assert [e["step"] for e in everything if e["event"] == "evaluated"] == [3, 6]
    events = [e for e in everything if e["event"] not in ("straggler", "evaluated")]
    kinds = [e["event"] for e in events]
    assert kinds == ["started", "checkpoint_saved", "checkpoint_saved", "finished"]
    assert events[0]["world_size"] == nproc and events[0]["layout"]["tp"] == parallelism.get("tp", 1)
    assert events[0]["resumed_from"] is None
    assert events[0]["num_params"] == read_jsonl(tmp_path / "single" / "events.jsonl")[0]["num_params"]
    assert [e["step"] for e in events[1:]] == [3, 6, 6]
    if parallelism.get("pp", 1) == 1:  # (with pp, rank 0 is one stage; the estimate the worst one)
        # Rank 0's measured model state, sharded by tp (and by dp with the distributed optimizer),
        # is the planner's static part for the layout.
        est = events[0]["memory_estimate"]
        planned = est["params_bytes"] + est["grads_bytes"] + est["optimizer_bytes"]
        assert train_rows[-1]["model_state_bytes"] == pytest.approx(planned, rel=0.10)
    ckpts = tmp_path / "par" / "checkpoints"
    assert events[2]["uri"] == (ckpts / "iter_0000006").as_uri()
    assert (ckpts / "latest").read_text().strip() == "6"
    assert "step 6/6" in proc.stdout and proc.stdout.count("step 1/6") == 1  # rank 0 logs only

    # The checkpoint holds full single-device weights whatever the layout: equal to the reference's.
    mine, _ = read_weights(ckpts / "iter_0000006")
    theirs, _ = read_weights(tmp_path / "single" / "checkpoints" / "iter_0000006")
    assert_adam_weights_close(mine, theirs, lr=raw["training"]["lr"], steps=6)


@pytest.mark.distributed
def test_resume_in_another_layout(tmp_path: Path, corpus: Path) -> None:
    """A single-process checkpoint resumes under tp=2 × dp=2 and continues as the single run did."""
    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=0, log_interval=1)
    run(parse_spec(raw), tmp_path / "single")
    resumed = tmp_path / "par" / "checkpoints"
    shutil.copytree(tmp_path / "single" / "checkpoints" / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3\n")
    raw["parallelism"] = {"tp": 2, "dp": 2}
    raw["resources"] = {"devices": 4}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    proc = torchrun(4, tmp_path / "spec.json", tmp_path / "par")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "par" / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == [4, 5, 6]
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=1e-4)
    assert read_jsonl(tmp_path / "par" / "events.jsonl")[0]["resumed_from"] == 3


@pytest.mark.distributed
def test_pipeline_resumes_a_single_process_checkpoint_and_back(tmp_path: Path, corpus: Path) -> None:
    """pp=2 × dp=2 (GPT-2, tied embeddings, distributed optimizer) resumes a one-process checkpoint at
    step 3; one process resumes the pipeline's step-5 checkpoint; both continue the reference run."""
    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=0, log_interval=1)
    raw["model"].update(arch="gpt2", num_query_groups=None)
    run(parse_spec(raw), tmp_path / "single")
    ref = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if "loss" in r}
    par = tmp_path / "par" / "checkpoints"
    shutil.copytree(tmp_path / "single" / "checkpoints" / "iter_0000003", par / "iter_0000003")
    (par / "latest").write_text("3\n")
    raw["training"]["checkpoint_interval"] = 1
    raw["parallelism"] = {"pp": 2, "dp": 2, "distributed_optimizer": True}
    raw["resources"] = {"devices": 4}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    proc = torchrun(4, tmp_path / "spec.json", tmp_path / "par")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "par" / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == [4, 5, 6]
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=1e-4)

    back = tmp_path / "back" / "checkpoints"
    shutil.copytree(par / "iter_0000005", back / "iter_0000005")
    (back / "latest").write_text("5\n")
    raw["parallelism"], raw["resources"] = "auto", {"devices": 1}
    run(parse_spec(raw), tmp_path / "back")
    again = [r for r in read_jsonl(tmp_path / "back" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in again] == [6]
    assert again[0]["loss"] == pytest.approx(ref[6], rel=1e-4)


def test_sigterm_exits_promptly(tmp_path: Path, corpus: Path) -> None:
    raw = tiny_spec(corpus, train_iters=100_000, log_interval=1, eval_interval=0, checkpoint_interval=0)
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megatrain.engine.train", "--spec", str(tmp_path / "spec.json"),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert time.monotonic() - sent < 5
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "terminated (SIGTERM)" in err
    assert not any(e["event"] == "finished" for e in read_jsonl(out / "events.jsonl"))


def test_finetune_starts_from_a_jobs_checkpoint(tmp_path: Path, corpus: Path, megatrain_home: Path) -> None:
    """model.init_from=checkpoint:JOB resolves through {storage}/jobs/JOB/checkpoints."""
    storage = megatrain_home / "storage"
    pre = parse_spec(
        tiny_spec(corpus, train_iters=12, log_interval=12, eval_interval=0, checkpoint_interval=6)
    )
    run(pre, tmp_path / "pre", checkpoint_url=(storage / "jobs" / "job-1" / "checkpoints").as_uri())

    raw = tiny_spec(
        corpus, train_iters=1, warmup_iters=0, log_interval=1, eval_interval=0, checkpoint_interval=0
    )
    scratch = run(parse_spec(raw), tmp_path / "scratch")
    raw.update(kind="finetune")
    raw["model"]["init_from"] = "checkpoint:job-1@6"
    run(parse_spec(raw), tmp_path / "tuned")
    first = {name: read_jsonl(tmp_path / name / "metrics.jsonl")[0]["loss"] for name in ("scratch", "tuned")}
    assert scratch["step"] == 1
    assert first["tuned"] < first["scratch"] - 0.5  # it starts from the trained weights
    started = read_jsonl(tmp_path / "tuned" / "events.jsonl")[0]
    assert started["resumed_from"] is None and started["step"] == 0  # a new run, not a resume


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_runs_track_fp32(
    tmp_path: Path, corpus: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16/fp16 weights with fp32 main weights train like fp32 (CPU emulation forced on).

    bf16 keeps 8 mantissa bits, so per-step logits differ by ~1e-2 relative from fp32; over 6 steps
    the losses stay within 3% (measured ≤1%), while a broken main-weight copy or unscaling would
    leave the loss flat or blow it up. fp16 also reports its loss scale.
    """
    from megatrain.settings import reset_settings_cache

    monkeypatch.setenv("MEGATRAIN_CPU_LOW_PRECISION", "1")
    reset_settings_cache()
    raw = tiny_spec(corpus, train_iters=6, eval_interval=0, checkpoint_interval=0, log_interval=1)
    run(parse_spec(raw), tmp_path / "fp32")
    raw["training"]["precision"] = precision
    run(parse_spec(raw), tmp_path / precision)
    ref = [r["loss"] for r in read_jsonl(tmp_path / "fp32" / "metrics.jsonl")]
    rows = read_jsonl(tmp_path / precision / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(ref, rel=3e-2)
    assert rows[-1]["loss"] < 0.9 * rows[0]["loss"]
    assert read_jsonl(tmp_path / precision / "events.jsonl")[0]["precision"] == precision
    if precision == "fp16":
        assert all(r["loss_scale"] >= 1 for r in rows) and sum(r["skipped_iters"] for r in rows) <= 2
    weights, _ = read_weights(tmp_path / precision / "checkpoints" / "iter_0000006")
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert {t.dtype for t in weights.values()} == {expected}


def test_recompute_matches_no_recompute(tmp_path: Path, corpus: Path) -> None:
    """Full (every 2nd layer) and selective recompute change memory, not the numbers: same losses."""
    raw = tiny_spec(corpus, train_iters=4, eval_interval=0, checkpoint_interval=0, log_interval=1)
    raw["model"].update(hidden_dropout=0.1, attention_dropout=0.1)
    run(parse_spec(raw), tmp_path / "none")
    ref = [r["loss"] for r in read_jsonl(tmp_path / "none" / "metrics.jsonl")]
    for mode, every in (("full", 2), ("selective", 1)):
        raw["training"].update(recompute=mode, recompute_every=every)
        run(parse_spec(raw), tmp_path / mode)
        got = [r["loss"] for r in read_jsonl(tmp_path / mode / "metrics.jsonl")]
        assert got == pytest.approx(ref, rel=1e-6), mode


def test_compiled_layers_train_like_eager(tmp_path: Path, corpus: Path) -> None:
    """training.compile: per-block torch.compile gives the eager losses (fp32, inductor's fused
    elementwise kernels round differently in the last bits)."""
    eager = tiny_spec(corpus, eval_interval=0, checkpoint_interval=0)
    compiled = tiny_spec(corpus, eval_interval=0, checkpoint_interval=0, compile=True)
    from torch._dynamo.utils import counters

    run(parse_spec(eager), tmp_path / "eager")
    counters.clear()
    run(parse_spec(compiled), tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo did capture the blocks
    ref = [r["loss"] for r in read_jsonl(tmp_path / "eager" / "metrics.jsonl")]
    got = [r["loss"] for r in read_jsonl(tmp_path / "compiled" / "metrics.jsonl")]
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=1e-4)
    started = next(e for e in read_jsonl(tmp_path / "compiled" / "events.jsonl") if e["event"] == "started")
    assert started["compile"] is True
