"""A LoRA run's exports: its model merged into a plain Hugging Face folder, or its adapters alone as a
PEFT folder.

Merged: each adapted linear's weight becomes W + s·B̃·A, B̃ being B expanded to (out, parts·r) as
engine.lora computes it (each output row takes its update from its own part's r columns), which is
the model PEFT's merge_and_unload gives; every other tensor passes through, so export_hf writes it
like any model. Adapter: adapter_config.json + adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(base, folder)` loads on the base the same run froze. Both ask for
tensors by canonical name only, through `get_tensor` (a CheckpointReader's, say; a checkpoint's
merged export is interop.hf.export_checkpoint_hf's).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megatrain.engine.checkpoint import CheckpointReader
from megatrain.engine.config import LoRAConfig, TransformerConfig, lora_config
from megatrain.engine.interop.hf import DTYPE_NAMES, folder_store, put_files
from megatrain.engine.interop.peft import (
    adapter_to_peft,
    dumps_config,
    peft_config,
)
from megatrain.engine.lora import adapted_target, merged_weight
from megatrain.hf_config import hf_config_from_model
from megatrain.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS

GetTensor = Callable[[str], torch.Tensor]


def hf_model_type(cfg: TransformerConfig) -> str:
    """The config.json model_type export_hf writes for `cfg` (the base an adapter loads on)."""
    return hf_config_from_model(cfg.to_dict())["model_type"]


def merged_tensor_source(get_tensor: GetTensor, cfg: TransformerConfig, lora: LoRAConfig) -> GetTensor:
    """get_tensor with the adapters merged: an adapted linear's weight is W + scale·B̃·A, computed in
    fp32 one tensor at a time (engine.lora.merged_weight; returned fp32: the caller casts); every
    other name passes through."""

    def get(name: str) -> torch.Tensor:
        if adapted_target(name, lora) is None:
            return get_tensor(name)
        return merged_weight(name, get_tensor(name).float(), get_tensor, cfg, lora)

    return get


def export_adapter(
    get_tensor: GetTensor,
    cfg: TransformerConfig,
    lora: LoRAConfig,
    model_type: str,
    dest: str | Path,
    *,
    base_model: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_files: dict[str, bytes | Path] | None = None,
) -> list[str]:
    """Write a PEFT adapter folder at `dest` (a directory or a file:// / s3:// URL):
    adapter_model.safetensors in `dtype`, the given tokenizer files, and adapter_config.json last (a
    folder with one is complete). base_model is recorded as base_model_name_or_path. Returns the keys
    written, in order."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype} is not one of {', '.join(DTYPE_NAMES.values())}")
    # The adapters are r/width of the model: held at once. Own storage: safetensors refuses shared views.
    tensors = {
        name: t.detach().to(device="cpu", dtype=dtype).contiguous().clone()
        for name, t in adapter_to_peft(get_tensor, cfg, lora, model_type).items()
    }
    store = folder_store(dest)
    with tempfile.TemporaryDirectory(prefix="peft-export-") as tmp:
        path = Path(tmp) / ADAPTER_WEIGHTS
        save_file(tensors, str(path), metadata={"format": "pt"})
        store.put_file(ADAPTER_WEIGHTS, path)
    written = [ADAPTER_WEIGHTS, *put_files(store, tokenizer_files or {})]
    store.put_bytes(ADAPTER_CONFIG, dumps_config(peft_config(cfg, lora, model_type, base_model)))
    return [*written, ADAPTER_CONFIG]


def export_checkpoint_adapter(checkpoint: str | Path, dest: str | Path, **kwargs: Any) -> list[str]:
    """export_adapter of a LoRA run's sharded checkpoint (a step's folder, or a root's latest); keyword
    arguments as export_adapter's. ValueError for a checkpoint that trained every weight."""
    reader = CheckpointReader(checkpoint)
    lora = lora_config(reader.spec)
    if lora is None:
        raise ValueError(
            f"step {reader.step} trained every weight (training.method is 'full'): it has no LoRA adapters"
        )
    cfg = reader.model_config
    return export_adapter(reader.tensor, cfg, lora, hf_model_type(cfg), dest, **kwargs)
