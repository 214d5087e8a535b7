"""Who may read what (megatrain/api/jobs/data_access.py, Settings.data_roots): MEGATRAIN_ALLOWED_DATA_ROOTS
adds to the embedded default's roots ($HOME, the checkout's examples/), and a refusal says what to
set and where."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from api_handle import Api, write_corpus

from megatrain import REPO_ROOT


def _data_errors(api: Api, path: str) -> list[str]:
    spec = api.spec()
    spec["data"]["train"][0]["path"] = path
    resp = api.client.post("/v1/spec/validate", json=spec, headers=api.headers)
    if resp.status_code == 200:
        return []
    assert resp.status_code == 422, resp.text
    return [e["message"] for e in resp.json()["detail"] if e["field"] == "data.train.0.path"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_configured_root_adds_to_home_and_the_examples(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fixture sets MEGATRAIN_ALLOWED_DATA_ROOTS; $HOME (here a folder of the test's) and the
    # checkout's examples/ stay readable beside it.
    home = tmp_path / "user-home"
    monkeypatch.setenv("HOME", str(home))
    in_home = write_corpus(home / "megatrain-models" / "corpus.jsonl").as_uri()
    assert _data_errors(api, in_home) == []
    assert _data_errors(api, (REPO_ROOT / "examples" / "data" / "corpus.jsonl").as_uri()) == []
    assert _data_errors(api, (api.data_root / "corpus.jsonl").as_uri()) == []


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_refusal_says_what_to_set_and_where(api: Api) -> None:
    # A short path: a message is clipped at errors.MAX_MESSAGE_CHARS, and pytest's are long.
    with tempfile.TemporaryDirectory(prefix="mt") as elsewhere:
        outside = write_corpus(Path(elsewhere) / "corpus.jsonl")
        [message] = _data_errors(api, outside.as_uri())
    assert "outside the data this tenant may read" in message
    # Both the roots already configured and the refused file's folder, in the one command to run.
    wanted = f"{api.data_root.resolve().as_uri()},{outside.parent.resolve().as_uri()}"
    assert f"`megatrain down && MEGATRAIN_ALLOWED_DATA_ROOTS={wanted} megatrain up`" in message, message
