"""The CPU's matmul peak: measured, cached per host/dtype/threads, and the denominator of CPU MFU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatrain.engine import calibrate
from megatrain.engine.metrics import peak_tflops, throughput
from megatrain.engine.train import run
from megatrain.settings import reset_settings_cache
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec


@pytest.fixture
def cache(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = megatrain_home.parent / "cache"
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(path))
    reset_settings_cache()
    return path


@pytest.fixture
def fake_measure(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Replaces the timing with a figure per dtype; records every measurement asked for."""
    calls: list[torch.dtype] = []
    figures = {torch.float32: 0.05, torch.bfloat16: 0.4, torch.float16: 0.3}

    def measure(dtype: torch.dtype) -> float:
        calls.append(dtype)
        return figures[dtype]

    monkeypatch.setattr(calibrate, "measure_matmul_tflops", measure)
    monkeypatch.setattr(calibrate, "OtherLoad", _Load)
    _Load.next_cores = 0.0
    return calls


class _Load:
    """hostinfo.OtherLoad with the other work's cores chosen by the test."""

    next_cores: float | None = 0.0

    def __enter__(self) -> _Load:
        self.cores = _Load.next_cores
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_measurement_is_a_positive_finite_rate() -> None:
    tflops = calibrate.measure_matmul_tflops(torch.float32)
    assert math.isfinite(tflops) and 0 < tflops < 1000  # no CPU process does a PFLOP/s


def test_measured_once_then_read_from_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = calibrate.cpu_peak_tflops("fp32")  # really timed
    assert first is not None and math.isfinite(first) and first > 0
    [file] = cache.glob("cpu_matmul_peak-fp32-*.json")
    entry = json.loads(file.read_text())
    assert entry["tflops"] == first and entry["key"]["threads"] == torch.get_num_threads()

    def no_timing(dtype: torch.dtype) -> float:
        raise AssertionError("the cached peak was measured again")

    monkeypatch.setattr(calibrate, "measure_matmul_tflops", no_timing)
    assert calibrate.cpu_peak_tflops("fp32") == first
    assert peak_tflops(None, "fp32") == first


def test_cache_key_separates_dtypes_and_threads(cache: Path, fake_measure: list[torch.dtype]) -> None:
    assert calibrate.cpu_peak_tflops("fp32") == 0.05
    assert calibrate.cpu_peak_tflops("bf16") == 0.4  # not fp32's cached figure
    assert calibrate.cpu_peak_tflops("fp32") == 0.05 and calibrate.cpu_peak_tflops("bf16") == 0.4
    assert fake_measure == [torch.float32, torch.bfloat16]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count is another peak
        calibrate.cpu_peak_tflops("fp32")
    finally:
        torch.set_num_threads(threads)
    assert fake_measure == [torch.float32, torch.bfloat16, torch.float32]
    assert len(list(cache.glob("*.json"))) == 3
    assert calibrate.cpu_peak_tflops("fp8") is None  # no CPU GEMM to time: no peak, not a guess


def test_damaged_or_foreign_cache_is_measured_again(cache: Path, fake_measure: list[torch.dtype]) -> None:
    calibrate.cpu_peak_tflops("fp32")
    [file] = cache.glob("*.json")
    file.write_text("{not json")
    assert calibrate.cpu_peak_tflops("fp32") == 0.05
    entry = json.loads(file.read_text())
    file.write_text(json.dumps({**entry, "key": {**entry["key"], "hostname": "elsewhere"}}))
    assert calibrate.cpu_peak_tflops("fp32") == 0.05
    assert len(fake_measure) == 3


def test_unwritable_cache_never_fails_the_run(
    megatrain_home: Path, monkeypatch: pytest.MonkeyPatch, fake_measure: list[torch.dtype]
) -> None:
    blocker = megatrain_home.parent / "a-file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(blocker / "cache"))
    reset_settings_cache()
    assert calibrate.cpu_peak_tflops("fp16") == 0.3
    assert calibrate.cpu_peak_tflops("fp16") == 0.3  # measured again: nothing could be kept
    assert len(fake_measure) == 2


def test_default_cache_dir_follows_xdg(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(megatrain_home.parent / "xdg"))
    assert calibrate.cache_dir() == megatrain_home.parent / "xdg" / "megatrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(megatrain_home.parent))
    assert calibrate.cache_dir() == megatrain_home.parent / ".cache" / "megatrain"


def test_cpu_mfu_is_achieved_over_calibrated(
    cache: Path, fake_measure: list[torch.dtype], tmp_path: Path, corpus: Path
) -> None:
    assert calibrate.cpu_peak_tflops("fp32") == 0.05
    r = throughput(flops_per_iter=1e10, tokens_per_iter=100, iter_time_s=0.5, world_size=1, peak=0.05)
    assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.05)
    # A run on this CPU divides by that same cached figure.
    run(parse_spec(tiny_spec(corpus, train_iters=2)), tmp_path / "out")
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "mfu" in r]
    assert rows and all(r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.05) for r in rows)
    assert fake_measure == [torch.float32]  # the run read the cache


def test_a_figure_taken_beside_other_work_is_taken_again_and_the_best_kept(
    cache: Path, fake_measure: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = iter([0.02, 0.01, 0.05, 0.03])
    monkeypatch.setattr(calibrate, "measure_matmul_tflops", lambda dtype: next(figures))
    clock = [1000.0]
    monkeypatch.setattr(calibrate.time, "time", lambda: clock[0])
    _Load.next_cores = 8.0  # every core busy with other work: the GEMMs got a share of them
    assert calibrate.cpu_peak("fp32")["contended"] is True
    assert calibrate.cpu_peak_tflops("fp32") == 0.02  # not measured again until REMEASURE_S passes
    clock[0] += calibrate.REMEASURE_S
    assert calibrate.cpu_peak_tflops("fp32") == 0.02  # 0.01, still contended: the better figure stands
    clock[0] += calibrate.REMEASURE_S
    _Load.next_cores = 0.0
    entry = calibrate.cpu_peak("fp32")
    assert entry["tflops"] == 0.05 and entry["contended"] is False  # quiet at last
    clock[0] += 10 * calibrate.REMEASURE_S
    assert calibrate.cpu_peak_tflops("fp32") == 0.05  # a quiet figure is never measured again
    assert next(figures) == 0.03


def test_other_load_counts_other_processes_not_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatrain import hostinfo

    busy, ours, wall = iter([100.0, 101.5]), iter([10.0, 10.5]), iter([0.0, 1.0])
    monkeypatch.setattr(hostinfo, "host_busy_s", lambda: next(busy))
    monkeypatch.setattr(hostinfo.time, "process_time", lambda: next(ours))
    monkeypatch.setattr(hostinfo.time, "perf_counter", lambda: next(wall))
    with hostinfo.OtherLoad() as load:
        pass
    # 1.5 s of the host's CPU in 1 s of wall time, 0.5 s of it ours: one core of other work.
    assert load.cores == pytest.approx(1.0)


def test_measuring_leaves_the_global_generator_alone() -> None:
    """A run's dropout draws from the global generator after its seed: a cold cache (this host
    measured during the run) must give the same masks as a warm one."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    calibrate.measure_matmul_tflops(torch.float32)
    assert torch.equal(torch.rand(4), expected)
