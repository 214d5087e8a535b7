"""The rules *between* a spec's fields, for the JobSpec reference (megatrain/spec_reference.py):
each with a spec that breaks it (tests/test_spec_reference.py checks that each really fails on its
field), and the checks a submission adds (SUBMISSION_CHECKS). Torch-free."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from megatrain.spec import SpecError, parse_spec

BASE_SPEC: dict[str, Any] = {
    "name": "rule-example",
    "data": {"train": [{"path": "file:///data/corpus.jsonl"}]},
}
"""A valid spec (every other field its default: llama, 4 layers, hidden 256, 8 heads, seq 256,
global batch 16 of micro-batches of 4, parallelism auto); each rule's example changes it."""


@dataclass(frozen=True)
class Rule:
    field: str
    """The field the error names."""
    rule: str
    breaks: dict[str, Any]
    """Dotted field → value, applied to BASE_SPEC: a spec that breaks the rule."""
    where: str = "spec"
    """spec: megatrain/spec.py; layout: megatrain/plan/layout.py (resolve_layout), at submission."""

    def example(self) -> dict[str, Any]:
        spec = copy.deepcopy(BASE_SPEC)
        for dotted, value in self.breaks.items():
            node = spec
            *parents, leaf = dotted.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):
                    node[p] = {}  # e.g. `parallelism: auto` becomes an object
                node = node[p]
            node[leaf] = value
        return spec


