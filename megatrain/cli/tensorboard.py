"""`megatrain tensorboard JOB`: a job's TensorBoard event files (its spec's tracking.tensorboard),
downloaded through the API, then `tensorboard --logdir` on them. SDK only."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from megatrain.cli.common import _fail, _out, _user_errors, app
from megatrain.client import Client


def tensorboard_command(logdir: Path, host: str, port: int) -> list[str] | None:
    """The command that serves `logdir`: the `tensorboard` on PATH, else this Python's package."""
    args = ["--logdir", str(logdir), "--host", host, "--port", str(port)]
    found = shutil.which("tensorboard")
    if found:
        return [found, *args]
    if importlib.util.find_spec("tensorboard") is not None:
        return [sys.executable, "-m", "tensorboard.main", *args]
    return None


@app.command()
@_user_errors
def tensorboard(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    to: Annotated[Path | None, typer.Option("--to", help="Folder (default: JOB-tensorboard).")] = None,
    download_only: Annotated[
        bool, typer.Option("--download-only", help="Download the event files and print their folder.")
    ] = False,
    host: Annotated[str, typer.Option(help="The address TensorBoard listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TensorBoard's port.")] = 6006,
) -> None:
    """Open a job's TensorBoard event files: download them (as they stand), run TensorBoard on them."""
    with Client() as client:
        folder = client.download_tensorboard(job_id, to)
    files = sorted(p.name for p in folder.iterdir())
    _out().print(
        f"downloaded {len(files)} event file(s) of job {job_id} to [bold]{escape(str(folder))}[/bold]"
    )
    if download_only:
        return
    cmd = tensorboard_command(folder, host, port)
    if cmd is None:
        raise _fail("tensorboard is not installed here: pip install 'megatrain[tracking]' (or tensorboard)")
    _out().print(f"TensorBoard at http://{host}:{port}/ (Ctrl-C stops it)")
    try:
        code = subprocess.call(cmd)
    except KeyboardInterrupt:
        code = 0
    if code:
        raise _fail(f"tensorboard exited with code {code}")
