"""GET /v1/jobs/{id}/profile: the traces the engine copies next to a job's checkpoints, as a tar (or
presigned URLs) and one rank's trace at a time; 404s say why; another tenant's job is not found."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

from api_handle import Api

from megatrain.storage import open_store


def _write_traces(api: Api, job_id: str, ranks: int) -> dict[str, bytes]:
    store = open_store(api.settings.resolved_storage_url)
    files = {}
    for rank in range(ranks):
        trace = {"traceEvents": [{"name": f"ProfilerStep#{rank}", "ph": "X", "ts": 0, "dur": 1}]}
        files[f"trace.rank{rank}.json.gz"] = gzip.compress(json.dumps(trace).encode())
        store.put_bytes(f"jobs/{job_id}/profile/trace.rank{rank}.json.gz", files[f"trace.rank{rank}.json.gz"])
    return files


def test_traces_download_whole_and_one_rank_at_a_time(api: Api) -> None:
    job_id = api.submit()["id"]
    url = f"/v1/jobs/{job_id}/profile"
    missing = api.client.get(url, headers=api.headers)
    assert missing.status_code == 404
    assert missing.json()["detail"] == (
        f"job {job_id} has no profiler traces yet (they need training.profile_steps in its spec)"
    )
    files = _write_traces(api, job_id, 2)

    resp = api.client.get(url, headers=api.headers)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-tar"
    assert resp.headers["content-disposition"] == f'attachment; filename="{job_id}-profile.tar"'
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert got == {f"profile/{n}": d for n, d in files.items()}

    one = api.client.get(f"{url}/trace.rank1.json.gz", headers=api.headers)
    assert one.status_code == 200 and one.headers["content-type"] == "application/gzip"
    assert one.content == files["trace.rank1.json.gz"]
    assert json.loads(gzip.decompress(one.content))["traceEvents"][0]["name"] == "ProfilerStep#1"
    assert one.headers["content-disposition"] == f'attachment; filename="{job_id}-trace.rank1.json.gz"'

    absent = api.client.get(f"{url}/trace.rank7.json.gz", headers=api.headers)
    assert absent.status_code == 404 and "trace.rank0.json.gz, trace.rank1.json.gz" in absent.json()["detail"]
    for bad in ("..%2Fcheckpoints", "trace.rank0.json", "metrics.jsonl"):
        resp = api.client.get(f"{url}/{bad}", headers=api.headers)
        assert resp.status_code == 404, bad
    # Another tenant's job is not found, its traces not served.
    assert api.client.get(url, headers=api.other_headers).status_code == 404
    assert api.client.get(f"{url}/trace.rank0.json.gz", headers=api.other_headers).status_code == 404
