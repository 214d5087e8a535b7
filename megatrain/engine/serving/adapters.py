"""Many LoRA adapters over one loaded base, each row of a batch with its own (S-LoRA / Punica).

A LoRA job's checkpoint holds its adapters only and names its frozen base (checkpoint.lora_base):
the server keeps that base once and every adapter trained on it beside it. Each target linear
(attn.qkv, attn.proj, mlp.fc1, mlp.fc2, and a shared expert's) gets a BatchedLoRA as its `lora`
(models.gpt.Linear adds its output), holding every loaded adapter's factors stacked:
A (N, R, in) and B̃ (N, out, R), slot 0 all zeros for rows without an adapter, R the largest
parts·rank loaded (smaller ones zero-padded: zero columns add exact zeros). A forward gathers each
row's pair and runs two batched matmuls, y_b += (x_b A_bᵀ) B̃_bᵀ, Punica's BGMV in plain torch: rows of
different adapters share one forward of the base. B̃ is B expanded over its fused parts (engine.lora:
Llama's q/k/v in one qkv, gate/up in one fc1) with the scale folded in, so row b's update is exactly
what its LoRA module adds in training, unmerged.

Adapters are read (from storage, in a request's thread) apart from being installed (on the batching
thread, between forwards), so loading one never stalls the running batch for longer than a cat.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.engine.checkpoint import CheckpointReader
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.lora import TARGETS, expand_B, lora_targets, part_of_rows

LINEAR_TARGETS = tuple(t for t in TARGETS if t != "experts")


class AdapterError(ValueError):
    """An adapter this server cannot serve (not LoRA, another base, routed experts); says why."""


@dataclass(frozen=True)
class Adapter:
    """One checkpoint's adapters: per target linear (canonical name), A (parts·r, in) and the scaled,
    expanded B̃ (out, parts·r), in fp32."""

    key: str
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


class RowAdapters:
    """Which adapter slot each row of the next forward uses; shared by every BatchedLoRA."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # (B,) slot per row
        self.active = False
        """Whether any row has an adapter (else the adapters are skipped altogether)."""

    def select(self, slots: list[int], device: torch.device) -> None:
        self.active = any(slots)
        self.rows = torch.tensor(slots, device=device) if self.active else None


