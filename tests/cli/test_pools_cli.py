"""`megatrain pools apply|list|show` through CliRunner on the database: a pool file applied (one
pool or a list), shown with its hardware and its nodes (a lost one as such), and a bad file refused
with a red line naming the field."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from fixtures.cluster import seed_node
from sqlalchemy import update
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.db.models import Node, utcnow
from megatrain.db.session import session_scope

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

POOL = {
    "name": "h100",
    "accelerator": "NVIDIA H100 80GB HBM3",
    "device_memory_bytes": 80 << 30,
    "peak_tflops": {"bf16": 989.4, "fp8": 1979.0},
    "devices_per_node": 8,
    "nodes": 2,
    "intra_node_bandwidth_gbps": 450,
    "inter_node_bandwidth_gbps": 50,
}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_apply_list_show(db_url: str, tmp_path: Path) -> None:
    one = tmp_path / "h100.yaml"
    one.write_text(yaml.safe_dump(POOL))
    many = tmp_path / "more.yaml"
    many.write_text(yaml.safe_dump([{**POOL, "name": "a100", "accelerator": "NVIDIA A100"}]))
    code, out = run("pools", "apply", str(one), str(many))
    assert code == 0, out
    assert "pool 'h100' created" in out and "pool 'a100' created" in out
    code, out = run("pools", "apply", str(one))
    assert code == 0 and "pool 'h100' described" in out

    seed_node(db_url, 8, "h100", "gpu-1")
    seed_node(db_url, 8, "h100", "gpu-2")
    with session_scope(db_url) as s:
        long_ago = utcnow() - timedelta(minutes=5)
        s.execute(update(Node).where(Node.hostname == "gpu-2").values(status="lost", last_seen_at=long_ago))
    code, out = run("pools", "list")
    assert code == 0, out
    assert "h100: 1 node ready, 1 lost, 8 of 8 devices free" in out
    assert "a100: 0 nodes ready" in out
    assert "8 × NVIDIA H100 80GB HBM3 per node × 2 nodes, 80.0 GiB per device" in out
    assert "bf16 989.4, fp8 1,979" in out and "450 GB/s" in out

    code, out = run("pools", "show", "h100")
    assert code == 0, out
    assert "hardware (operator)" in out
    gpu1 = next(line for line in out.splitlines() if "gpu-1" in line)
    gpu2 = next(line for line in out.splitlines() if "gpu-2" in line)
    # Five minutes, and the seconds a loaded machine took to get here.
    assert "ready" in gpu1 and "lost" in gpu2 and re.search(r"\b3[0-2]\ds ago", gpu2), gpu2


def test_a_bad_file_is_one_red_line_naming_the_field(db_url: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump([POOL, {**POOL, "name": "x", "peak_tflops": {"bf16": 0}}]))
    code, out = run("pools", "apply", str(bad))
    assert code == 1
    assert f"invalid pool file {bad}" in out and "pools[1].peak_tflops.bf16" in out
    code, out = run("pools", "list")
    assert "h100" not in out  # nothing of a bad file is applied
    code, out = run("pools", "apply", str(tmp_path / "missing.yaml"))
    assert code == 1 and "cannot read" in out
    code, out = run("pools", "show", "nope")
    assert code == 1 and "pool 'nope' does not exist" in out
