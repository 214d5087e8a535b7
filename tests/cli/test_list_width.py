"""`megatrain list` fits an 80-column terminal: one line per job, ids whole, long names cut."""

from __future__ import annotations

import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Client

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def test_list_fits_80_columns(live_api: LiveApi) -> None:
    long_name = "a-rather-long-experiment-name-" + "x" * 60
    with Client() as c:
        ids = [
            c.submit(live_api.spec(long_name, train_iters=100000)).id,
            c.submit(live_api.spec("short")).id,
        ]
        c.cancel(ids[1])
    for columns, wide in (("80", False), ("200", True)):
        result = CliRunner().invoke(app, ["list"], env={"COLUMNS": columns})
        assert result.exit_code == 0, result.output
        lines = result.output.rstrip("\n").splitlines()
        assert len(lines) == 3 and all(len(line) <= int(columns) for line in lines), result.output
        assert "ID" in lines[0] and "STATUS" in lines[0] and ("TOK/S" in lines[0]) == wide, result.output
        # Newest first; each row holds the whole id, its state and its step.
        assert lines[1].startswith(ids[1] + " ") and "cancelled" in lines[1] and "0/10" in lines[1]
        assert lines[2].startswith(ids[0] + " ") and "queued" in lines[2] and "0/100000" in lines[2]
        assert ("…" in lines[2]) != wide and "a-rather" in lines[2], result.output
