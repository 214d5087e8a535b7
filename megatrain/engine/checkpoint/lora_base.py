"""The frozen base of a LoRA run's checkpoint, read back from where it came from.

A LoRA run's checkpoints hold its adapters (and their optimizer state) only: the base never changes,
so writing it at every save would cost a full model's bytes for nothing. trainer_state.json says
`adapters_only` and names the base (`base_init_from`, the spec's init_from): a Hugging Face folder
(`hf:URL`, read by slice), another job's checkpoint (`checkpoint:JOB[@STEP]`, merged if it is a
LoRA checkpoint too), or nothing, meaning the initial weights the run's seed draws (models.init).
`BaseWeights.tensor(name)` gives one full base tensor at a time, so an export or a download of a
LoRA checkpoint still never holds more than the tensors it asked for.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatrain.engine.config import TransformerConfig


def seeded_init_seed(seed: int) -> int:
    """The init_seed GPTModel draws after `torch.manual_seed(seed)` (engine.build.build_model), from
    a generator of its own: the global stream is left alone."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return int(torch.randint(0, 2**62, (1,), device="cpu", generator=gen))


def base_shapes(mcfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every base parameter's full shape (a tied head only as embed.weight), built on meta."""
    from megatrain.engine.models.gpt import GPTModel

    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = GPTModel(mcfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


class BaseWeights:
    """Full tensors of a LoRA checkpoint's base, one at a time; close() releases open files."""

    def __init__(self, init_from: str | None, mcfg: TransformerConfig, seed: int):
        self.shapes = base_shapes(mcfg)
        self._stack = contextlib.ExitStack()
        self._reader: Any = None
        self._fill: Any = None
        if init_from is None:
            from megatrain.engine.materialize import init_source

            self._fill = init_source(seeded_init_seed(seed), mcfg)
        elif init_from.startswith("hf:"):
            from megatrain.engine.interop.hf_slices import hf_slices

            self._fill = self._stack.enter_context(hf_slices(init_from.removeprefix("hf:"), mcfg)).fill
        elif init_from.startswith("checkpoint:"):
            from megatrain.engine.checkpoint.sharded import CheckpointReader, resolve_init_from
            from megatrain.settings import get_settings

            self._reader = CheckpointReader(resolve_init_from(init_from, get_settings().resolved_storage_url))
        else:
            raise ValueError(f"a LoRA checkpoint's base {init_from!r} is not hf:URL or checkpoint:JOB")

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(f"the base model has no tensor {name!r}")
        if self._reader is not None:
            return self._reader.merged_tensor(name).to(dtype)
        shape = self.shapes[name]
        out = torch.empty(shape, dtype=dtype)
        self._fill(name, shape, (0,) * len(shape), out)
        return out

    def close(self) -> None:
        self._stack.close()
        if self._reader is not None:
            self._reader.close()
