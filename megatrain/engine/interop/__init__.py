"""Interoperability with other formats: Hugging Face transformers folders (safetensors)."""

from megatrain.engine.interop.hf import (
    export_checkpoint_hf,
    export_hf,
    export_model_hf,
    hf_transformer_config,
    load_hf_model,
    load_hf_state,
    read_hf_config,
)

__all__ = [
    "export_checkpoint_hf",
    "export_hf",
    "export_model_hf",
    "hf_transformer_config",
    "load_hf_model",
    "load_hf_state",
    "read_hf_config",
]
