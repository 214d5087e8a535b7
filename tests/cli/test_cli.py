"""The `megatrain` command through typer's CliRunner, against a live API.

Every user error must end as a readable message and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import yaml
from fixtures.live import LiveApi, add_checkpoint
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.settings import reset_settings_cache

JOB_ID = re.compile(r"job-[0-9a-f]{16}")


def run(*args: str) -> tuple[int, str]:
    # A wide terminal keeps rich from folding ids and messages across lines.
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _write_spec(tmp_path: Path, spec: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec) if name.endswith(".yaml") else json.dumps(spec))
    return path


def test_submit_list_status_logs_cancel(live_api: LiveApi, tmp_path: Path) -> None:
    code, out = run("submit", str(_write_spec(tmp_path, live_api.spec("cli-job"))))
    assert code == 0, out
    job_id = JOB_ID.search(out).group(0)  # type: ignore[union-attr]
    assert "queued" in out

    code, out = run("submit", str(_write_spec(tmp_path, live_api.spec("cli-json"), "spec.json")))
    assert code == 0, out
    other_id = JOB_ID.search(out).group(0)  # type: ignore[union-attr]

    code, out = run("list")
    assert code == 0 and job_id in out and other_id in out and "cli-job" in out, out
    code, out = run("status", job_id)
    assert code == 0 and "queued" in out and "0/10" in out, out
    code, out = run("logs", job_id)
    assert code == 0 and out.strip() == "", out
    code, out = run("cancel", job_id)
    assert code == 0 and "cancel" in out, out
    code, out = run("status", job_id)
    assert code == 0 and "cancelled" in out, out
    code, out = run("list", "--status", "cancelled")
    assert code == 0 and job_id in out and other_id not in out, out
    code, out = run("list", "--status", "succeeded")
    assert code == 0 and "no jobs" in out, out


def test_bad_spec_names_the_field(live_api: LiveApi, tmp_path: Path) -> None:
    spec = live_api.spec()
    spec["model"]["hidden_size"] = 33
    spec["training"]["lr"] = -1
    code, out = run("submit", str(_write_spec(tmp_path, spec)))
    assert code != 0
    assert "model.hidden_size" in out and "training.lr" in out and "422" in out, out


@pytest.mark.parametrize(("content", "message"), [(None, "does not exist"), ("a: [b", "not valid YAML")])
def test_unreadable_spec_file(
    tmp_path: Path, megatrain_home: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "spec.yaml"
    if content is not None:
        path.write_text(content)
    code, out = run("submit", str(path))
    assert code == 1 and message in out, out


def test_wrong_key_is_a_clear_401(live_api: LiveApi, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = "mt_wrongKEY" + "z" * 32
    monkeypatch.setenv("MEGATRAIN_API_KEY", wrong)
    reset_settings_cache()
    code, out = run("list")
    assert code == 1 and "401" in out, out
    # The key is set: say which was sent (its prefix only) and from where, not "Set MEGATRAIN_API_KEY".
    assert "sent the key mt_wrongKE… from MEGATRAIN_API_KEY" in out and wrong not in out, out
    assert "does not know that key" in out and "Set MEGATRAIN_API_KEY" not in out, out


def test_unknown_job(live_api: LiveApi) -> None:
    for cmd in ("status", "cancel", "logs", "download"):
        code, out = run(cmd, "job-0000000000000000")
        assert code == 1 and "404" in out, (cmd, out)


def test_api_down_is_a_clear_message(megatrain_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MEGATRAIN_API_URL", f"http://127.0.0.1:{port}")
    reset_settings_cache()
    for args in (["list"], ["status", "job-1"], ["logs", "job-1", "--follow"]):
        code, out = run(*args)
        assert code == 1 and "cannot reach the megatrain API" in out and "megatrain up" in out, out


def test_download(live_api: LiveApi, tmp_path: Path) -> None:
    code, out = run("submit", str(_write_spec(tmp_path, live_api.spec())))
    job_id = JOB_ID.search(out).group(0)  # type: ignore[union-attr]
    code, out = run("download", job_id, "--to", str(tmp_path / "none"))
    assert code == 1 and "no checkpoints" in out, out
    add_checkpoint(live_api.settings, job_id, 5, payload=b"five")
    add_checkpoint(live_api.settings, job_id, 10, payload=b"ten")
    code, out = run("download", job_id, "--to", str(tmp_path / "ckpt"))
    assert code == 0 and "step 10" in out, out
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == b"ten"
    code, out = run("download", job_id, "--step", "5", "--to", str(tmp_path / "ckpt5"))
    assert code == 0 and (tmp_path / "ckpt5" / "model.safetensors").read_bytes() == b"five", out


def test_keys_create_gives_a_working_key_of_a_new_tenant(
    live_api: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    run("submit", str(_write_spec(live_api.data_path.parent, live_api.spec("local-job"))))
    code, out = run("keys", "create", "--tenant", "acme", "--name", "ci")
    assert code == 0, out
    key = out.strip().splitlines()[-1]
    monkeypatch.setenv("MEGATRAIN_API_KEY", key)
    reset_settings_cache()
    code, out = run("list")
    # The new tenant sees none of the local tenant's jobs.
    assert code == 0 and "no jobs" in out, out


def test_keys_create_rejects_a_bad_tenant_name(db_url: str) -> None:
    code, out = run("keys", "create", "--tenant", "../etc")
    assert code == 1 and "tenant name" in out, out


def test_tenants_set_max_priority_lets_a_tenant_boost_its_jobs(live_api: LiveApi, tmp_path: Path) -> None:
    spec = live_api.spec("urgent")
    spec["resources"] = {"devices": 1, "priority": 5}
    path = _write_spec(tmp_path, spec)
    code, out = run("submit", str(path))
    assert code != 0 and "resources.priority=5 exceeds this tenant's maximum priority 0" in out, out
    code, out = run("tenants", "set-max-priority", "local", "5")
    assert code == 0 and "up to 5" in out, out
    code, out = run("submit", str(path))
    assert code == 0, out


def test_embedded_stack_registers_this_machine(megatrain_home: Path) -> None:
    from sqlalchemy import select

    from megatrain.cli.server import EmbeddedStack
    from megatrain.db.models import Node, NodePool
    from megatrain.db.session import session_scope
    from megatrain.settings import get_settings

    settings = get_settings()
    EmbeddedStack.prepare(settings)
    with session_scope(settings.resolved_database_url) as s:
        assert s.scalar(select(NodePool.name)) == settings.pool_name
        assert s.scalar(select(Node.slots_total)) >= 1


def test_scheduler_command_runs_until_sigterm(db_url: str, tmp_path: Path) -> None:
    pytest.importorskip("megatrain.scheduler.loop", reason="the scheduler loop has not landed yet")
    import os
    import signal
    import subprocess
    import sys
    import time

    log = tmp_path / "scheduler.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatrain.cli", "scheduler"], stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "scheduler started" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert "scheduler started" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL adds nothing here but time
def test_submit_follow_runs_to_success(live_stack: LiveApi, tmp_path: Path) -> None:
    pytest.importorskip("megatrain.engine.train", reason="the engine entry point has not landed yet")
    code, out = run("submit", str(_write_spec(tmp_path, live_stack.spec("followed"))), "--follow")
    assert code == 0 and "succeeded" in out, out
    job_id = JOB_ID.search(out).group(0)  # type: ignore[union-attr]
    code, out = run("logs", job_id, "--follow")  # the job has ended, so following returns at once
    assert code == 0 and "step 10/10" in out, out


def test_demo_starts_a_detached_stack_when_none_answers(
    megatrain_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`megatrain demo`'s first step: no API answers, so it starts `megatrain up` in the background."""
    pytest.importorskip("megatrain.api.app", reason="the API (megatrain.api.app) has not landed yet")
    pytest.importorskip("megatrain.scheduler.loop", reason="the scheduler loop has not landed yet")
    from megatrain.cli.demo import _ensure_api
    from megatrain.client import Client, MegatrainError
    from megatrain.settings import get_settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MEGATRAIN_API_URL", f"http://127.0.0.1:{port}")
    reset_settings_cache()
    proc = _ensure_api(get_settings(), timeout_s=60)
    assert proc is not None
    try:
        assert (megatrain_home / "credentials").is_file()
        assert (megatrain_home / "megatrain-up.log").is_file()
        with Client() as c:  # the key the detached stack wrote works against it
            assert list(c.list_jobs()) == []
        assert _ensure_api(get_settings()) is None  # a second call finds it running
        # Another home (no key of that server's) finding it: a message that says so, not a bare 401.
        monkeypatch.setenv("MEGATRAIN_HOME", str(megatrain_home.parent / "other-home"))
        reset_settings_cache()
        with pytest.raises(MegatrainError, match="started from another MEGATRAIN_HOME"):
            _ensure_api(get_settings())
    finally:
        proc.terminate()
        proc.wait(timeout=30)  # uvicorn re-raises SIGTERM after a clean shutdown, so the code is -15
        assert "Application shutdown complete" in (megatrain_home / "megatrain-up.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL adds nothing here but time
def test_demo_end_to_end(live_stack: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole demo path with a smaller corpus and model, so it fits the test budget."""
    pytest.importorskip("megatrain.engine.train", reason="the engine entry point has not landed yet")
    demo_mod = pytest.importorskip("megatrain.demo", reason="megatrain.demo has not landed yet")
    build = demo_mod.build_stdlib_corpus
    monkeypatch.setattr(demo_mod, "build_stdlib_corpus", lambda dest: build(dest, max_bytes=300_000))

    def tiny_demo_spec(corpus_url: str, **layout: object) -> dict:
        spec = live_stack.spec("demo-tiny")
        spec["data"]["train"] = [{"path": corpus_url}]
        return spec

    monkeypatch.setattr(demo_mod, "demo_spec", tiny_demo_spec)
    checkout = tmp_path / "checkout"  # the demo run from a checkout leaves nothing in it
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    code, out = run("demo")
    assert code == 0, out
    assert "succeeded" in out and "parameters" in out and "loss: first" in out, out
    assert re.search(r"expected duration: about \d+ (s|min) for \d+ steps \(the planner's", out), out
    assert "megatrain submit " in out.split("dashboard:")[1] and "finetune_hf_chat.yaml --follow" in out, out
    assert live_stack.url + "/" in out
    assert not any(checkout.iterdir())
    assert (live_stack.settings.home / "demo-checkpoint" / "manifest.json").is_file()
    samples = out.split("samples from the trained model (greedy):\n", 1)[1].splitlines()
    for prompt, line in zip(("def ", "import ", "class "), samples, strict=False):
        assert line.startswith(f"  > {prompt}"), out
    corpus = (
        Path(live_stack.settings.resolved_storage_url.removeprefix("file://")) / "datasets" / "python-stdlib"
    )
    assert any(corpus.iterdir())


def test_a_bad_status_filter_names_the_states(live_api: LiveApi) -> None:
    code, out = run("list", "--status", "done")
    assert code == 1 and "invalid job spec" not in out, out
    assert (
        "unknown --status 'done'" in out and "queued, scheduled, running, succeeded, failed, cancelled" in out
    ), out


def test_an_ended_job_without_checkpoints_is_not_told_yet(live_api: LiveApi, tmp_path: Path) -> None:
    code, out = run("submit", str(_write_spec(tmp_path, live_api.spec())))
    job_id = JOB_ID.search(out).group(0)  # type: ignore[union-attr]
    assert run("cancel", job_id)[0] == 0
    code, out = run("download", job_id, "--to", str(tmp_path / "none"))
    assert code == 1 and f"job {job_id} cancelled without saving a checkpoint" in out, out
    code, out = run("cancel", job_id)
    assert code == 1 and "was already cancelled" in out, out


def test_validate(live_api: LiveApi, tmp_path: Path) -> None:
    code, out = run("validate", str(_write_spec(tmp_path, live_api.spec("checked"))))
    assert code == 0 and "is valid: 1 process: tp=1 pp=1 dp=1" in out, out
    spec = live_api.spec()
    spec["model"]["hidden_size"] = 33
    code, out = run("validate", str(_write_spec(tmp_path, spec, "bad.json")))
    assert code == 1 and "model.hidden_size" in out and "422" in out, out
    code, out = run("list")
    assert code == 0 and "no jobs" in out, out  # validating submitted nothing
