"""An OpenAI fine-tuning request as one of our JobSpecs: "auto" hyperparameters resolved (and
reported back as resolved), epochs turned into train_iters from the training file's record count,
the base model's tokenizer and chat template, LoRA or full training as the operator's default (or
the request's extension) says, the layout left to the planner. Pure but for reading two small
files of the model's folder.

Supervised: a batch is `batch_size` records, one a row (no packing, so an epoch is exactly
ceil(records / batch_size) steps). DPO: a batch is `batch_size` pairs, two rows each. A checkpoint
is saved at the end of every epoch (and always at the end).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from megatrain.api.openai.errors import openai_error
from megatrain.api.openai.schemas import Hyperparameters, JobCreate, ResolvedHyperparameters
from megatrain.db.models import Dataset, RegisteredModel
from megatrain.settings import Settings
from megatrain.storage import StorageError, open_store

AUTO_EPOCHS = 3
AUTO_BETA = 0.1
AUTO_BATCH_FRACTION = 0.002
"""batch_size auto: this share of the records (OpenAI's rule of thumb), from 1 to MAX_AUTO_BATCH."""
MAX_AUTO_BATCH = 256
BASE_LR = {"lora": 1e-4, "qlora": 1e-4, "full": 1e-5}
"""learning_rate_multiplier scales these: the usual LoRA and full fine-tuning rates."""
DEFAULT_MAX_SEQ_LENGTH = 4096
"""A record is cut to the model's context, at most this (the extension's seq_length overrides)."""
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
EVALS_PER_EPOCH = 4
MAX_EVAL_BATCHES = 64
"""A validation file is evaluated whole up to this many batches (its first ones, the same each time)."""
METHODS = {"supervised": "finetune", "dpo": "dpo"}
"""OpenAI's method type → our job kind."""


@dataclass
class Plan:
    """What the request resolved to: the spec to submit and what to report back."""

    spec: dict[str, Any]
    method: dict[str, Any]
    """OpenAI's method object, every "auto" resolved."""
    hyperparameters: ResolvedHyperparameters
    training_method: str
    seed: int


def method_type(req: JobCreate) -> str:
    kind = req.method.type if req.method is not None else "supervised"
    if kind not in METHODS:
        raise openai_error(400, f"method {kind!r} is not supported: supervised or dpo", param="method.type")
    return kind


def _asked(req: JobCreate, kind: str) -> Hyperparameters:
    """The method's hyperparameters, the legacy top-level ones filling what it leaves out."""
    block = getattr(req.method, kind, None) if req.method is not None else None
    given = block.hyperparameters if block is not None and block.hyperparameters is not None else None
    legacy = req.hyperparameters or Hyperparameters()
    merged = {
        **legacy.model_dump(exclude_none=True),
        **(given.model_dump(exclude_none=True) if given else {}),
    }
    if kind != "dpo" and merged.get("beta") not in (None, "auto"):
        raise openai_error(400, "beta is a dpo hyperparameter", param=f"method.{kind}.hyperparameters.beta")
    return Hyperparameters(**merged)


def resolve(asked: Hyperparameters, records: int, kind: str) -> ResolvedHyperparameters:
    """Every "auto" (or absent) hyperparameter as we choose it for `records` training records."""
    batch = asked.batch_size
    if not isinstance(batch, int):
        batch = max(1, min(MAX_AUTO_BATCH, round(records * AUTO_BATCH_FRACTION)))
    lr = asked.learning_rate_multiplier
    epochs = asked.n_epochs
    beta = asked.beta
    return ResolvedHyperparameters(
        batch_size=batch,
        learning_rate_multiplier=lr if isinstance(lr, float | int) else 1.0,
        n_epochs=epochs if isinstance(epochs, int) else AUTO_EPOCHS,
        beta=(beta if isinstance(beta, float | int) else AUTO_BETA) if kind == "dpo" else None,
    )


def _read_json(folder: str, name: str, settings: Settings) -> dict[str, Any] | None:
    try:
        store = open_store(folder, settings.s3_endpoint_url)
        if not store.exists(name):
            return None
        data = json.loads(store.get_bytes(name))
    except (StorageError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_folder(model: RegisteredModel) -> str:
    """Where a registered model's tokenizer lives: an adapter's base folder, else its own."""
    return model.base_url if (model.kind or "model") == "adapter" and model.base_url else model.url


def tokenizer_and_template(model: RegisteredModel, settings: Settings) -> dict[str, Any]:
    """data.tokenizer and data.chat_template from the model's folder: its tokenizer.json, and its
    tokenizer_config.json where that holds a chat_template (else our built-in default)."""
    folder = model_folder(model)
    try:
        has_tokenizer = open_store(folder, settings.s3_endpoint_url).exists(TOKENIZER_FILE)
    except StorageError:
        has_tokenizer = False
    if not has_tokenizer:
        raise openai_error(
            400,
            f"model {model.name!r} cannot be fine-tuned here: its folder has no {TOKENIZER_FILE}",
            param="model",
        )
    config = _read_json(folder, TOKENIZER_CONFIG, settings) or {}
    template = f"{folder}/{TOKENIZER_CONFIG}" if config.get("chat_template") else None
    return {"tokenizer": {"type": "hf", "path": f"{folder}/{TOKENIZER_FILE}"}, "chat_template": template}


def plan(
    req: JobCreate,
    settings: Settings,
    training: Dataset,
    model: dict[str, Any],
    data: dict[str, Any],
    training_method: str,
    seed: int,
    name: str,
    validation: Dataset | None = None,
    adapters: dict[str, Any] | None = None,
) -> Plan:
    """The spec of the request. `model`: the spec's model section (init_from, seq_length …);
    `data`: its tokenizer and chat template (tokenizer_and_template, or the continued job's).
    `validation`: the validation file, held out whole (data.valid) and evaluated EVALS_PER_EPOCH
    times an epoch and at the end, every record of it each time (at most MAX_EVAL_BATCHES batches).
    `adapters`: training.method and training.lora of the LoRA fine-tune this one continues."""
    kind = method_type(req)
    records = training.documents or 0
    hp = resolve(_asked(req, kind), records, kind)
    steps_per_epoch = max(1, math.ceil(records / hp.batch_size))
    train_iters = hp.n_epochs * steps_per_epoch
    rows = hp.batch_size * (2 if kind == "dpo" else 1)  # a pair is two rows
    spec_training: dict[str, Any] = {
        "train_iters": train_iters,
        "global_batch_size": rows,
        "micro_batch_size": "auto",
        "lr": BASE_LR[training_method] * hp.learning_rate_multiplier,
        "min_lr": 0.0,
        "lr_schedule": "linear",
        "warmup_iters": 0,
        "checkpoint_interval": steps_per_epoch,
        "log_interval": 1,
        "eval_interval": 0,
        "seed": seed,
        "method": training_method,
    }
    spec_training.update(adapters or {})
    if validation is not None:
        spec_training["eval_interval"] = max(1, steps_per_epoch // EVALS_PER_EPOCH)
        batches = math.ceil((validation.documents or 1) / hp.batch_size)
        spec_training["eval_iters"] = max(1, min(MAX_EVAL_BATCHES, batches))
    if kind == "dpo":
        spec_training["dpo"] = {"beta": hp.beta}
    spec = {
        "name": name,
        "kind": METHODS[kind],
        "model": model,
        "data": {
            **data,
            "train": [{"dataset": training.name}],
            **({"valid": [{"dataset": validation.name}]} if validation is not None else {}),
            "split": "1,0,0",
            **({"packing": False} if kind == "supervised" else {}),
        },
        "training": spec_training,
        "parallelism": "auto",
        "resources": {"pool": settings.pool_name},
    }
    shown = {"batch_size": hp.batch_size, "learning_rate_multiplier": hp.learning_rate_multiplier}
    shown["n_epochs"] = hp.n_epochs
    if kind == "dpo":
        shown["beta"] = hp.beta
    method = {"type": kind, kind: {"hyperparameters": shown}}
    return Plan(spec, method, hp, training_method, seed)
