"""`megatrain generate SOURCE`: continue a prompt with a trained model on this machine.

SOURCE is a job's checkpoint (`JOB[@STEP]`, fetched through the SDK into a cache under the
megatrain home and reused on the next call), a checkpoint folder or root (a path or a file:// /
s3:// URL), or a Hugging Face model (`hf:PATH`, with tokenizer.json beside the weights if it has
one, as every megatrain export has). torch and the engine are imported only when the command runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from megatrain.cli.common import _fail, _user_errors, app
from megatrain.client import Client
from megatrain.settings import get_settings
from megatrain.storage import StorageError, open_store

if TYPE_CHECKING:
    from megatrain.engine.data.tokenizers import Tokenizer
    from megatrain.engine.models.gpt import GPTModel

_JOB_REF = re.compile(r"[A-Za-z0-9_-]+(@[^/]*)?")


@dataclass
class _Loaded:
    model: GPTModel
    tokenizer: Tokenizer | None
    tokenizer_error: str | None = None
    """Why there is no tokenizer (text needs one; ids alone do not)."""


@app.command("generate")
@_user_errors
def generate_text(
    source: Annotated[
        str, typer.Argument(help="JOB or JOB@STEP, a checkpoint folder (or root), or hf:PATH.")
    ],
    prompt: Annotated[str | None, typer.Option("--prompt", help="Text to continue.")] = None,
    prompt_ids: Annotated[
        str | None, typer.Option("--prompt-ids", help="Token ids to continue, comma-separated: 1,2,3.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=0, help="At most this many new tokens.")] = 64,
    greedy: Annotated[
        bool,
        typer.Option("--greedy", help="Always the likeliest token (the default without sampling options)."),
    ] = False,
    temperature: Annotated[float | None, typer.Option(help="Sample, logits divided by T.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Sample from the likeliest tokens of mass P.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Sample from the K likeliest tokens.")] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the sampler (the same seed, the same text).")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (cuda:N).")] = "cpu",
) -> None:
    """Continue a prompt with a trained model: print the text (prompt + continuation)."""
    if (prompt is None) == (prompt_ids is None):
        raise _fail("give exactly one of --prompt TEXT and --prompt-ids 1,2,3")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    given = [f"--{k.replace('_', '-')}" for k, v in sampling.items() if v is not None]
    if greedy and given:
        raise _fail(f"--greedy takes no sampling options ({', '.join(given)})")
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise _fail(f"--device {device!r} is not cpu, cuda or cuda:N")

    import torch

    from megatrain.engine.generate import generate

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise _fail("--device cuda: this machine has no CUDA GPU that torch can use")
    try:
        loaded = _load(source, device)
        if ids is None:
            if loaded.tokenizer is None:
                raise ValueError(f"--prompt needs the model's tokenizer: {loaded.tokenizer_error}")
            ids = loaded.tokenizer.encode(prompt or "")
        tok, cfg = loaded.tokenizer, loaded.model.config
        # Only ids both the model and the tokenizer know: not the embedding's padding rows.
        vocab_limit = cfg.real_vocab_size
        if tok is not None:
            vocab_limit = min(vocab_limit, tok.vocab_size)
        new = generate(
            loaded.model,
            ids,
            max_new_tokens,
            greedy=not given,
            temperature=1.0 if temperature is None else temperature,
            top_k=top_k or 0,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
            eos_id=None if tok is None else tok.eod,
            vocab_limit=vocab_limit,
        )
    except (ValueError, OSError, ImportError, StorageError) as exc:
        raise _fail(str(exc)) from None
    if loaded.tokenizer is not None:
        typer.echo(loaded.tokenizer.decode(ids + new))
    else:
        typer.echo(f"(no text: {loaded.tokenizer_error})", err=True)
    if prompt_ids is not None:
        typer.echo(f"prompt ids: {','.join(map(str, ids))}")
        typer.echo(f"new ids: {','.join(map(str, new))}")


def _parse_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise _fail("--prompt-ids is empty: give token ids like 1,2,3")
    for p in parts:
        if not re.fullmatch(r"-?\d+", p):
            raise _fail(f"--prompt-ids: {p!r} is not an integer token id")
    return [int(p) for p in parts]


def _load(source: str, device: str) -> _Loaded:
    """The model and tokenizer SOURCE names; ValueError / OSError for what cannot be loaded."""
    if source.startswith("hf:"):
        return _load_hf(source.removeprefix("hf:"), device)
    if "://" in source or Path(source).exists():
        return _load_checkpoint(source, device)
    if not _JOB_REF.fullmatch(source):
        raise FileNotFoundError(f"no checkpoint folder at {source}")
    return _load_checkpoint(_job_checkpoint(source), device)


def _load_checkpoint(path_or_url: str | Path, device: str) -> _Loaded:
    from megatrain.engine.checkpoint import load_checkpoint
    from megatrain.engine.data import build_tokenizer

    model, spec = load_checkpoint(path_or_url, device)
    try:
        return _Loaded(model, build_tokenizer(spec.data.tokenizer))
    except (ValueError, OSError, ImportError) as exc:  # e.g. a tokenizer file only the trainer could read
        return _Loaded(model, None, f"its tokenizer cannot be built: {exc}")


def _load_hf(path: str, device: str) -> _Loaded:
    from megatrain.engine.checkpoint import to_url
    from megatrain.engine.data.tokenizers import HFTokenizer
    from megatrain.engine.interop.hf import load_hf_model

    url = to_url(path)
    model, _ = load_hf_model(url, device)
    store = open_store(url)
    if not store.exists("tokenizer.json"):
        return _Loaded(model, None, f"{path} has no tokenizer.json")
    # tokenizer_config.json (an export writes one) names the end-of-text token and whether special
    # tokens' text in a prompt is text, as the model was trained.
    config = (
        json.loads(store.get_bytes("tokenizer_config.json")) if store.exists("tokenizer_config.json") else {}
    )
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    try:
        tok = HFTokenizer(f"{url}/tokenizer.json", eos, bool(config.get("split_special_tokens", False)))
    except ValueError as exc:  # e.g. no end-of-text token to stop at
        return _Loaded(model, None, str(exc))
    return _Loaded(model, tok)


def _job_checkpoint(ref: str) -> Path:
    """JOB[@STEP] -> a local folder holding that checkpoint, downloaded through the SDK once and
    kept under {home}/cache/checkpoints/JOB/iter_STEP (the download verifies it, then moves it in)."""
    job_id, _, step_text = ref.partition("@")
    if step_text and not step_text.isdigit():
        raise ValueError(f"{ref}: the step after @ must be a number")
    with Client() as client:
        step = int(step_text) if step_text else _latest_step(client, job_id)
        dest = get_settings().home / "cache" / "checkpoints" / job_id / f"iter_{step:07d}"
        if not (dest / "manifest.json").is_file():
            client.download(job_id, step=step, dest=dest)
    return dest


def _latest_step(client: Client, job_id: str) -> int:
    cps = client.checkpoints(job_id)
    if not cps:
        raise ValueError(client.get_job(job_id).no_checkpoints)
    return int(cps[-1].step)
