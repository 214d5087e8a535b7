"""The base a serve job holds, from its spec: model.init_from names it, as for a fine-tune's start.

- hf:URL: a Hugging Face folder, built on the meta device and filled by slice (engine.build), as a
  fine-tune from that folder starts; the LoRA jobs trained on it name the same base.
- checkpoint:JOB[@STEP]: a job's checkpoint; a LoRA job's with its adapters merged (load_checkpoint),
  which is how a job trained from the seeded initial weights is served.

The tokenizer is the spec's (data.tokenizer) and the chat template its data.chat_template, which the
API copies from the fine-tuned job (or points at a registered folder's tokenizer_config.json).
A BERT (arch bert) loads the same ways, as a BertModel: the job embeds with it (embeddings.py)
instead of generating; a T5 is not served yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.engine.build import PARAM_DTYPES, build_model
from megatrain.engine.checkpoint import load_checkpoint, resolve_init_from
from megatrain.engine.config import transformer_config
from megatrain.engine.data import build_tokenizer
from megatrain.engine.data.chat_templates import ChatTemplate, load_chat_template
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.runtime import effective_precision
from megatrain.settings import get_settings
from megatrain.spec import JobSpec


@dataclass
class Served:
    model: GPTModel
    tokenizer: Tokenizer
    template: ChatTemplate
    base: str | None
    """The spec's model.init_from: what the adapters it serves must have been trained on."""
    precision: str


def load_served(spec: JobSpec, device: str) -> Served:
    """The spec's base model (eval mode, on `device`, in its precision), tokenizer and template; a
    BertModel for arch bert (the model's config says: is_encoder)."""
    if spec.model.arch == "t5":
        raise ValueError("model.arch t5 cannot be served yet (a serve job holds a GPT or a BERT)")
    tokenizer = build_tokenizer(spec.data.tokenizer)
    wanted = spec.training.precision
    precision = effective_precision("bf16" if wanted == "fp8" else wanted, device)
    dtype = PARAM_DTYPES[precision]
    init_from = spec.model.init_from
    if init_from is not None and init_from.startswith("checkpoint:"):
        url = resolve_init_from(init_from, get_settings().resolved_storage_url)
        model, _ = load_checkpoint(url, device)
    else:
        mcfg = transformer_config(spec, tokenizer.vocab_size)
        state = ParallelState.single(device)
        if init_from is None:  # the seeded initial weights (a smoke test's model)
            model = build_model(mcfg, state, spec.training.seed, device, dtype=dtype).module
        else:
            from megatrain.engine.interop.hf_slices import hf_slices

            with hf_slices(init_from.removeprefix("hf:"), mcfg) as weights:
                model = build_model(
                    mcfg, state, spec.training.seed, device, dtype=dtype, weights=weights.fill
                ).module
    if not isinstance(model, GPTModel):  # a T5's checkpoint named by a spec of another arch
        raise ValueError(f"{init_from} holds a {type(model).__name__}, which cannot be served")
    model = model.to(dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return Served(model, tokenizer, load_chat_template(spec.data.chat_template), init_from, precision)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
