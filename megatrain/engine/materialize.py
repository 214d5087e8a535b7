"""A rank's model, built on the meta device and sharded there, made real one parameter at a time.

engine.build constructs the whole GPTModel (or T5Model) on the meta device (shapes only), applies
tensor, expert and context parallelism and keeps this rank's pipeline chunks, all without memory.
`materialize` then allocates each parameter this rank keeps at its shard's shape, in the training
dtype, on the device, and fills it box by box (checkpoint.shards' global boxes: a tensor-parallel
shard is one box per stride part, an expert shard is moved to its experts) from a weight source: the
seeded initial values (models.init) or a Hugging Face folder read by slice (interop.hf_slices).
Nothing on a rank is ever the size of the whole model: the peak is the rank's shard plus one source
chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatrain.engine.checkpoint.shards import global_shape, param_boxes
from megatrain.engine.config import TransformerConfig
from megatrain.engine.lora import is_lora_name, lora_init_rule
from megatrain.engine.models.gpt import rope_tables
from megatrain.engine.models.init import fill_box, init_rule
from megatrain.engine.models.t5 import T5Config, t5_init_rule
from megatrain.engine.parallel.state import ParallelState

WeightSource = Callable[[str, tuple[int, ...], tuple[int, ...], torch.Tensor], None]
"""fill(canonical name, full shape, box offsets, box) writes the values of that box of the full
single-device tensor into the box (a view of the rank's parameter)."""


def init_source(seed: int, cfg: TransformerConfig | T5Config) -> WeightSource:
    """The initial weights GPTModel(cfg) (T5Model(cfg) for a T5Config) draws from `seed`
    (models.init), box by box."""
    model_rule = t5_init_rule if isinstance(cfg, T5Config) else init_rule

    def fill(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor) -> None:
        rule = lora_init_rule(name, shape[-1]) if is_lora_name(name) else model_rule(name, cfg)  # type: ignore[arg-type]
        fill_box(out, seed=seed, name=name, shape=shape, offsets=offsets, rule=rule)

    return fill


class MissingTensor(KeyError):
    """A WeightSource has no value for a canonical tensor (a Hugging Face folder without the new
    classifier a fine-tune adds): with_fallback asks another source."""


def with_fallback(first: WeightSource, then: WeightSource) -> WeightSource:
    """`first`, and `then` (the seeded initial values) for what `first` lacks (MissingTensor)."""

    def fill(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor) -> None:
        try:
            first(name, shape, offsets, out)
        except MissingTensor:
            then(name, shape, offsets, out)

    return fill


def with_adapters(base: WeightSource, adapters: WeightSource) -> WeightSource:
    """`base` (a Hugging Face folder, say) for the model's own weights, `adapters` (the seeded
    initial values, or a PEFT folder's) for its LoRA adapters."""

    def fill(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor) -> None:
        (adapters if is_lora_name(name) else base)(name, shape, offsets, out)

    return fill


@torch.no_grad()
def materialize(
    module: nn.Module,
    names: dict[nn.Parameter, str],
    state: ParallelState,
    cfg: TransformerConfig | T5Config,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    fill: WeightSource,
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Replace every meta parameter of `module` by a real one of the same shape and markers (a shared
    one stays shared), filled from `fill` under its canonical name; RoPE's tables are computed on
    the device. names: canonical name of each meta parameter (RankModel.parameter_names).
    convert(name, filled) may hand back another representation of a frozen tensor (QLoRA's NF4),
    right after it is filled: the peak stays one filled tensor beyond what the rank keeps."""
    real: dict[nn.Parameter, nn.Parameter] = {}
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if p not in real:
                data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                shape = global_shape(p, state)
                for box in param_boxes(p, data, state):
                    fill(names[p], shape, box.offsets, box.data)
                if convert is not None:
                    data = convert(names[p], data)
                new = nn.Parameter(data, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # tensor/sequence/expert-parallel markers, `shared`
                real[p] = new
            mod._parameters[key] = real[p]
    tables: tuple[torch.Tensor, torch.Tensor] | None = None
    for mod in module.modules():
        for key, b in list(mod._buffers.items()):
            if b is None or not b.is_meta:
                continue
            if key not in ("rope_cos", "rope_sin"):
                raise ValueError(f"no rule materialises the buffer {key!r} of {type(mod).__name__}")
            if tables is None:
                cos, sin = rope_tables(cfg.seq_length, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
                tables = cos.to(device), sin.to(device)
            mod._buffers[key] = tables[0] if key == "rope_cos" else tables[1]
