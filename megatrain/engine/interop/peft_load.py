"""`model.adapter_from`: a run's LoRA adapters start from a PEFT folder's (`hf:URL`), or from a
LoRA job's checkpoint (`checkpoint:JOB_ID[@STEP]`: continuing a LoRA fine-tune).

The folder's adapter_config.json (or the job's training.lora) must describe the adapters the spec
trains (rank, alpha, targets, rsLoRA): a mismatch is named field by field rather than silently
retrained from another shape. A PEFT folder's tensors are mapped to ours
(interop.peft.adapter_from_peft); a checkpoint's are ours already, and must sit on the same base
(its base_init_from is the run's model.init_from). Either is handed to build_model as a weight
source; adapters are small, so they are read whole, once.
"""

from __future__ import annotations

import json

import torch

from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.interop.peft import (
    adapter_from_peft,
    lora_from_peft_config,
)
from megatrain.engine.materialize import WeightSource
from megatrain.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatrain.storage import StorageError, read_url


def _read(url: str) -> bytes:
    try:
        with read_url(url) as f:
            return f.read()
    except (StorageError, OSError) as exc:
        raise ValueError(f"model.adapter_from: cannot read {url}: {exc}") from None


def adapter_problems(theirs: LoRAConfig, ours: LoRAConfig) -> list[str]:
    """Each way the folder's adapters differ from the ones training.lora asks for."""
    pairs = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules", "use_rslora": "use_rslora"}
    out = []
    for field, peft_name in pairs.items():
        a, b = getattr(theirs, field), getattr(ours, field)
        if a != b:
            out.append(f"the adapter's {peft_name} gives {a!r}, training.lora.{field} is {b!r}")
    return out


def read_peft_adapter(url: str, mcfg: TransformerConfig) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """The settings and canonical adapter tensors (`….lora.A/B`) of the PEFT folder at `url`
    (`hf:` prefix optional) for a model of `mcfg`; ValueError naming what is wrong."""
    from safetensors.torch import load as load_safetensors

    from megatrain.engine.interop.lora_export import hf_model_type

    folder = url.removeprefix("hf:").rstrip("/")
    config = json.loads(_read(f"{folder}/{ADAPTER_CONFIG}"))
    try:
        lora = lora_from_peft_config(config)
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"model.adapter_from: {folder}/{ADAPTER_CONFIG} is not a LoRA adapter: {exc}"
        ) from None
    tensors = load_safetensors(_read(f"{folder}/{ADAPTER_WEIGHTS}"))
    try:
        return lora, adapter_from_peft(tensors, mcfg, lora, hf_model_type(mcfg))
    except KeyError as exc:
        raise ValueError(f"model.adapter_from: {exc.args[0]}") from None


def peft_adapter_source(url: str, mcfg: TransformerConfig, lora: LoRAConfig) -> WeightSource:
    """A weight source for the adapters (canonical `….lora.A/B` names) of the PEFT folder at `url`,
    which must be the adapters training.lora (`lora`) describes."""
    theirs, full = read_peft_adapter(url, mcfg)
    problems = adapter_problems(theirs, lora)
    if problems:
        raise ValueError(f"model.adapter_from: {'; '.join(problems)}")
    return _source(full)


def checkpoint_adapter_source(
    ref: str, init_from: str | None, lora: LoRAConfig, storage_url: str
) -> WeightSource:
    """A weight source for the adapters of a LoRA job's checkpoint (`checkpoint:JOB_ID[@STEP]`),
    which must have been trained on `init_from` (the run's base) with the adapters `lora` asks for."""
    from megatrain.engine.checkpoint import CheckpointReader
    from megatrain.engine.checkpoint.sharded import resolve_init_from

    try:
        url = resolve_init_from(ref, storage_url)
        reader = CheckpointReader(url)
    except (FileNotFoundError, StorageError, OSError, ValueError) as exc:
        raise ValueError(f"model.adapter_from: cannot read {ref}: {exc}") from None
    try:
        theirs = reader.lora
        if theirs is None:
            raise ValueError(f"model.adapter_from: {ref} is a full fine-tune's checkpoint, not LoRA adapters")
        problems = adapter_problems(theirs, lora)
        if problems:
            raise ValueError(f"model.adapter_from: {'; '.join(problems)}")
        trained_on = reader.folder.trainer_state.get("base_init_from")
        if trained_on != init_from:
            raise ValueError(
                f"model.adapter_from: {ref} holds adapters of {trained_on}, model.init_from is {init_from}"
            )
        full = {name: reader.tensor(name) for name in reader.names() if ".lora." in name}
    finally:
        reader.close()
    return _source(full)


def _source(full: dict[str, torch.Tensor]) -> WeightSource:
    """build_model's weight source over whole adapter tensors: each rank copies its shard's box."""

    def fill(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor) -> None:
        t = full[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"model.adapter_from: {name} is {tuple(t.shape)}, the model needs {shape}")
        box = tuple(slice(o, o + n) for o, n in zip(offsets, out.shape, strict=True))
        out.copy_(t[box])

    return fill
