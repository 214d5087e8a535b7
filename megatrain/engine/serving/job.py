"""A serve job's process: the model server on a free port of its node, until idle or cancelled.

The engine's entry point (`python -m megatrain.engine.train --spec ... --out DIR`) runs this for
a spec of kind serve, so the worker starts a serve job as it starts any job. The process loads the
base (serving.loader), starts the batching thread (an encoder's: the embedding thread, which
answers /v1/embeddings alone) and uvicorn on a port the OS picks, and writes
to DIR/events.jsonl what the runner forwards to the job's events: `started`, then `serving` with
{"url": "http://HOST:PORT"} once it listens (the API reads the address there). Every request must
carry the attempt's token (`Authorization: Bearer`, from the runner through MEGATRAIN_SERVE_TOKEN;
the API reads it from the job's row): a node's other users cannot ask the server for a tenant's
adapters. The batching thread
ticks DIR/progress.rank0 every second (the runner's hang watch sees a live server, not a stalled
step), and the process ends by itself, exit 0, once no request came for settings.serve_idle_timeout_s;
a cancel's SIGTERM stops uvicorn, which finishes the answers in flight first.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.engine.models.bert import BertModel
from megatrain.engine.serving.adapters import AdapterBank
from megatrain.engine.serving.batcher import Batcher
from megatrain.engine.serving.embeddings import Embedder
from megatrain.engine.serving.loader import default_device, load_served
from megatrain.engine.serving.server import ModelServer, create_app
from megatrain.engine.sink import RunLog
from megatrain.failures import Activity
from megatrain.progress_files import write_progress
from megatrain.settings import SERVE_TOKEN_ENV, Settings, get_settings
from megatrain.spec import JobSpec

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)


def bind_address(settings: Settings, token: str | None) -> tuple[str, str]:
    """(address to bind, host to publish): loopback for the local executor (the API runs on the
    same machine) and for a server without a token (started by hand), else every interface,
    published as the node's address."""
    if settings.executor == "local" or token is None:
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", settings.node_address or socket.gethostname()


def serve_job(
    spec: JobSpec, out_dir: Path, settings: Settings | None = None, activity: Activity | None = None
) -> str:
    """Serve `spec`'s model until idle or asked to stop; how it ended: "idle", "preempted" (SIGUSR2:
    the runner's preemption or time limit) or "stopped" (SIGTERM: a cancel). `activity` says what
    the process is doing, for a failure's record."""
    import uvicorn

    settings = settings or get_settings()
    activity = activity or Activity()
    out_dir.mkdir(parents=True, exist_ok=True)
    run_log, began = RunLog(out_dir, True), time.monotonic()
    activity.phase = "init"  # a missing or malformed base is the job's own input
    server = _load(spec, out_dir, settings, run_log)
    activity.phase = "serving"
    token = os.environ.get(SERVE_TOKEN_ENV) or None
    host, public = bind_address(settings, token)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    url = f"http://{public}:{sock.getsockname()[1]}"
    config = uvicorn.Config(create_app(server, token), log_level="warning", timeout_graceful_shutdown=10)
    uv = uvicorn.Server(config)
    ended = {"why": "stopped"}

    def on_preempt(signum: int, frame: object) -> None:  # answers in flight finish first
        ended["why"] = "preempted"
        uv.should_exit = True

    signal.signal(signal.SIGUSR2, on_preempt)
    watch_args = (uv, server, settings.serve_idle_timeout_s, run_log, url, began, ended)
    threading.Thread(target=_watch, args=watch_args, daemon=True, name="serve-watch").start()
    try:
        uv.run(sockets=[sock])  # its own SIGTERM/SIGINT handlers: a graceful stop
    finally:
        server.stop()
        if server.embedder is not None:
            e = server.embedder.stats
            run_log.events.write({"event": "finished", "step": e.batches, "tokens": e.tokens})
            run_log.say(
                f"embedded {e.inputs} inputs ({e.tokens} tokens) in {e.batches} batches ({ended['why']})"
            )
        else:
            stats = server.generator(server.name).stats
            run_log.events.write({"event": "finished", "step": stats.steps, "tokens": stats.tokens})
            run_log.say(f"served {stats.tokens} tokens in {stats.steps} decode steps ({ended['why']})")
        run_log.close()
        sock.close()
    return ended["why"]


def _load(spec: JobSpec, out_dir: Path, settings: Settings, run_log: RunLog) -> ModelServer:
    """The base, its adapter bank and the running batcher (an encoder: the running embedder);
    progress ticks from that thread (a wedged model stops them, and the runner's hang watch sees it)."""
    device = default_device()
    served = load_served(spec, device)
    ticks = [0]

    def tick() -> None:
        ticks[0] += 1
        write_progress(out_dir, 0, ticks[0], "serving")

    name = served.base or spec.name
    if isinstance(served.model, BertModel):
        embedder = Embedder(served.model, served.tokenizer, max_batch=settings.serve_max_batch)
        server = ModelServer(None, served.template, name, embedder=embedder.start(on_tick=tick))
    else:
        bank = AdapterBank(served.model, served.model.config, served.base)
        batcher = Batcher(served.model, served.tokenizer, max_batch=settings.serve_max_batch, adapters=bank)
        server = ModelServer(batcher.start(on_tick=tick), served.template, name, bank)
    num_params = served.model.num_parameters()
    run_log.events.write({"event": "started", "device": device, "num_params": num_params, "step": 0})
    kind = "embeddings of " if server.embedder is not None else ""
    run_log.say(f"serving {kind}{served.base} ({num_params:,} parameters, {served.precision}) on {device}")
    return server


def _watch(
    uv: uvicorn.Server,
    server: ModelServer,
    idle_timeout_s: float,
    run_log: RunLog,
    url: str,
    began: float,
    ended: dict[str, str],
) -> None:
    """Publish the address once uvicorn listens; ask it to stop once idle for idle_timeout_s."""
    while not uv.started:
        if uv.should_exit:
            return
        time.sleep(0.02)
    run_log.events.write({"event": "serving", "url": url, "startup_s": round(time.monotonic() - began, 3)})
    run_log.say(f"listening at {url}")
    while not uv.should_exit:
        if server.idle_s(time.monotonic()) >= idle_timeout_s:
            run_log.say(f"idle for {idle_timeout_s:g} s: stopping")
            ended["why"] = "idle"
            uv.should_exit = True
            return
        time.sleep(min(1.0, idle_timeout_s / 4))
