"""Hugging Face checkpoints in and out: a transformers model folder (config.json + safetensors,
single-file or sharded with model.safetensors.index.json) <-> GPTModel's canonical weights.

Folders are read and written through megatrain.storage (file:// or s3://): on s3:// each safetensors
file is downloaded once per node into the data pipeline's cache (engine.data.remote: the node's ranks
share one download), on file:// it is read in place; tensors are read one at a time with safe_open,
or by slice (interop.hf_slices). Export writes shard by shard: only one shard's tensors are in
memory at once, and each canonical tensor is asked for through `get_tensor` (a sharded checkpoint
reader, say).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.engine.checkpoint import CheckpointReader
from megatrain.engine.config import MoEConfig, TransformerConfig, lora_config, model_flavour, moe_config
from megatrain.engine.interop.hf_mapping import IGNORED_SUFFIXES, Rule, rules_for
from megatrain.engine.interop.hf_mapping_bert import FRESH_HEAD, IGNORED_BERT, unused_by
from megatrain.engine.materialize import init_source
from megatrain.engine.models.bert import model_class
from megatrain.engine.models.gpt import GPTModel, rope_tables
from megatrain.hf_config import MOE_TRAINING_FIELDS, hf_config_from_model, model_fields_from_hf
from megatrain.hf_config_bert import BARE
from megatrain.spec import VOCAB_PAD_MULTIPLE, ModelSpec
from megatrain.storage import FileStore, Store, open_store

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def folder_store(url: str | Path) -> Store:
    """The store of a folder given as a local path or a file:// / s3:// URL."""
    text = str(url)
    if not text.startswith(("file:", "s3:", "/")):
        text = str(Path(text).resolve())
    return open_store(text)


def read_hf_config(url: str | Path) -> dict[str, Any]:
    """A model folder's config.json."""
    return json.loads(folder_store(url).get_bytes(CONFIG_FILE))


