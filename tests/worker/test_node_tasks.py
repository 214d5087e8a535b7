"""A pool's background work (dataset preprocessing, exports, samples) taken by a node that holds only
a node token: /v1/node/tasks (api/node/tasks.py) over megatrain.attempts.tasks, and the worker's
side (worker.task_link.HttpTasks). The Celery path, a token worker exporting from its pool's shared
queue, is in test_checkpoint_tasks_celery.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fixtures.cluster import seed_job
from fixtures.node_api import Api
from sqlalchemy import select, update
from worker_helpers import add_row, get_row

from megatrain.api.app import create_app
from megatrain.db.models import PENDING, PROCESSING, READY, CheckpointSample, Dataset, NodePool
from megatrain.db.node_tokens import create_attempt_token, create_node_token
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.storage import open_store
from megatrain.worker.datasets import preprocess_dataset


def _dataset(settings: Settings, texts: list[str] | None = None) -> str:
    """A pending dataset as POST /v1/datasets leaves it (its source stored in its folder)."""
    storage = settings.resolved_storage_url
    ident = add_row(
        settings, Dataset, name="corpus", state=PENDING, source_url="", prefix_url="",
        tokenizer={"type": "byte"}, uploaded=True,
    )  # fmt: skip
    folder = f"datasets/corpus/{ident}"
    lines = "".join(f'{{"text": "{t}"}}\n' for t in (texts or ["alpha beta", "gamma delta", "epsilon"]))
    open_store(storage).put_bytes(f"{folder}/source.jsonl", lines.encode())
    with session_scope(settings.resolved_database_url) as s:
        s.execute(
            update(Dataset)
            .where(Dataset.id == ident)
            .values(source_url=f"{storage}/{folder}/source.jsonl", prefix_url=f"{storage}/{folder}/data")
        )
    return ident


def _tokens(db_url: str, job_id: str) -> dict[str, str]:
    with session_scope(db_url) as s:
        out = {node: create_node_token(s, "default", node)[1] for node in ("node-a", "node-b")}
        pool_id = s.scalar(select(NodePool.id).where(NodePool.name == "default"))
        out["attempt"] = create_attempt_token(s, job_id, pool_id, ttl_s=600)
        return out


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def _call(client: TestClient, token: str, path: str, body: dict[str, Any] | None = None) -> Any:
    auth = {"Authorization": f"Bearer {token}"}
    if body is None:
        return client.get(f"/v1/node/tasks{path}", headers=auth)
    return client.post(f"/v1/node/tasks{path}", json=body, headers=auth)


def test_a_node_claims_beats_and_finishes_a_task_and_nothing_more(
    settings: Settings, db_url: str, client: TestClient
) -> None:
    ident = _dataset(settings)
    job_id = seed_job(db_url, 1)
    tokens = _tokens(db_url, job_id)
    sample = add_row(settings, CheckpointSample, job_id=job_id, step=1, prompt="hi", status=PENDING)

    claimed = _call(client, tokens["node-a"], f"/dataset/{ident}/claim", {"pid": 77, "values": {}})
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["attempt"] == 1 and claimed.json()["row"]["tokenizer"] == {"type": "byte"}
    row = get_row(settings, Dataset, ident)
    assert (row.state, row.runner_host, row.runner_pid) == (PROCESSING, "node-a", 77)
    # One claim wins; the loser is told so, not refused.
    again = _call(client, tokens["node-b"], f"/dataset/{ident}/claim", {"pid": 78})
    assert again.json() == {"attempt": None, "row": None}

    progress = {"attempt": 1, "values": {"state_reason": "10 documents"}}
    assert _call(client, tokens["node-a"], f"/dataset/{ident}/beat", progress).json() == {"mine": True}
    assert get_row(settings, Dataset, ident).state_reason == "10 documents"
    # Another node's token cannot write to a row this node holds.
    assert _call(client, tokens["node-b"], f"/dataset/{ident}/beat", progress).json() == {"mine": False}
    done = {"attempt": 1, "outcome": READY, "values": {"documents": 3}}
    assert _call(client, tokens["node-b"], f"/dataset/{ident}/finish", done).json() == {"mine": False}
    # A node writes progress and outcomes, never the row's other columns or states.
    bad = _call(
        client, tokens["node-a"], f"/dataset/{ident}/beat", {"attempt": 1, "values": {"tenant_id": "x"}}
    )
    assert bad.status_code == 422 and "tenant_id" in bad.text
    pending = _call(client, tokens["node-a"], f"/dataset/{ident}/finish", done | {"outcome": PENDING})
    assert pending.status_code == 422 and "outcome" in pending.text
    assert _call(client, tokens["node-a"], "/job/x/claim", {"pid": 1}).status_code == 404
    # An attempt token (one Slurm job's runners) takes no pool work.
    assert _call(client, tokens["attempt"], f"/sample/{sample}/claim", {"pid": 1}).status_code == 403
    assert get_row(settings, CheckpointSample, sample).status == PENDING

    assert _call(client, tokens["node-a"], f"/dataset/{ident}/finish", done).json() == {"mine": True}
    row = get_row(settings, Dataset, ident)
    assert (row.state, row.documents, row.heartbeat_at, row.runner_pid) == (READY, 3, None, None)
    assert _call(client, tokens["node-a"], f"/dataset/{ident}").json() == {"exists": True}
    assert _call(client, "mtn_" + "x" * 40, f"/dataset/{ident}").status_code == 401


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_node_without_a_database_preprocesses_a_dataset_through_the_api(
    settings: Settings, db_url: str, tmp_path: Path
) -> None:
    """preprocess_dataset with a node token and the API's URL in its settings, and no way to the
    database: the dataset becomes ready with its statistics, and the node made no database of its
    own (a settings fall-back to SQLite in its home would have shown there)."""
    home = tmp_path / "control"
    home.mkdir()
    api = Api(db_url, home)
    api.start()
    try:
        ident = _dataset(settings, [f"document {i} " + "lorem " * i for i in range(20)])
        with session_scope(db_url) as s:
            token = create_node_token(s, "default", "node-a")[1]
        node_home = tmp_path / "node"
        node = Settings(
            home=node_home, database_url="", api_url=api.url, node_token=token, node_name="node-a",
            storage_url=settings.resolved_storage_url, heartbeat_interval_s=0.2,
        )  # fmt: skip
        assert preprocess_dataset(ident, node) == READY
    finally:
        api.kill()
    row = get_row(settings, Dataset, ident)
    assert row.state == READY and row.documents == 20 and row.runner_host == "node-a", row.state_reason
    assert row.tokens and row.tokens > 20 and row.output_bytes
    assert not (node_home / "megatrain.db").exists()
