"""LoRA adapters <-> PEFT's folder format (`adapter_config.json` + `adapter_model.safetensors`).

An adapter sits on one of our canonical linears; its Hugging Face twin may be several linears
(Llama's q/k/v_proj for our qkv, gate/up_proj for a gated fc1), each with its own PEFT adapter:
engine.lora keeps one A per part and takes each output row's update from its part, so the mapping
is exact both ways. B's rows follow the base weight's own row mapping (hf_mapping's rules: the
qkv regrouping, GPT-2's [q; k; v] columns), A is split by part. PEFT's names are the HF module's
name under `base_model.model.` with `.lora_A.weight` / `.lora_B.weight`.

Routed experts' adapters are PEFT's on transformers' stacked expert tensors (target_parameters
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, each wrapped in turn: gate_up's adapter is
the inner one, `experts.base_layer.lora_*`, down's `experts.lora_*`). Its lora_A (E·r, in) stacks
the experts' A; its lora_B (out, r·E) interleaves them, column j·E + e being expert e's column j.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.interop.hf_mapping import Rule, rules_for
from megatrain.engine.lora import LoRAConfig
from megatrain.peft_config import EXPERT_PARAMETERS, lora_settings

PEFT_PREFIX = "base_model.model."
TARGET_SUFFIXES = {"qkv": ("attn.qkv.weight",), "proj": ("attn.proj.weight",),
                   "fc1": ("mlp.fc1.weight", "shared_expert.fc1.weight"),
                   "fc2": ("mlp.fc2.weight", "shared_expert.fc2.weight")}  # fmt: skip


def _target_rules(cfg: TransformerConfig, lora: LoRAConfig, model_type: str) -> list[Rule]:
    suffixes = tuple("." + s for t in lora.targets for s in TARGET_SUFFIXES.get(t, ()))
    return [r for r in rules_for(cfg, model_type) if r.name.endswith(suffixes)]


def _expert_modules(cfg: TransformerConfig, lora: LoRAConfig) -> list[tuple[str, str]]:
    """(our ExpertLoRA prefix, PEFT's module) for each stacked expert weight's adapters."""
    if "experts" not in lora.targets or cfg.moe is None:
        return []
    out = []
    for layer in range(cfg.num_layers):
        if cfg.moe.is_moe_layer(layer):
            ours = f"layers.{layer}.mlp.experts.lora."
            peft = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts."
            out += [(ours + "fc1", peft + "base_layer."), (ours + "fc2", peft)]
    return out


def _b_to_hf(rule: Rule, b: torch.Tensor, model_type: str) -> tuple[torch.Tensor, ...]:
    """B (out, r) in our row order -> each HF linear's B (its out, r), rows mapped like the weight."""
    if model_type == "gpt2":  # the rule maps a Conv1D (in, out) weight: undo its transpose for B
        return tuple(t.t() for t in rule.to_hf(b))
    return rule.to_hf(b)


def adapter_to_peft(
    get_tensor: Callable[[str], torch.Tensor], cfg: TransformerConfig, lora: LoRAConfig, model_type: str
) -> dict[str, torch.Tensor]:
    """PEFT's state dict of the adapters; get_tensor(canonical name) returns a full tensor."""
    out: dict[str, torch.Tensor] = {}
    for rule in _target_rules(cfg, lora, model_type):
        base = rule.name.removesuffix(".weight")
        bs = _b_to_hf(rule, get_tensor(base + ".lora.B"), model_type)
        a_parts = get_tensor(base + ".lora.A").chunk(len(bs))
        for hf, a, b in zip(rule.hf, a_parts, bs, strict=True):
            module = PEFT_PREFIX + hf.removesuffix(".weight")
            out[module + ".lora_A.weight"] = a.contiguous()
            out[module + ".lora_B.weight"] = b.contiguous()
    for ours, module in _expert_modules(cfg, lora):
        a, b = get_tensor(ours + "_A"), get_tensor(ours + "_B")  # (E, r, in), (E, out, r)
        out[module + "lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()  # (E·r, in)
        out[module + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()  # (out, r·E)
    return out


def adapter_from_peft(
    tensors: dict[str, torch.Tensor], cfg: TransformerConfig, lora: LoRAConfig, model_type: str
) -> dict[str, torch.Tensor]:
    """Our canonical adapter tensors (`….lora.A`, `….lora.B`) from PEFT's state dict. The parts of
    one fused linear must share the rank. A part without adapters (PEFT's default for Llama targets
    q_proj and v_proj, not k_proj; our qkv is one linear) gets zero factors: its update is exactly
    zero, and stays so in training (each factor's gradient is a product with the other). A fused
    linear with no part adapted is a KeyError naming the missing tensor."""
    out: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rule in _target_rules(cfg, lora, model_type):
        base = rule.name.removesuffix(".weight")
        modules = [PEFT_PREFIX + hf.removesuffix(".weight") for hf in rule.hf]
        a = [_find(tensors, m + ".lora_A.weight") for m in modules]
        b = [_find(tensors, m + ".lora_B.weight") for m in modules]
        have = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x is not None and y is not None]
        if len(have) < len(modules):
            if not have:
                _get(tensors, modules[0] + ".lora_A.weight")  # the KeyError naming it
            if not shapes:
                from megatrain.engine.checkpoint.lora_base import base_shapes

                shapes = base_shapes(cfg)
            like = a[have[0]]
            assert like is not None
            zero_b = _b_to_hf(rule, like.new_zeros(shapes[rule.name][0], like.shape[0]), model_type)
            a = [x if i in have else like.new_zeros(like.shape) for i, x in enumerate(a)]
            b = [y if i in have else zero_b[i] for i, y in enumerate(b)]
        out[base + ".lora.A"] = torch.cat(a)
        # GPT-2's rules take a Conv1D (in, out) weight: hand them B transposed.
        out[base + ".lora.B"] = rule.from_hf(*(t.t() for t in b) if model_type == "gpt2" else b)
    for ours, module in _expert_modules(cfg, lora):
        a, b = _get(tensors, module + "lora_A.weight"), _get(tensors, module + "lora_B.weight")
        e = cfg.moe.num_experts if cfg.moe else 1
        out[ours + "_A"] = a.reshape(e, -1, a.shape[-1])
        out[ours + "_B"] = b.reshape(b.shape[0], -1, e).permute(2, 0, 1).contiguous()
    return out


def _find(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    if name in tensors:
        return tensors[name]
    # PEFT also saves without the adapter name, and some tools add `.default`.
    alt = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )
    return tensors.get(alt)


def _get(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    found = _find(tensors, name)
    if found is None:
        raise KeyError(f"the adapter has no {name}")
    return found


def peft_config(
    cfg: TransformerConfig, lora: LoRAConfig, model_type: str, base_model: str | None = None
) -> dict[str, Any]:
    """adapter_config.json for PEFT's LoraConfig: the HF module names the adapters sit on."""
    modules = {
        hf.removesuffix(".weight").rsplit(".", 1)[-1]
        for r in _target_rules(cfg, lora, model_type)
        for hf in r.hf
    }
    if "c_proj" in modules and not {"proj", "fc2"} <= set(lora.targets):
        # GPT-2 names attention's and the MLP's output projection alike, and PEFT matches a name as a
        # suffix: name the one targeted by its parent too, or PEFT adds an adapter to the other.
        modules = (modules - {"c_proj"}) | {"attn.c_proj" if "proj" in lora.targets else "mlp.c_proj"}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": sorted(modules),
        "target_parameters": list(EXPERT_PARAMETERS) if "experts" in lora.targets else None,
        "bias": "none",
        "fan_in_fan_out": model_type == "gpt2",
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def lora_from_peft_config(config: dict[str, Any]) -> LoRAConfig:
    """The LoRAConfig an adapter_config.json describes (megatrain.peft_config.lora_settings)."""
    settings = lora_settings(config)
    return LoRAConfig(**{**settings, "targets": tuple(settings["targets"])})


def dumps_config(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