class BatchedLoRA(nn.Module):
    """Every loaded adapter of one linear, stacked; each row of x (B, T, in) takes its own."""

    def __init__(self, selection: RowAdapters, in_features: int, out_features: int, like: torch.Tensor):
        super().__init__()
        self.selection = selection
        # Buffers, not parameters: nothing here trains, and `parameters()` stays the base's.
        self.register_buffer("A", like.new_zeros(1, 0, in_features), persistent=False)
        self.register_buffer("B", like.new_zeros(1, out_features, 0), persistent=False)

    @property
    def enabled(self) -> bool:
        return self.selection.active

    def add(self, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Append one adapter's slot: A (R_i, in), B̃ (out, R_i), or zeros where it has none here."""
        a_all, b_all = self.A, self.B
        width = max(a_all.shape[1], 0 if a is None else a.shape[0])
        a_all = F.pad(a_all, (0, 0, 0, width - a_all.shape[1]))  # (N, width, in)
        b_all = F.pad(b_all, (0, width - b_all.shape[2]))  # (N, out, width)
        new_a = a_all.new_zeros(1, width, a_all.shape[2])
        new_b = b_all.new_zeros(1, b_all.shape[1], width)
        if a is not None and b is not None:
            new_a[0, : a.shape[0]] = a.to(new_a.dtype)
            new_b[0, :, : b.shape[1]] = b.to(new_b.dtype)
        self.A, self.B = torch.cat([a_all, new_a]), torch.cat([b_all, new_b])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.selection.rows
        assert rows is not None
        a, b = self.A[rows], self.B[rows]  # (B, R, in), (B, out, R)
        u = torch.bmm(x, a.transpose(1, 2))  # (B, T, R)
        return torch.bmm(u, b.transpose(1, 2))  # (B, T, out)

    def extra_repr(self) -> str:
        return f"adapters={self.A.shape[0] - 1}, width={self.A.shape[1]}"


def read_adapter(url: str, base: str | None, mcfg: TransformerConfig) -> Adapter:
    """The adapters at `url`: a LoRA checkpoint folder, checked to sit on this server's base
    (`base`, the serve job's model.init_from, and the same model shape), or `hf:FOLDER`, a PEFT
    adapter folder (the API registered it over this base: api/models); AdapterError if not."""
    if url.startswith("hf:"):
        return _read_peft(url, mcfg)
    reader = CheckpointReader(url)
    try:
        lora = reader.lora
        if lora is None:
            raise AdapterError(f"{url} is not a LoRA checkpoint: its job trained every weight")
        trained_on = reader.folder.trainer_state.get("base_init_from")
        if trained_on != base:
            raise AdapterError(f"{url} holds adapters of {trained_on}; this server holds {base}")
        if _shape(reader.model_config) != _shape(mcfg):
            raise AdapterError(f"{url} was trained on a model of another shape than this server's")
        full = {name: reader.tensor(name, torch.float32) for name in reader.names() if ".lora." in name}
    finally:
        reader.close()
    return _adapter(url, lora, full, mcfg)


def _read_peft(url: str, mcfg: TransformerConfig) -> Adapter:
    from megatrain.engine.interop.peft_load import read_peft_adapter

    try:
        lora, full = read_peft_adapter(url, mcfg)
    except ValueError as exc:
        raise AdapterError(str(exc).removeprefix("model.adapter_from: ")) from None
    return _adapter(url, lora, {k: v.float() for k, v in full.items()}, mcfg)


def _adapter(url: str, lora: LoRAConfig, full: dict[str, torch.Tensor], mcfg: TransformerConfig) -> Adapter:
    """Each target linear's A (parts·r, in) and scaled, expanded B̃ from canonical `….lora.A/B`."""
    if "experts" in lora.targets and mcfg.moe is not None:
        raise AdapterError(f"{url} has adapters on routed experts, which the server cannot batch yet")
    factors = {}
    for name, a in full.items():
        if not name.endswith(".lora.A"):
            continue
        linear = name.removesuffix(".lora.A")
        b = full[f"{linear}.lora.B"]  # (out, r)
        shared = ".shared_expert." in linear and mcfg.moe is not None
        ffn = mcfg.moe.shared_expert_ffn_hidden_size if shared and mcfg.moe else None
        part = part_of_rows(linear.rsplit(".", 1)[-1], mcfg, ffn)
        if part is not None:
            b = expand_B(b, F.one_hot(part, int(part.max()) + 1).float())  # (out, parts·r)
        factors[linear] = (a, b * lora.scale)
    if not factors:
        raise AdapterError(f"{url} holds no adapters")
    return Adapter(url, factors)


def _shape(cfg: TransformerConfig) -> dict[str, object]:
    fields = cfg.to_dict()
    fields.pop("hf_family", None)  # a name only
    return fields


class AdapterBank:
    """The adapters a server has loaded, by key (a checkpoint URL), each in one slot of every
    target linear's BatchedLoRA. `read` may run on any thread; `install` and `select` on the one
    that runs the model."""

    def __init__(self, model: nn.Module, mcfg: TransformerConfig, base: str | None):
        self.mcfg, self.base = mcfg, base
        self.selection = RowAdapters()
        self.linears: dict[str, BatchedLoRA] = {}
        for name, linear in list(lora_targets(model, LINEAR_TARGETS)):
            out_f, in_f = linear.weight.shape
            linear.lora = BatchedLoRA(self.selection, in_f, out_f, linear.weight.detach())
            self.linears[name] = linear.lora
        self.slots: dict[str, int] = {}
        self._read: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def read(self, url: str) -> Adapter:
        """The adapter at `url`, read once (later calls return the same)."""
        with self._lock:
            if url in self._read:
                return self._read[url]
        adapter = read_adapter(url, self.base, self.mcfg)
        unknown = set(adapter.factors) - set(self.linears)
        if unknown:
            raise AdapterError(f"{url} has adapters on {sorted(unknown)[0]}, which this model lacks")
        for name, (a, b) in adapter.factors.items():
            want = (self.linears[name].A.shape[2], self.linears[name].B.shape[1])
            if (a.shape[1], b.shape[0]) != want:
                raise AdapterError(
                    f"{url}: {name}'s adapter is {a.shape[1]} -> {b.shape[0]}, the linear {want}"
                )
        with self._lock:
            return self._read.setdefault(url, adapter)

    def install(self, adapter: Adapter) -> int:
        """The adapter's slot (installed on first use; slot 0 is no adapter)."""
        slot = self.slots.get(adapter.key)
        if slot is not None:
            return slot
        for name, stacked in self.linears.items():
            a, b = adapter.factors.get(name, (None, None))
            stacked.add(a, b)
        slot = self.slots[adapter.key] = len(self.slots) + 1
        return slot

    @contextlib.contextmanager
    def selected(self, slots: list[int], device: torch.device) -> Iterator[None]:
        """Row b of the forwards inside uses slot slots[b]; outside, the model is the base alone."""
        self.selection.select(slots, device)
        try:
            yield
        finally:
            self.selection.select([], device)