_LLAMA3 = {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
RULES: tuple[Rule, ...] = (
    Rule("model.hidden_size", "hidden_size is divisible by num_attention_heads",
         {"model.hidden_size": 100, "model.num_attention_heads": 8}),
    Rule("model.num_attention_heads", "num_attention_heads is divisible by num_query_groups",
         {"model.num_query_groups": 3}),
    Rule("model.rope_scaling", "rope_scaling only with arch llama (gpt2 has learned positions)",
         {"model.arch": "gpt2", "model.rope_scaling": {"type": "linear", "factor": 2.0}}),
    Rule("model.rope_scaling", "type llama3 needs low_freq_factor, high_freq_factor and "
         "original_max_position_embeddings", {"model.rope_scaling": {"type": "llama3", "factor": 8.0}}),
    Rule("model.rope_scaling.low_freq_factor", "the llama3 fields are refused with type linear",
         {"model.rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}),
    Rule("model.rope_scaling.high_freq_factor", "high_freq_factor exceeds low_freq_factor",
         {"model.rope_scaling": {**_LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}}),
    Rule("model.attention_backend", "attention_backend flex runs no attention dropout",
         {"model.attention_backend": "flex", "model.attention_dropout": 0.1}),
    Rule("model.attention_backend", "attention_backend flash or te needs training.precision other than fp32",
         {"model.attention_backend": "flash", "training.precision": "fp32"}),
    Rule("model.init_from", "init_from is null, checkpoint:JOB_ID[@STEP], hf:NAME (registered) or "
         "hf:URL (file:///abs/path or s3://bucket/prefix)", {"model.init_from": "gpt2"}),
    Rule("model.init_from", "kind finetune needs model.init_from", {"kind": "finetune"}),
    Rule("model.init_from", "kind dpo needs model.init_from", {"kind": "dpo"}),
    Rule("model.init_from", "kind serve needs model.init_from", {"kind": "serve", "data.train": []}),
    Rule("data.train", "at least one data source (kind serve, eval: none)", {"data.train": []}),
    Rule("data.train", "kind serve reads no data", {"kind": "serve", "model.init_from": "hf:/m"}),
    Rule("model.init_from", "kind eval needs model.init_from",
         {"kind": "eval", "data.train": [], "eval": {"tasks": ["/t.yaml"]}}),
    Rule("data.train", "kind eval reads no data but for eval.perplexity (its tasks name their items)",
         {"kind": "eval", "model.init_from": "hf:/m", "eval": {"tasks": ["/t.yaml"]}}),
    Rule("eval", "kind eval needs eval.tasks",
         {"kind": "eval", "model.init_from": "hf:/m", "data.train": []}),
    Rule("eval", "eval needs tasks or perplexity",
         {"kind": "eval", "model.init_from": "hf:/m", "data.train": [], "eval": {"tasks": []}}),
    Rule("data.train", "eval.perplexity measures splits of data.train",
         {"kind": "eval", "model.init_from": "hf:/m", "data.train": [], "eval": {"perplexity": ["valid"]}}),
    Rule("eval", "eval is only for kind eval", {"eval": {"tasks": ["/t.yaml"]}}),
    Rule("tracking", "tracking is for training jobs (kind pretrain, finetune, dpo), not serve or eval",
         {"kind": "serve", "model.init_from": "hf:/m", "data.train": [], "tracking.tensorboard": True}),
    Rule("data.tokenizer.path", "tokenizer type hf or sentencepiece needs a path",
         {"data.tokenizer": {"type": "hf"}}),
    Rule("data.tokenizer.name", "tokenizer type tiktoken needs a name",
         {"data.tokenizer": {"type": "tiktoken"}}),
    Rule("data.tokenizer.path", "tokenizer type byte takes no path",
         {"data.tokenizer": {"type": "byte", "path": "file:///data/tokenizer.json"}}),
    Rule("data.tokenizer.name", "a tokenizer name only with type tiktoken",
         {"data.tokenizer": {"type": "hf", "path": "file:///data/tokenizer.json", "name": "cl100k_base"}}),
    Rule("data.train.0", "every data source has a path or a dataset name", {"data.train": [{"weight": 1.0}]}),
    Rule("training.lora", "training.lora only with training.method lora",
         {"training.lora": {"rank": 8}}),
    Rule("training.lora.targets", "no target listed twice",
         {"training.method": "lora", "training.lora": {"targets": ["qkv", "qkv"]}}),
    Rule("training.lora.targets", "a target the model has (experts needs model.moe; fc1/fc2 a dense "
         "MLP or a shared expert)", {"training.method": "lora", "training.lora": {"targets": ["experts"]}}),
    Rule("training.lora.dropout", "dropout 0 when the targets include experts",
         {"training.method": "lora", "training.lora": {"targets": ["experts"], "dropout": 0.1}}),
    Rule("training.dpo", "training.dpo only with kind dpo", {"training.dpo": {"beta": 0.1}}),
    Rule("training.dpo.label_smoothing", "label_smoothing only with loss_type sigmoid",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.micro_batch_size": 2,
          "training.dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}),
    Rule("training.micro_batch_size", "kind dpo needs an even micro_batch_size (auto picks an even one)",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.micro_batch_size": 1}),
    Rule("training.global_batch_size", "kind dpo with micro_batch_size auto needs an even global_batch_size",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.global_batch_size": 9}),
    Rule("data.packing", "kind dpo runs without packing",
         {"kind": "dpo", "model.init_from": "hf:/m", "training.micro_batch_size": 2, "data.packing": True}),
    Rule("training.global_batch_size", "global_batch_size is divisible by micro_batch_size",
         {"training.global_batch_size": 10, "training.micro_batch_size": 4}),
    Rule("training.warmup_iters", "warmup_iters ≤ train_iters",
         {"training.train_iters": 10, "training.warmup_iters": 20}),
    Rule("training.min_loss_scale", "min_loss_scale ≤ initial_loss_scale",
         {"training.initial_loss_scale": 1024.0, "training.min_loss_scale": 4096.0}),
    Rule("training.min_lr", "min_lr ≤ lr", {"training.lr": 1e-4, "training.min_lr": 1e-3}),
    Rule("resources.devices", "with dp auto, the processes asked for are a multiple of tp×pp×cp",
         {"parallelism.tp": 2, "resources.devices": 3}, "layout"),
    Rule("resources.devices", "with dp given, the processes asked for equal tp×pp×cp×dp",
         {"parallelism.tp": 2, "parallelism.dp": 2, "resources.devices": 2}, "layout"),
    Rule("model.num_attention_heads", "num_attention_heads is divisible by tp",
         {"parallelism.tp": 16}, "layout"),
    Rule("model.num_query_groups", "num_query_groups is divisible by tp",
         {"model.num_query_groups": 2, "parallelism.tp": 4}, "layout"),
    Rule("model.ffn_hidden_size", "ffn_hidden_size is divisible by tp",
         {"model.ffn_hidden_size": 1002, "parallelism.tp": 4}, "layout"),
    Rule("model.moe.ffn_hidden_size", "each routed expert's width is divisible by tp",
         {"model.moe": {"num_experts": 4, "ffn_hidden_size": 177}, "parallelism.tp": 2}, "layout"),
    Rule("model.moe.shared_expert_ffn_hidden_size", "the shared expert's width is divisible by tp",
         {"model.moe": {"num_experts": 4, "shared_expert_ffn_hidden_size": 177}, "parallelism.tp": 2},
         "layout"),
    Rule("model.moe.num_experts", "num_experts is divisible by ep",
         {"model.moe": {"num_experts": 6}, "parallelism.ep": 4, "parallelism.dp": 4}, "layout"),
    Rule("parallelism.ep", "ep divides dp×cp (experts are split over ranks carved from them)",
         {"model.moe": {"num_experts": 4}, "parallelism.ep": 4, "parallelism.dp": 2}, "layout"),
    Rule("parallelism.ep", "ep > 1 needs model.moe", {"parallelism.ep": 2, "parallelism.dp": 2}, "layout"),
    Rule("model.vocab_size", "the embedding's rows (vocab_size rounded up to a multiple of 128) are "
         "divisible by tp",
         {"model.hidden_size": 96, "model.num_attention_heads": 3, "model.ffn_hidden_size": 96,
          "model.vocab_size": 256, "parallelism.tp": 3}, "layout"),
    Rule("model.seq_length", "with sequence_parallel, seq_length is divisible by tp",
         {"model.seq_length": 255, "parallelism.tp": 2, "parallelism.sequence_parallel": True}, "layout"),
    Rule("model.seq_length", "with cp > 1, seq_length is divisible by 2×cp (each rank holds two chunks)",
         {"model.seq_length": 250, "parallelism.cp": 2}, "layout"),
    Rule("model.seq_length", "with cp > 1 and sequence_parallel, seq_length is divisible by 2×cp×tp",
         {"model.seq_length": 252, "parallelism.cp": 2, "parallelism.tp": 2,
          "parallelism.sequence_parallel": True}, "layout"),
    Rule("model.attention_dropout", "cp > 1 runs no attention dropout (ring attention)",
         {"model.attention_dropout": 0.1, "parallelism.cp": 2}, "layout"),
    Rule("model.attention_backend", "cp > 1 runs ring attention: attention_backend auto or sdpa",
         {"model.attention_backend": "flex", "parallelism.cp": 2}, "layout"),
    Rule("parallelism.pp", "pp ≤ num_layers", {"parallelism.pp": 8}, "layout"),
    Rule("parallelism.virtual_stages", "virtual_stages > 1 needs pp > 1", {"parallelism.virtual_stages": 2},
         "layout"),
    Rule("model.num_layers", "without pipeline_layers, num_layers is divisible by pp×virtual_stages",
         {"model.num_layers": 5, "parallelism.pp": 2}, "layout"),
    Rule("parallelism.pipeline_layers", "pipeline_layers has pp×virtual_stages entries",
         {"parallelism.pp": 2, "parallelism.pipeline_layers": [4]}, "layout"),
    Rule("parallelism.pipeline_layers", "pipeline_layers sums to num_layers",
         {"parallelism.pp": 2, "parallelism.pipeline_layers": [1, 2]}, "layout"),
    Rule("training.global_batch_size", "global_batch_size is divisible by micro_batch_size×dp",
         {"parallelism.dp": 3}, "layout"),
    Rule("parallelism.virtual_stages", "interleaved 1F1B (virtual_stages > 1) needs the micro-batches "
         "per step, global_batch_size/(micro_batch_size×dp), divisible by pp",
         {"model.num_layers": 8, "parallelism.pp": 2, "parallelism.virtual_stages": 2,
          "training.global_batch_size": 12}, "layout"),
)  # fmt: skip

SUBMISSION_CHECKS: tuple[tuple[str, str], ...] = (
    ("resources.pool", "names a pool the cluster has"),
    ("resources.devices", "the job's processes fit the pool's nodes"),
    ("model", "the planner's per-device memory estimate fits a device of the pool"),
    ("data.train.N.path, data.tokenizer.path", "lie where the tenant may read: its own storage prefix, "
     "the shared datasets, or an allowed data root (the user's home and the checkout's examples/ in the "
     "embedded default, and those MEGATRAIN_ALLOWED_DATA_ROOTS adds)"),
    ("data.train.N.path, data.tokenizer.path, data.chat_template", "exist and are readable (a JSONL "
     "file; an indexed dataset's PREFIX.bin and PREFIX.idx), checked at submission so a job never "
     "fails on a missing file"),
    ("data.train.N.dataset", "names a dataset registered with `megatrain datasets upload` (own or shared)"),
    ("model.init_from", "checkpoint:JOB_ID names one of the tenant's own jobs; hf:NAME a registered "
     "model (`megatrain models register`); an hf: folder holds a config.json we can build"),
    ("model.*", "with an hf: init_from, every model field given agrees with the folder's config.json "
     "(the others are filled from it)"),
    ("resources.priority", "at most the tenant's priority cap"),
    ("model.attention_backend", "flash and te need their package installed (flash-attn, "
     "transformer-engine: `pip install megatrain[gpu]`)"),
    ("secrets", "each names a secret the tenant stored (PUT /v1/secrets/NAME)"),
)  # fmt: skip


def rule_errors(data: dict[str, Any]) -> list[dict[str, str]]:
    """The errors the spec and layout rules give `data` ([] when it passes both)."""
    from megatrain.plan.layout import resolve_layout

    try:
        resolve_layout(parse_spec(data))
    except SpecError as exc:
        return list(exc.errors)
    return []