class HFReader:
    """Tensors of a model folder by name, each file opened (and fetched, on s3://) on first use."""

    def __init__(self, store: Store, stack: ExitStack):
        self.store, self.stack = store, stack
        self.tmp: Path | None = None
        self.handles: dict[str, Any] = {}
        if store.exists(INDEX_FILE):
            self.files = json.loads(store.get_bytes(INDEX_FILE))["weight_map"]
        elif store.exists(SINGLE_FILE):
            self.files = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(f"{store.url} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    def _open(self, file: str) -> Any:
        if file not in self.handles:
            if isinstance(self.store, FileStore):
                path = self.store.local_path(file)
            elif self.store.url.startswith("s3://"):
                # Once per node: the node's ranks share the data pipeline's cache (one downloads).
                from megatrain.engine.data.dataset import default_cache_root
                from megatrain.engine.data.remote import cached_files

                path = (
                    cached_files(self.store.url, [file], default_cache_root(), f"{file}.complete.json") / file
                )
            else:
                if self.tmp is None:
                    self.tmp = Path(self.stack.enter_context(tempfile.TemporaryDirectory(prefix="hf-")))
                path = self.tmp / file
                self.store.get_file(file, path)
            self.handles[file] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[file]

    def get(self, name: str) -> torch.Tensor:
        return self._open(self.files[name]).get_tensor(name)

    def slice(self, name: str) -> Any:
        """safetensors' lazy slice of a tensor: indexing it reads only those elements."""
        return self._open(self.files[name]).get_slice(name)


@contextmanager
def hf_reader(url: str | Path) -> Iterator[HFReader]:
    with ExitStack() as stack:
        yield HFReader(folder_store(url), stack)


def config_mismatches(fields: dict[str, Any], cfg: TransformerConfig) -> list[str]:
    """How a checkpoint's model fields (model_fields_from_hf) differ from the model `cfg` describes."""
    spec = ModelSpec.model_validate({k: v for k, v in fields.items() if k != "vocab_size"})
    ours = {
        "position_embedding": cfg.position_embedding,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "tie_embeddings": cfg.tie_embeddings,
        "qkv_bias": cfg.has_qkv_bias,
        "rope_theta": cfg.rope_theta if cfg.position_embedding == "rope" else None,
        "rope_scaling": cfg.rope_scaling,
        "bidirectional": cfg.bidirectional,
        "post_layernorm": cfg.post_layernorm,
        "num_tokentypes": cfg.num_tokentypes,
    }
    theirs = {
        "position_embedding": "learned" if spec.arch in ("gpt2", "bert") else "rope",
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.query_groups,
        "ffn_hidden_size": spec.ffn_size,
        "tie_embeddings": spec.tied,
        "qkv_bias": spec.arch in ("gpt2", "bert") if spec.qkv_bias is None else spec.qkv_bias,
        "rope_theta": spec.rope_theta if spec.arch == "llama" else None,
        "rope_scaling": spec.rope_scaling.model_dump(exclude_none=True) if spec.rope_scaling else None,
        "bidirectional": spec.arch == "bert",
        "post_layernorm": spec.arch == "bert" and spec.bert_block.post_layernorm,
        "num_tokentypes": spec.bert_block.num_tokentypes if spec.arch == "bert" else 0,
    }
    out = [f"{k}: checkpoint {theirs[k]!r}, model {ours[k]!r}" for k in ours if ours[k] != theirs[k]]
    if not math.isclose(spec.norm_eps, cfg.norm_eps, rel_tol=1e-6):
        out.append(f"norm_eps: checkpoint {spec.norm_eps}, model {cfg.norm_eps}")
    if fields["vocab_size"] > cfg.vocab_size:
        out.append(f"vocab_size: checkpoint {fields['vocab_size']}, model rows {cfg.vocab_size}")
    ours_moe, theirs_moe = _moe_shape(cfg.moe), _moe_shape(moe_config(spec))
    if (ours_moe is None) != (theirs_moe is None):
        out.append(f"moe: checkpoint {theirs_moe}, model {ours_moe}")
    elif ours_moe is not None and theirs_moe is not None:
        out += [
            f"moe.{k}: checkpoint {theirs_moe[k]!r}, model {v!r}"
            for k, v in ours_moe.items()
            if v != theirs_moe[k]
        ]
    return out


def _moe_shape(moe: MoEConfig | None) -> dict[str, Any] | None:
    """What an MoE config computes (its training coefficients aside)."""
    if moe is None:
        return None
    return {k: v for k, v in dataclasses.asdict(moe).items() if k not in MOE_TRAINING_FIELDS}


def load_hf_state(url: str | Path, cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face model folder's weights under our canonical names, for the model `cfg` describes
    (a shorter seq_length and a larger, padded vocabulary are fine). Raises ValueError naming every
    field where the folder's config disagrees with cfg, and any tensor nothing maps. Every tensor
    whole: an engine rank reads only its slices (interop.hf_slices)."""
    out: dict[str, torch.Tensor] = {}
    with hf_reader(url) as reader:
        for rule in resolve_rules(url, cfg, reader).values():
            out[rule.name] = rule.from_hf(*(reader.get(n) for n in rule.hf)).contiguous()
    return out


def resolve_rules(url: str | Path, cfg: TransformerConfig, reader: HFReader) -> dict[str, Rule]:
    """The rule (the spelling the folder holds) for each canonical tensor of the model `cfg`
    describes. Raises ValueError naming every config field where the folder disagrees with cfg, a
    tensor nothing maps or one a rule needs and the folder lacks."""
    config = read_hf_config(url)
    fields = model_fields_from_hf(config, seq_length=cfg.seq_length)
    mismatches = config_mismatches(fields, cfg)
    if mismatches:
        raise ValueError(f"the Hugging Face model at {url} does not fit this model: " + "; ".join(mismatches))
    # Older GPT-2 checkpoints name tensors without the "transformer." prefix.
    prefix = "transformer." if any(n.startswith("transformer.") for n in reader.files) else ""
    # A bare BertModel (sentence-transformers' encoders) names its tensors without "bert.".
    bert = "bert." if any(n.startswith("bert.") for n in reader.files) else ""
    rules = rules_for(cfg, config["model_type"], gpt2_prefix=prefix, bert_prefix=bert)
    used = {name for rule in rules for spelling in rule.spellings() for name in spelling.hf}
    unknown = [n for n in reader.files if n not in used and not _ignorable(n, cfg)]
    if unknown:
        raise ValueError(f"the Hugging Face model at {url} has tensors this model cannot hold: {unknown[:8]}")
    out: dict[str, Rule] = {}
    for rule in rules:
        # The Hub's names, else the first other spelling the folder holds whole.
        found = [r for r in rule.spellings() if all(n in reader.files for n in r.hf)]
        if not found and cfg.bidirectional and not cfg.masked_lm and rule.name in FRESH_HEAD:
            continue  # a new classifier: the caller starts it from the seeded initial values
        if not found:
            missing = [n for n in rule.hf if n not in reader.files]
            raise ValueError(f"the Hugging Face model at {url} lacks {missing[:8]}")
        out[rule.name] = found[0]
    return out


def _ignorable(name: str, cfg: TransformerConfig) -> bool:
    # A tied model's files sometimes still carry the head (a copy of the embedding).
    if name.endswith(IGNORED_SUFFIXES) or (cfg.tie_embeddings and name == "lm_head.weight"):
        return True
    # A BERT leaves a pre-training checkpoint's heads it has no use for (interop.hf_mapping_bert).
    return cfg.bidirectional and (name.endswith(IGNORED_BERT) or unused_by(cfg, name))


def hf_transformer_config(config: dict[str, Any], seq_length: int | None = None) -> TransformerConfig:
    """Our model config for a config.json, its vocabulary padded to a multiple of 128 rows."""
    fields = model_fields_from_hf(config, seq_length=seq_length)
    spec = ModelSpec.model_validate({k: v for k, v in fields.items() if k != "vocab_size"})
    vocab = fields["vocab_size"]
    # The same choices as config.transformer_config, which needs a whole JobSpec.
    cfg = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.query_groups,
        ffn_hidden_size=spec.ffn_size,
        seq_length=spec.seq_length,
        vocab_size=-(-vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE,
        vocab_size_unpadded=vocab,
        **model_flavour(spec),
        qkv_bias=spec.qkv_bias,
        norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling.model_dump(exclude_none=True) if spec.rope_scaling else None,
        init_method_std=float(config.get("initializer_range", 0.02)),
        moe=moe_config(spec),
        hf_family=config["model_type"],
    )
    if spec.arch == "bert" and BARE in (config.get("architectures") or []):
        # A bare encoder (sentence-transformers' models): no pre-training heads; its pooler, if its
        # files hold one, is left unused (interop.hf_mapping_bert.unused_by).
        cfg = dataclasses.replace(cfg, masked_lm=False, binary_head=False)
    return cfg


def load_hf_model(
    url: str | Path, device: str = "cpu", seq_length: int | None = None
) -> tuple[GPTModel, TransformerConfig]:
    """A fp32 GPTModel (eval mode) holding a Hugging Face model folder's weights, and its config
    (seq_length: None takes the folder's maximum, see model_fields_from_hf)."""
    cfg = hf_transformer_config(read_hf_config(url), seq_length)
    state = load_hf_state(url, cfg)
    # Built on the meta device: no random initialisation of weights about to be overwritten.
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if cfg.position_embedding == "rope":  # non-persistent buffers: rebuilt, never loaded
        cos, sin = rope_tables(cfg.seq_length, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    with torch.no_grad():
        params = model.state_dict()
        for name, target in params.items():
            if cfg.tie_embeddings and name == "lm_head.weight":
                continue
            if name in state:
                target.copy_(state[name])
            else:  # a classifier new to the folder (interop.hf_mapping_bert.FRESH_HEAD)
                init_source(model.init_seed, cfg)(name, tuple(target.shape), (0,) * target.dim(), target)
    return model.eval(), cfg


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _plan(
    cfg: TransformerConfig, rules: list[Rule], itemsize: int, max_shard_bytes: int
) -> list[list[tuple[Rule, int]]]:
    """Shards as lists of (rule, index of its HF tensor), in order, each at most max_shard_bytes
    (a larger single tensor gets a shard of its own). Shapes come from a meta-device model."""
    with torch.device("meta"):
        shapes = {name: t for name, t in model_class(cfg)(cfg).state_dict().items()}
    shards: list[list[tuple[Rule, int]]] = [[]]
    size = 0
    for rule in rules:
        for j, t in enumerate(rule.to_hf(shapes[rule.name])):
            nbytes = t.numel() * itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((rule, j))
            size += nbytes
    return shards


def export_hf(
    get_tensor: Callable[[str], torch.Tensor],
    cfg: TransformerConfig,
    dest: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer_files: dict[str, bytes | Path] | None = None,
    max_shard_bytes: int = 2 << 30,
    extra_config: dict[str, Any] | None = None,
) -> list[str]:
    """Write a transformers model folder at `dest` (a directory or a file:// / s3:// URL): safetensors
    shards (+ model.safetensors.index.json when there are several), the given tokenizer files,
    generation_config.json when bos/eos/pad are known, and config.json last. get_tensor(canonical name)
    returns a full single-device tensor; it is called shard by shard, so only one shard's tensors
    are held at a time. extra_config overrides config.json keys (bos_token_id, eos_token_id, ...).
    Returns the keys written, in order."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype} is not one of {', '.join(DTYPE_NAMES.values())}")
    extra = dict(extra_config or {})
    config = hf_config_from_model(
        cfg.to_dict(),
        dtype=DTYPE_NAMES[dtype],
        bos_token_id=extra.get("bos_token_id"),
        eos_token_id=extra.get("eos_token_id"),
    )
    config.update(extra)
    store = folder_store(dest)
    rules = rules_for(
        cfg, config["model_type"], bert_prefix="" if config.get("architectures") == [BARE] else "bert."
    )
    shards = _plan(cfg, rules, torch.empty((), dtype=dtype).element_size(), max_shard_bytes)
    names = _shard_names(len(shards))
    written: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    cached: tuple[str, tuple[torch.Tensor, ...]] | None = None  # the last rule's HF tensors
    with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:
        for file, shard in zip(names, shards, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for rule, j in shard:
                if cached is None or cached[0] != rule.name:
                    cached = (rule.name, rule.to_hf(get_tensor(rule.name).detach()))
                # Own, contiguous storage: safetensors refuses views that share memory.
                t = cached[1][j].to(device="cpu", dtype=dtype).contiguous().clone()
                tensors[rule.hf[j]] = t
                weight_map[rule.hf[j]] = file
                total += t.numel() * t.element_size()
            path = Path(tmp) / file
            save_file(tensors, str(path), metadata={"format": "pt"})
            del tensors
            store.put_file(file, path)
            path.unlink()
            written.append(file)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        written.append(_put_json(store, INDEX_FILE, index))
    written += put_files(store, tokenizer_files or {})
    special = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    }
    if special:
        written.append(_put_json(store, "generation_config.json", {"_from_model_config": True, **special}))
    # Last: a folder with a config.json is complete.
    written.append(_put_json(store, CONFIG_FILE, config))
    return written


def put_files(store: Store, files: dict[str, bytes | Path]) -> list[str]:
    """Write each file (its bytes, or a local file's) under its name; returns the names, in order."""
    for name, content in files.items():
        if isinstance(content, bytes):
            store.put_bytes(name, content)
        else:
            store.put_file(name, content)
    return list(files)


def _put_json(store: Store, key: str, data: dict[str, Any]) -> str:
    store.put_bytes(key, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())
    return key


def export_model_hf(model: GPTModel, dest: str | Path, **kwargs: Any) -> list[str]:
    """export_hf for an in-memory single-device model (keyword arguments as export_hf's)."""
    state = model.state_dict()
    return export_hf(lambda name: state[name], model.config, dest, **kwargs)


def export_checkpoint_hf(checkpoint: str | Path, dest: str | Path, **kwargs: Any) -> list[str]:
    """export_hf of a sharded checkpoint (a step's folder, or a root's latest), reading each tensor
    on demand so that no more than one shard's tensors are in memory (keyword arguments as export_hf's).
    A LoRA run's checkpoint is the model it trained: its adapters merged in (interop.lora_export)."""
    reader = CheckpointReader(checkpoint)
    if not isinstance(reader.model_config, TransformerConfig):  # a T5 (interop.hf_t5 imports this module)
        from megatrain.engine.interop.hf_t5 import export_t5_checkpoint_hf

        return export_t5_checkpoint_hf(reader, dest, **kwargs)
    lora = lora_config(reader.spec)
    if lora is None:
        return export_hf(reader.tensor, reader.model_config, dest, **kwargs)
    from megatrain.engine.interop.lora_export import merged_tensor_source  # it imports this module

    return export_hf(
        merged_tensor_source(reader.tensor, reader.model_config, lora), reader.model_config, dest, **kwargs
    )
