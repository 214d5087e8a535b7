"""`megatrain demo`: start the embedded stack if none answers, train a small Llama on the Python
standard library end to end, load the downloaded checkpoint and sample a few lines from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlparse

import typer
import yaml
from rich.markup import escape

from megatrain.cli.common import _fail, _out, _user_errors, app
from megatrain.cli.jobs import follow_job
from megatrain.cli.prediction import submitted_prediction
from megatrain.client import ApiError, ApiUnreachable, Client, MegatrainError
from megatrain.settings import Settings, examples_dir, get_settings

# -- demo ---------------------------------------------------------------------------------------


def _ensure_api(settings: Settings, timeout_s: float = 120.0) -> subprocess.Popen[bytes] | None:
    """Start a detached `megatrain up` if nothing answers at settings.api_url; None if one already did
    (and takes this home's key: a server started from another MEGATRAIN_HOME is named as such)."""
    try:
        with Client(api_key="") as probe:
            probe.health()
    except ApiUnreachable:
        pass
    else:
        try:
            with Client() as client:
                next(client.list_jobs(limit=1), None)
        except ApiError as exc:
            if exc.status != 401:
                raise
            raise MegatrainError(
                f"a megatrain API already answers at {settings.api_url} but does not take this home's API "
                f"key ({settings.credentials_path}): it was started from another MEGATRAIN_HOME. Stop it, "
                "or set MEGATRAIN_API_URL to a free port (e.g. http://127.0.0.1:8001) to start this home's "
                "own, or set MEGATRAIN_API_KEY to a key of that server"
            ) from None
        return None
    parsed = urlparse(settings.api_url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ApiUnreachable(settings.api_url, "and it is not on this machine, so the demo cannot start it")
    port = parsed.port or 80
    log_path = settings.home / "megatrain-up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _out().print(f"starting the embedded stack on {settings.api_url} (log: {log_path})")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatrain.cli", "up", "--host", parsed.hostname, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # detached: it outlives the demo, like `megatrain up &`
            env=os.environ.copy(),
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise ApiUnreachable(settings.api_url, "`megatrain up` exited:\n" + "\n".join(tail))
        try:
            with Client(api_key="") as probe:
                probe.health()
            return proc
        except ApiUnreachable:
            time.sleep(0.5)
    raise ApiUnreachable(
        settings.api_url, f"`megatrain up` did not answer within {timeout_s:.0f} s; see {log_path}"
    )


def _demo_corpus(settings: Settings) -> str:
    """Build the stdlib corpus into {storage}/datasets/python-stdlib/ and return its URL."""
    from megatrain.demo import build_stdlib_corpus
    from megatrain.storage import FileStore, open_store

    store = open_store(settings.resolved_storage_url)
    if isinstance(store, FileStore):
        path = build_stdlib_corpus(store.local_path("datasets/python-stdlib"))
        return Path(path).resolve().as_uri()
    # Object storage: build locally, then upload beside the other datasets.
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(build_stdlib_corpus(Path(tmp)))
        key = f"datasets/python-stdlib/{path.name}"
        store.put_file(key, path)
    return f"{store.url}/{key}"


def _spec_text(spec: dict[str, Any], path: Path) -> str:
    """The spec as YAML for a .yaml/.yml file (what examples/ and `megatrain submit` read), else JSON."""
    if path.suffix.lower() in (".yaml", ".yml"):
        return yaml.safe_dump(spec, sort_keys=False)
    return json.dumps(spec, indent=1) + "\n"


@app.command()
@_user_errors
def demo(
    to: Annotated[
        Path | None,
        typer.Option(
            "--to", help="Where to put the final checkpoint; default: demo-checkpoint in MEGATRAIN_HOME."
        ),
    ] = None,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel degree (a divisor of 4 heads).")] = 1,
    dp: Annotated[int, typer.Option(min=1, help="Data-parallel degree (a divisor of 16).")] = 1,
    sequence_parallel: Annotated[bool, typer.Option(help="Sequence parallelism (with tp > 1).")] = False,
    write_spec: Annotated[
        Path | None,
        typer.Option(
            help="Only build the corpus and write the demo's spec here (YAML for .yaml/.yml, else JSON)."
        ),
    ] = None,
) -> None:
    """Train a small Llama on the Python standard library's sources, end to end, and load the result."""
    from megatrain.demo import demo_spec

    settings = get_settings()
    out = _out()
    if write_spec is not None:
        spec = demo_spec(_demo_corpus(settings), tp=tp, dp=dp, sequence_parallel=sequence_parallel)
        write_spec.write_text(_spec_text(spec, write_spec))
        n = tp * dp
        out.print(
            f"wrote {escape(str(write_spec))}; run it with: torchrun --standalone --nproc-per-node {n} "
            f"-m megatrain.engine.train --spec {escape(str(write_spec))} --out demo-run"
        )
        return
    proc = _ensure_api(settings)
    if proc is not None:
        out.print(
            f"the stack keeps running in the background (pid {proc.pid}, "
            f"log {settings.home / 'megatrain-up.log'}); stop it with `megatrain down`"
        )
    corpus_url = _demo_corpus(settings)
    out.print(f"corpus: {corpus_url}")
    spec = demo_spec(corpus_url, tp=tp, dp=dp, sequence_parallel=sequence_parallel)
    # Outside any checkout: a relative default would leave an untracked folder in the current one.
    to = to if to is not None else settings.home / "demo-checkpoint"
    with Client() as client:
        job = client.submit(spec)
        out.print(f"submitted demo job [bold]{job.id}[/bold]; watch it at {client.api_url}/")
        predicted = submitted_prediction(client.events(job.id))
        out.print(duration_line(predicted, spec["training"]["train_iters"], job.pool or "default"))
        final = follow_job(client, job.id)
        if final.status != "succeeded":
            for line in client.logs(job.id)[-20:]:
                typer.echo(line.line, err=True)
            raise _fail(f"the demo job {final.status}: {final.status_reason or 'see the logs above'}")
        path = client.download(job.id, dest=to)
        train = [
            m
            for m in client.metrics(job.id)
            if m.get("kind", "train") == "train" and m.get("loss") is not None
        ]
    from megatrain.engine.checkpoint import load_checkpoint

    model, _spec = load_checkpoint(str(path))
    num_params = sum(p.numel() for p in model.parameters())
    out.print(
        f"checkpoint downloaded to [bold]{escape(str(path))}[/bold]; it loads: {num_params:,} parameters"
    )
    if train:
        out.print(
            f"loss: first {train[0]['loss']:.4f} (step {train[0]['step']}) -> "
            f"final {train[-1]['loss']:.4f} (step {train[-1]['step']})"
        )
    _print_samples(str(path), spec["model"]["seq_length"])
    out.print(f"dashboard: [bold]{client.api_url}/[/bold]")
    for line in next_steps(job.id):
        out.print(line, markup=False, highlight=False)


def duration_line(predicted: dict[str, Any] | None, train_iters: int, pool: str) -> str:
    """How long the demo should take: the planner's predicted step time (the job's `submitted`
    event) over its steps; checkpoints and evaluations add a little."""
    if not predicted or not predicted.get("step_time_s"):
        return "expected duration: unknown (the planner made no prediction for this job)"
    step = float(predicted["step_time_s"])
    return (
        f"expected duration: about {_minutes(step * train_iters)} for {train_iters} steps (the "
        f"planner's prediction for pool {pool!r}: {step:.3g} s a step; longer when other processes "
        "share the cores)"
    )


def next_steps(job_id: str) -> list[str]:
    """The walk-through's next commands (examples/README.md: export, register, fine-tune), with the
    checkout's examples named so that they work from the current folder."""
    examples = examples_dir()
    if examples is None:  # an installed wheel: the examples live in the repository
        readme, finetune = "examples/README.md (in megatrain's repository)", "examples/finetune_hf_chat.yaml"
    else:
        here = Path.cwd().resolve()  # relative from inside the checkout, else absolute
        examples = examples.resolve()
        examples = examples.relative_to(here) if examples.is_relative_to(here) else examples
        readme, finetune = str(examples / "README.md"), str(examples / "finetune_hf_chat.yaml")
    folder = "~/megatrain-models/demo-llama"
    return [
        f"next, as {readme} goes on: export the model, register it, fine-tune it on chats",
        f"  megatrain export {job_id} --to {folder} --dtype fp32",
        f"  megatrain models register {folder} --name demo-llama",
        f"  megatrain submit {finetune} --follow",
    ]


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _print_samples(checkpoint: str, seq_length: int, max_new_tokens: int = 80) -> None:
    """A greedy continuation of each demo prompt from the downloaded checkpoint."""
    from megatrain.demo import SAMPLE_PROMPTS
    from megatrain.engine.sampling import CheckpointSampler

    sampler = CheckpointSampler(keep=1)
    out = _out()
    out.print("samples from the trained model (greedy):")
    for prompt in SAMPLE_PROMPTS:
        # The byte tokenizer takes one token a byte; the model reads at most seq_length tokens.
        budget = min(max_new_tokens, seq_length - len(prompt.encode()) - 1)
        text = prompt + sampler.sample(checkpoint, prompt, budget).text
        line = text.splitlines()[0] if text.strip() else text
        # An undertrained model emits arbitrary bytes: keep control characters off the terminal.
        line = "".join(c if c.isprintable() else "\N{MIDDLE DOT}" for c in line)
        out.print(f"  [dim]>[/dim] {escape(line)}")
