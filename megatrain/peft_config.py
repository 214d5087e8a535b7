"""A PEFT adapter_config.json read as our LoRA settings, without torch (the API reads it when an
adapter folder is registered; the engine when a run starts from one)."""

from __future__ import annotations

from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Our targets and the Hugging Face module names PEFT's target_modules gives for them.
HF_TARGETS = {"qkv": {"q_proj", "k_proj", "v_proj", "c_attn"}, "proj": {"o_proj", "attn.c_proj"},
              "fc1": {"gate_proj", "up_proj", "c_fc"}, "fc2": {"down_proj", "mlp.c_proj"}}  # fmt: skip
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""PEFT's target_parameters for our `experts` target: transformers' stacked expert tensors (Mixtral,
Qwen2-MoE), an adapter per expert on each."""


def lora_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The training.lora settings an adapter_config.json describes (rank, alpha, dropout, targets
    mapped back to ours, use_rslora); ValueError or KeyError for one that is not a LoRA adapter's."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} is not LORA")
    names = set(config.get("target_modules") or [])
    if "c_proj" in names:  # GPT-2 names attn and mlp output projections alike
        names |= {"attn.c_proj", "mlp.c_proj"}
    parameters = set(config.get("target_parameters") or [])
    if parameters and parameters != set(EXPERT_PARAMETERS):
        raise ValueError(
            f"{ADAPTER_CONFIG}: target_parameters {sorted(parameters)} are not the experts' "
            f"{', '.join(EXPERT_PARAMETERS)}"
        )
    return {
        "rank": int(config["r"]),
        "alpha": float(config["lora_alpha"]),
        "dropout": float(config.get("lora_dropout", 0.0)),
        "targets": [t for t, hf in HF_TARGETS.items() if names & hf] + (["experts"] if parameters else []),
        "use_rslora": bool(config.get("use_rslora", False)),
    }
