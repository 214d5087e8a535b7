"""Device utilization and memory rows reach the metrics endpoints the dashboard's charts read."""

from __future__ import annotations

from api_handle import Api

from megatrain.db.session import session_scope
from megatrain.worker.ingest import ingest_metrics

# Rows as the engine writes them (engine/device_stats.py): a CPU rank and a GPU rank.
CPU_ROW = {"step": 1, "loss": 3.0, "cpu_util": 97.5, "device_memory_used_bytes": 1 << 30,
           "device_memory_total_bytes": 8 << 30}  # fmt: skip
GPU_ROW = {"step": 2, "loss": 2.9, "gpu_util": 88.0, "device_memory_used_bytes": 60 << 30,
           "device_memory_total_bytes": 80 << 30}  # fmt: skip
KEYS = ("cpu_util", "gpu_util", "device_memory_used_bytes", "device_memory_total_bytes")


def test_utilization_reaches_the_metrics_endpoints(api: Api) -> None:
    job_id = api.submit()["id"]
    with session_scope(api.db_url) as s:
        assert ingest_metrics(s, job_id, [CPU_ROW, GPU_ROW]) == 2  # the worker's ingestion path
    # The dashboard asks for a downsampled series (?max_points); the SDK for the plain list.
    for query in ("", "?max_points=2000"):
        rows = api.client.get(f"/v1/jobs/{job_id}/metrics{query}", headers=api.headers).json()
        assert [{k: r[k] for k in KEYS if k in r} for r in rows] == [
            {k: row[k] for k in KEYS if k in row} for row in (CPU_ROW, GPU_ROW)
        ], query
