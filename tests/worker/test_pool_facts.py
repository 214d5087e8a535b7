"""The local pool described by measurement (worker.pool_facts via worker.nodes): registering this
machine records a PoolSpec whose devices per node are its slots and whose peak is a measured matmul
rate, cached per host; a heartbeat reports devices, free memory and health (GPU nodes through
nvidia-smi, faked here)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import select

from megatrain.db.models import Node, NodePool
from megatrain.db.session import session_scope
from megatrain.scheduler.pools import pool_for
from megatrain.settings import Settings
from megatrain.worker import pool_facts
from megatrain.worker.nodes import ensure_local_pool
from megatrain.worker.pool_facts import heartbeat_values, measure_here


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_local_pool_is_described_by_measurement(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    url = settings.resolved_database_url
    settings = settings.model_copy(update={"cpu_slots": 2, "cache_dir": tmp_path / "cache"})
    with session_scope(url) as s:
        ensure_local_pool(s, settings, wait_for_facts=True)
    with session_scope(url) as s:
        pool = s.scalar(select(NodePool).where(NodePool.name == settings.pool_name))
        node = s.scalar(select(Node).where(Node.pool_id == pool.id))
        assert pool.spec_source == "measured"
        spec = pool_for(s, settings.pool_name)
    assert spec is not None and spec.is_cpu
    assert spec.devices_per_node == 2 == node.slots_total
    assert spec.device_memory_bytes == node.device_memory_bytes
    assert 0 < spec.peak("fp32") < 100  # TFLOP/s of one rank's share of a CPU
    [cached] = (tmp_path / "cache").glob("node_facts-*.json")
    facts = json.loads(cached.read_text())
    # Two slots: the ranks' gloo loopback is measured (else the documented constants stand).
    assert facts["links_from"] == "gloo loopback"
    assert spec.intra_node_bandwidth_gbps == facts["intra_node_bandwidth_gbps"] > 0
    assert spec.intra_node_latency_us == facts["intra_node_latency_us"] > 0
    assert spec.inter_node_bandwidth_gbps == pool_facts.CPU_LINK["inter_gbps"]

    # Cached per host: registering again measures nothing.
    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again")

    monkeypatch.setattr(pool_facts.subprocess, "run", no_subprocess)
    with session_scope(url) as s:
        ensure_local_pool(s, settings, wait_for_facts=True)
    with session_scope(url) as s:
        assert pool_for(s, settings.pool_name) == spec


def _fake_nvidia_smi(folder: Path, rows: str) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_heartbeat_values_cpu_and_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = heartbeat_values("cpu", 4, busy=1)
    assert cpu["devices_free"] == 3 and cpu["memory_free_bytes"] > 0
    assert cpu["health"] == {"ok": True, "devices": 4, "problems": []}

    # memory.used, memory.total in MiB: GPU 0 idle, GPU 1 busy.
    _fake_nvidia_smi(tmp_path, "100, 81920\\n40000, 81920\\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpu = heartbeat_values("NVIDIA H100 80GB HBM3", 2, busy=None)
    assert gpu["devices_free"] == 1
    assert gpu["memory_free_bytes"] == (81920 - 40000) << 20
    assert gpu["health"]["ok"]
    short = heartbeat_values("NVIDIA H100 80GB HBM3", 4, busy=None)
    assert short["health"] == {"ok": False, "devices": 2, "problems": ["2 of its 4 devices are visible"]}


def test_gpu_peaks_come_from_the_datasheet_table() -> None:
    pytest.importorskip("torch")
    facts = measure_here("NVIDIA H100 80GB HBM3", 8)
    assert facts["peak_tflops"] == {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}
    assert facts["intra_node_bandwidth_gbps"] == 450.0 and facts["links_from"] == "datasheet"
    assert measure_here("NVIDIA H100 PCIe", 2)["intra_node_bandwidth_gbps"] == pool_facts.PCIE_GBPS


@pytest.mark.gpu
def test_an_unlisted_gpu_is_measured() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    facts = measure_here("Some Future GPU", 1)
    assert facts["peak_tflops"]["bf16"] > 1.0
    name = torch.cuda.get_device_name()
    assert measure_here(name, 1)["peak_tflops"]


def test_facts_measured_beside_other_work_are_measured_again_in_the_background(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings.model_copy(update={"cache_dir": tmp_path / "cache"})
    key = pool_facts._key("cpu", 2)
    path = pool_facts._path(settings, key)
    path.parent.mkdir(parents=True)
    now = pool_facts.time.time()
    old = {"key": key, "peak_tflops": {"fp32": 0.02}, "contended": True, "measured_at": now}
    path.write_text(json.dumps(old))
    measured: list[int] = []

    def measure(settings: Settings, accelerator: str, slots: int) -> dict:
        measured.append(slots)
        path.write_text(json.dumps(old | {"peak_tflops": {"fp32": 0.05}, "contended": False}))
        return {}

    monkeypatch.setattr(pool_facts, "measure_facts", measure)
    # Young contended facts are served as they are.
    assert pool_facts.local_facts(settings, "cpu", 2, wait=False)["peak_tflops"] == {"fp32": 0.02}
    assert measured == []
    # Old ones too, while a background measurement replaces them.
    path.write_text(json.dumps(old | {"measured_at": now - pool_facts.REMEASURE_CONTENDED_S}))
    assert pool_facts.local_facts(settings, "cpu", 2, wait=False)["peak_tflops"] == {"fp32": 0.02}
    for thread in [t for t in pool_facts.threading.enumerate() if t.name == "measure-node"]:
        thread.join(10)
    assert measured == [2]
    fresh = pool_facts.local_facts(settings, "cpu", 2, wait=False)
    assert fresh["peak_tflops"] == {"fp32": 0.05} and not pool_facts.stale(fresh)
    assert pool_facts.stale(old | {"measured_at": 0}) and not pool_facts.stale(
        old | {"contended": False, "measured_at": 0}
    )
