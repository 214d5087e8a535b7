"""The `megatrain` command (typer + rich).

Job commands only call the SDK (`megatrain.client`); the server commands (up, scheduler, worker,
keys, and the stack `demo` starts) run the control plane in this process. Heavy modules (uvicorn,
the API, SQLAlchemy, torch) are imported inside the commands that need them, so `megatrain list`
stays quick and torch-free. Every user error ends as one red line and exit code 1, never a traceback.
"""

from __future__ import annotations

# Importing the command modules registers their commands on `app`.
from megatrain.cli import (  # noqa: F401
    audit,
    cluster,
    data,
    datasets,
    demo,
    exports,
    generate,
    jobs,
    metrics,
    models,
    nodes,
    plan,
    pools,
    results,
    server,
    stack,
    tensorboard,
)
from megatrain.cli.common import app


def main() -> None:
    app()
