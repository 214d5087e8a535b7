"""`model.adapter_from: hf:URL`: a run's LoRA adapters start from a PEFT folder's.

The folder's adapter_config.json must describe the adapters the spec trains (rank, alpha, targets,
rsLoRA): a mismatch is named field by field rather than silently retrained from another shape.
Its tensors are mapped to ours (interop.peft.adapter_from_peft) and handed to build_model as a
weight source; adapters are small, so the folder is read whole, once.
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


def peft_adapter_source(url: str, mcfg: TransformerConfig, lora: LoRAConfig) -> WeightSource:
    """A weight source for the adapters (canonical `….lora.A/B` names) of the PEFT folder at `url`."""
    from safetensors.torch import load as load_safetensors

    from megatrain.engine.interop.lora_export import hf_model_type

    folder = url.removeprefix("hf:").rstrip("/")
    config = json.loads(_read(f"{folder}/{ADAPTER_CONFIG}"))
    try:
        theirs = lora_from_peft_config(config)
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"model.adapter_from: {folder}/{ADAPTER_CONFIG} is not a LoRA adapter: {exc}"
        ) from None
    problems = adapter_problems(theirs, lora)
    if problems:
        raise ValueError(f"model.adapter_from: {'; '.join(problems)}")
    model_type = hf_model_type(mcfg)
    tensors = load_safetensors(_read(f"{folder}/{ADAPTER_WEIGHTS}"))
    try:
        full = adapter_from_peft(tensors, mcfg, lora, model_type)
    except KeyError as exc:
        raise ValueError(f"model.adapter_from: {exc.args[0]}") from None

    def fill(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor) -> None:
        t = full[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"model.adapter_from: {name} is {tuple(t.shape)}, the model needs {shape}")
        box = tuple(slice(o, o + n) for o, n in zip(offsets, out.shape, strict=True))
        out.copy_(t[box])

    return fill
