"""A rank's model at the start of a job: its config as this worker can run it, and only its own
shards, built from the seeded initial weights, a Hugging Face folder read by slice or a job's
checkpoint (`model.init_from`). Training (engine.train) makes it trainable; an eval job at a layout
(engine.evaluation.job) scores it as it is."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from megatrain.engine.build import PARAM_DTYPES, ModelConfig, RankModel, build_model
from megatrain.engine.checkpoint import open_folder, resolve_init_from
from megatrain.engine.checkpoint.training import load_model_weights
from megatrain.engine.config import TrainConfig, t5_config, transformer_config
from megatrain.engine.materialize import WeightSource
from megatrain.engine.models.t5 import T5Config
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.sink import RunLog
from megatrain.failures import Activity
from megatrain.settings import get_settings
from megatrain.spec import JobSpec, SpecError
from megatrain.spec_attention import runtime_problem as attention_runtime_problem
from megatrain.spec_packages import installed_packages, package_problems
from megatrain.storage import StorageError


def worker_model_config(spec: JobSpec, vocab_size: int, device: str, precision: str) -> ModelConfig:
    """The model's config (a T5Config for arch t5); a package the spec needs and this worker lacks,
    or an attention backend it cannot run (no GPU, fp32), fails here, before the model is built."""
    missing = package_problems(spec, {"this worker": installed_packages()}, "this worker")
    if missing:
        raise SpecError(missing)
    if spec.model.arch == "t5":  # (its attention is SDPA's: the spec allows no other backend)
        return t5_config(spec, vocab_size)
    mcfg = dataclasses.replace(transformer_config(spec, vocab_size), hf_family=_hf_family(spec))
    problem = attention_runtime_problem(mcfg.attention_backend, torch.device(device).type, precision)
    if problem:
        raise SpecError([{"field": "model.attention_backend", "message": problem}])
    return mcfg


def start_rank_model(
    spec: JobSpec,
    mcfg: ModelConfig,
    cfg: TrainConfig,
    state: ParallelState,
    device: str,
    init_from: str | None,
    activity: Activity,
    log: RunLog,
) -> RankModel:
    """This rank's shards in cfg.precision's dtype, from the seeded initial weights, a Hugging Face
    folder read by slice or a job's checkpoint (init_from): only what the rank keeps is ever read."""
    hf_start = (init_from or "").startswith("hf:")
    activity.phase = "init" if hf_start else "model"  # a Hugging Face start reads while it builds
    adapters = None
    start = spec.model.adapter_from
    if start and cfg.lora and init_from == spec.model.init_from:  # a first attempt
        from megatrain.engine.interop.peft_load import checkpoint_adapter_source, peft_adapter_source

        if start.startswith("checkpoint:"):
            storage = get_settings().resolved_storage_url
            adapters = checkpoint_adapter_source(start, init_from, cfg.lora, storage)
            log.say(f"adapters start from {start}'s (a LoRA fine-tune continued)")
        else:
            adapters = peft_adapter_source(start, mcfg, cfg.lora)
            log.say(f"adapters start from the PEFT folder at {start.removeprefix('hf:')}")
    with _hf_weights(init_from, mcfg) as hf:
        dtype = PARAM_DTYPES[cfg.precision]
        model = build_model(
            mcfg, state, cfg.seed, device, dtype=dtype, weights=hf, lora=cfg.lora, adapters=adapters
        )
    if hf_start:
        log.say(f"initialised from the Hugging Face model at {str(init_from).removeprefix('hf:')}")
    elif init_from:
        activity.phase = "init"
        _init_from_checkpoint(model, init_from, log)
    return model


def _hf_family(spec: JobSpec) -> str | None:
    """The Hugging Face family of the weights a fine-tune starts from (its folder's model_type, or
    what the checkpoint it starts from recorded), kept so that an export names the model after it."""
    init_from = spec.model.init_from or ""
    try:
        if init_from.startswith("hf:"):
            from megatrain.engine.interop.hf import read_hf_config

            return read_hf_config(init_from.removeprefix("hf:")).get("model_type")
        if init_from.startswith("checkpoint:"):
            src = resolve_init_from(init_from, get_settings().resolved_storage_url)
            return open_folder(src, weights_only=True).model_config.hf_family
    except (OSError, ValueError, StorageError):  # a name only: the start itself reports what is missing
        return None
    return None


@contextlib.contextmanager
def _hf_weights(init_from: str | None, mcfg: ModelConfig) -> Iterator[WeightSource | None]:
    """A fine-tune's Hugging Face folder (init_from hf:URL) opened for build_model to read by slice:
    each rank reads only the elements it keeps (interop.hf_slices; a T5's: interop.hf_t5); None for
    any other start."""
    if not (init_from or "").startswith("hf:"):
        yield None
        return
    if isinstance(mcfg, T5Config):
        from megatrain.engine.interop.hf_t5 import t5_hf_slices

        with t5_hf_slices(str(init_from).removeprefix("hf:"), mcfg) as weights:
            yield weights.fill
        return
    from megatrain.engine.interop.hf_slices import hf_slices

    # hf_slices names every field where the folder disagrees with the spec's model.
    with hf_slices(str(init_from).removeprefix("hf:"), mcfg) as weights:
        yield weights.fill


def _init_from_checkpoint(model: RankModel, init_from: str, log: RunLog) -> None:
    """A fine-tune's starting weights from a job's checkpoint (the first attempt only: a retry
    resumes its own checkpoint): this rank's boxes of it."""
    src = resolve_init_from(init_from, get_settings().resolved_storage_url)
    step = load_model_weights(src, model)
    log.say(f"initialised from {src} (step {step})")
