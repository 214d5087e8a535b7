"""`megatrain datasets upload|list|show|delete` through typer's CliRunner against a live API:
tables for people, one red line (never a traceback) for every refused request."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from fixtures.live import LiveApi
from sqlalchemy import update
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.db.models import Dataset
from megatrain.db.session import session_scope


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _corpus(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_upload_list_show_delete(live_api: LiveApi, tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.jsonl", [json.dumps({"body": f"doc {i}"}) for i in range(40)])
    code, out = run("datasets", "upload", str(path), "--name", "mine", "--json-key", "body")
    assert code == 0 and "mine" in out and "pending" in out, out
    code, out = run("datasets", "upload", live_api.data_path.as_uri(), "--name", "by-url")
    assert code == 0 and "by-url" in out, out
    with session_scope(live_api.settings.resolved_database_url) as s:
        s.execute(
            update(Dataset)
            .where(Dataset.name == "mine")
            .values(state="ready", documents=40, tokens=123456, output_bytes=3 << 20, vocab_size=257)
        )
    code, out = run("datasets", "list")
    assert code == 0, out
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}
    assert set(lines) == {"mine", "by-url"}
    assert "ready" in lines["mine"] and "123,456" in lines["mine"] and "3.0 MiB" in lines["mine"]
    assert "pending" in lines["by-url"]
    code, out = run("datasets", "show", "mine")
    assert code == 0 and "123,456" in out and "vocab 257" in out and "/tenants/local/datasets/mine/" in out, (
        out
    )
    code, out = run("datasets", "delete", "mine")
    assert code == 0 and "deleted" in out, out
    code, out = run("datasets", "show", "mine")
    assert code == 1 and "not found" in out, out


def _worker_sets(live_api: LiveApi, name: str, **values: object) -> threading.Thread:
    """What a worker does, once the upload is registered, while the command waits."""

    def run() -> None:
        url = live_api.settings.resolved_database_url
        for _ in range(200):
            with session_scope(url) as s:
                if s.execute(update(Dataset).where(Dataset.name == name).values(**values)).rowcount:
                    return
            time.sleep(0.05)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_upload_and_wait_until_ready(live_api: LiveApi, tmp_path: Path) -> None:
    path = _corpus(tmp_path / "c.jsonl", [json.dumps({"text": f"doc {i}"}) for i in range(40)])
    t = _worker_sets(live_api, "waited", state="ready", documents=40, tokens=321)
    code, out = run("datasets", "upload", str(path), "--name", "waited", "--wait", "--timeout", "30")
    t.join()
    assert code == 0 and "waited ready: 40 documents, 321 tokens" in out, out
    t = _worker_sets(live_api, "broken", state="failed", state_reason="c.jsonl:3: boom")
    code, out = run("datasets", "upload", str(path), "--name", "broken", "--wait", "--timeout", "30")
    t.join()
    assert code == 1 and "dataset 'broken' failed: c.jsonl:3: boom" in out, out
    code, out = run("datasets", "upload", str(path), "--name", "slow", "--wait", "--timeout", "0.3")
    assert code == 1 and "still pending" in out, out


def test_errors_are_one_line(live_api: LiveApi, tmp_path: Path) -> None:
    bad = _corpus(tmp_path / "bad.jsonl", ['{"text": "ok"}', "not json"])
    code, out = run("datasets", "upload", str(bad), "--name", "bad")
    assert code == 1 and "file: line 2: not valid JSON" in out and len(out.strip().splitlines()) == 1, out
    code, out = run("datasets", "upload", str(tmp_path / "none.jsonl"), "--name", "x")
    assert code == 1 and "does not exist" in out, out
    code, out = run("datasets", "upload", "file:///etc/passwd.jsonl", "--name", "x")
    assert code == 1 and "source_url" in out and "outside the data" in out, out
    good = _corpus(tmp_path / "good.jsonl", ['{"text": "ok"}'])
    assert run("datasets", "upload", str(good), "--name", "dup")[0] == 0
    code, out = run("datasets", "upload", str(good), "--name", "dup")
    assert code == 1 and "already exists" in out, out
    code, out = run("datasets", "list")
    assert code == 0 and "dup" in out and "bad" not in out, out


def test_operator_shares_a_dataset_every_tenant_sees(live_api: LiveApi, tmp_path: Path) -> None:
    source = live_api.data_path.as_uri()
    code, out = run("datasets", "share", source, "--name", "common", "--json-key", "text")
    assert code == 0 and "shared dataset common registered: pending" in out and "/datasets/common/" in out, (
        out
    )
    assert "/tenants/" not in out
    code, out = run("datasets", "list")
    assert code == 0 and "common" in out and "yes" in out, out
    code, out = run("datasets", "share", source, "--name", "common")
    assert code == 1 and "already exists" in out, out
    code, out = run("datasets", "share", (tmp_path / "none.jsonl").as_uri(), "--name", "other")
    assert code == 1 and "source_url" in out and "does not exist" in out, out
    code, out = run("datasets", "share", source, "--name", "bad/name")
    assert code == 1 and "name" in out, out
    # Tenants may not delete it.
    code, out = run("datasets", "delete", "common")
    assert code == 1 and "shared by the operator" in out, out
