"""`megatrain plan SPEC [--pool POOL] [--json]`: offline with a pool file, else through the API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app

POOL = {
    "name": "h100",
    "accelerator": "NVIDIA H100 80GB HBM3",
    "device_memory_bytes": 80 << 30,
    "peak_tflops": {"bf16": 989.0},
    "devices_per_node": 8,
    "nodes": 4,
    "intra_node_bandwidth_gbps": 450.0,
    "inter_node_bandwidth_gbps": 50.0,
}
SPEC = {
    "name": "planned",
    "model": {"arch": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_query_groups": 8, "seq_length": 4096, "vocab_size": 128256},
    "data": {"train": [{"dataset": "corpus"}]},
    "training": {"global_batch_size": 256, "micro_batch_size": 1, "precision": "bf16"},
    "resources": {"devices": 32},
}  # fmt: skip


def _files(tmp_path: Path, spec: dict[str, Any] = SPEC, pool: dict[str, Any] = POOL) -> tuple[str, str]:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    return str(tmp_path / "spec.yaml"), str(tmp_path / "pool.yaml")


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_offline_plan_shows_the_layout_prediction_and_runners_up(tmp_path: Path) -> None:
    spec, pool = _files(tmp_path)
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 0, out
    first = out.splitlines()[0]
    assert first.startswith("tp=") and "on 32 devices of pool h100 (bf16)" in first
    assert "predicted:" in out and "tok/s" in out and "MFU" in out and "GiB per device" in out
    assert "runners-up" in out and "considered" in out

    code, out = _run("plan", spec, "--pool", pool, "--json")
    assert code == 0, out
    body = json.loads(out)
    lay = body["layout"]
    assert lay["tp"] * lay["pp"] * lay["dp"] == 32 and lay["tp"] <= 8
    assert {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_per_gpu_bytes"} <= set(
        body["predicted"]
    )
    assert body["parameters"]["total"] == body["parameters"]["active"] > 0  # dense: every weight is active


def test_offline_plan_of_an_moe_shows_ep_and_active_parameters(tmp_path: Path) -> None:
    model = {**SPEC["model"], "num_layers": 8, "moe": {"num_experts": 8, "router_topk": 2}}
    spec, pool = _files(tmp_path, spec={**SPEC, "model": model})
    code, out = _run("plan", spec, "--pool", pool, "--json")
    assert code == 0, out
    body = json.loads(out)
    lay, params = body["layout"], body["parameters"]
    assert lay["tp"] * lay["pp"] * lay["dp"] * lay["cp"] == 32 and 8 % lay["ep"] == 0
    assert (lay["dp"] * lay["cp"]) % lay["ep"] == 0
    assert 0 < params["active"] < params["total"] / 2
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 0 and "B active per token" in out, out


def test_a_small_model_is_counted_in_millions_on_one_device(tmp_path: Path) -> None:
    # examples/moe.yaml's model on one device: no "parameters: 0.00B" and no "on 1 devices".
    example = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "moe.yaml").read_text())
    spec, pool = _files(tmp_path, spec={**SPEC, "model": example["model"], "resources": {"devices": 1}})
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 0, out
    assert "on 1 device of pool" in out
    assert "parameters: 1.78M, 974K active per token" in out


def test_offline_plan_of_a_lora_spec_shows_trainable_parameters(tmp_path: Path) -> None:
    training = {**SPEC["training"], "method": "lora", "lora": {"rank": 16}}
    spec, pool = _files(tmp_path, spec={**SPEC, "training": training})
    code, out = _run("plan", spec, "--pool", pool, "--json")
    assert code == 0, out
    params = json.loads(out)["parameters"]
    assert 0 < params["trainable"] < params["total"] / 100  # rank-16 adapters on every linear
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 0, out
    assert "trainable: 36.7M LoRA adapter parameters of 6.73B (0.55%); the base's 6.7B are frozen" in out


def test_offline_an_unknown_field_is_told_the_nearest_one(tmp_path: Path) -> None:
    spec, pool = _files(tmp_path, spec={**SPEC, "training": {**SPEC["training"], "trainiters": 5}})
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 1 and "training.trainiters: unknown field; did you mean train_iters?" in out, out
    spec, pool = _files(tmp_path, pool={**POOL, "acelerator": "x"})
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 1 and "acelerator: unknown field; did you mean accelerator?" in out, out


def test_offline_errors_are_red_lines(tmp_path: Path) -> None:
    spec, pool = _files(tmp_path, pool={**POOL, "devices_per_node": 0})
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 1 and "Traceback" not in out
    assert "invalid pool" in out and "devices_per_node:" in out

    big = {
        **SPEC,
        "model": {**SPEC["model"], "num_layers": 1, "hidden_size": 65536, "num_attention_heads": 64},
    }
    spec, pool = _files(tmp_path, spec={**big, "resources": {"devices": 8}})
    code, out = _run("plan", spec, "--pool", pool)
    assert code == 1 and "Traceback" not in out
    assert "cannot plan" in out and "no layout of 8 devices fits" in out

    code, out = _run("plan", str(tmp_path / "missing.yaml"), "--pool", pool)
    assert code == 1 and "no such file" in out


def test_plan_through_the_api(live_api: LiveApi, tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(live_api.spec("via-api")))
    code, out = _run("plan", str(path), "--json")
    assert code == 0, out
    body = json.loads(out)
    assert body["pool"] == "default" and body["devices"] == 1 and body["layout"]["tp"] == 1

    bad = live_api.spec("bad-plan")
    bad["training"]["global_batch_size"] = 3  # micro_batch_size 2 does not divide it
    path.write_text(json.dumps(bad))
    code, out = _run("plan", str(path))
    assert code == 1 and "Traceback" not in out
    assert "spec.training.global_batch_size" in out
