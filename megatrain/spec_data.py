"""A spec's data section: the tokenizer, the training sources and how documents become samples,
apart from spec.py to keep it short."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from megatrain.spec_base import NAME_PATTERN
from megatrain.spec_base import Strict as _Strict
from megatrain.spec_base import rule as _rule
from megatrain.spec_errors import Problem, collecting, report_rules

TOKENIZER_KINDS = ("byte", "hf", "tiktoken", "sentencepiece")


class TokenizerSpec(_Strict):
    type: Literal["byte", "hf", "tiktoken", "sentencepiece"] = "byte"
    """byte: 256 byte values + end-of-document. hf: a Hugging Face tokenizers JSON file at `path`.
    tiktoken: the encoding `name` (cl100k_base, o200k_base, gpt2, ...), its ranks read from `path`
    (a .tiktoken file) when given, else from tiktoken's cache. sentencepiece: a .model file at `path`."""
    path: str | None = Field(None, max_length=2048)
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """tiktoken only: the encoding's name."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: object) -> object:
        # "byte", "hf:URL", "tiktoken:NAME", "sentencepiece:URL": the CLI's --tokenizer form.
        return parse_tokenizer(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _fields_for_type(self, info: ValidationInfo) -> TokenizerSpec:
        path, name = "data.tokenizer.path", "data.tokenizer.name"
        out: list[Problem] = []
        if self.type in ("hf", "sentencepiece") and not self.path:
            out.append(_rule(path, f"{path} is required when data.tokenizer.type is {self.type!r}"))
        if self.type == "tiktoken" and not self.name:
            out.append(_rule(name, f"{name} is required when data.tokenizer.type is 'tiktoken'"))
        if self.type == "byte" and self.path:
            out.append(_rule(path, f"{path} must be empty when data.tokenizer.type is 'byte'"))
        if self.type != "tiktoken" and self.name:
            out.append(_rule(name, f"{name} is only for data.tokenizer.type 'tiktoken'"))
        report_rules(info, out)
        return self


def parse_tokenizer(text: str) -> dict[str, str]:
    """`byte`, `hf:URL`, `tiktoken:NAME` or `sentencepiece:URL` as TokenizerSpec fields."""
    kind, sep, rest = text.partition(":")
    if kind not in TOKENIZER_KINDS or (kind == "byte") == bool(sep):
        raise ValueError(
            f"tokenizer {text!r} must be byte, hf:PATH/tokenizer.json, tiktoken:NAME or "
            "sentencepiece:PATH.model"
        )
    if kind == "byte":
        return {"type": "byte"}
    return {"type": kind, "name" if kind == "tiktoken" else "path": rest}


JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")


class DataSource(_Strict):
    path: str | None = Field(None, min_length=1, max_length=2048)
    """A JSONL file (one JSON object per line; .jsonl, optionally .gz or .zst), tokenized into a cache
    beside the run on first use, or the prefix of an indexed dataset (PREFIX.bin + PREFIX.idx, as
    Megatron-LM's preprocessing writes them), as file:///abs/path or s3://bucket/key."""
    dataset: str | None = Field(None, pattern=NAME_PATTERN)
    """A dataset registered through POST /v1/datasets, by name; the API fills `path` with its location."""
    weight: float = Field(1.0, gt=0.0, le=1e6)

    @model_validator(mode="after")
    def _path_or_dataset(self, info: ValidationInfo) -> DataSource:
        # A collector hears it from DataSpec, which knows the source's index.
        if self.path is None and self.dataset is None and not collecting(info):
            raise ValueError("data.train and data.valid need a path or a dataset name in every source")
        return self

    @property
    def is_jsonl(self) -> bool:
        return self.path is not None and self.path.endswith(JSONL_SUFFIXES)


class DataSpec(_Strict):
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    train: list[DataSource] = Field(default_factory=list, max_length=64)
    valid: list[DataSource] = Field(default_factory=list, max_length=64)
    """Held-out sources, each read whole into the validation split (Megatron's --valid-data-path),
    besides any valid share data.split takes from data.train (set it to 0 to validate on these
    alone). Their kind matches data.train's (records for a fine-tune or dpo, text for pretraining)."""
    text_key: str = Field("text", min_length=1, max_length=128)
    """The JSONL field holding a pretraining document's text."""
    split: str = "98,2,0"
    """train,valid,test proportions of the documents, as in Megatron's --split."""
    packing: bool | None = None
    """Pack several documents into each sample, restarting position ids and blocking attention at
    document boundaries (Megatron's reset_position_ids + reset_attention_mask): after each EOD
    token, and where the index says a document ends (data stored without EOD tokens). None: on for
    kind finetune, off for pretrain (whose samples then run across documents, as Megatron's do)."""
    prompt_key: str = Field("prompt", min_length=1, max_length=128)
    """finetune: the JSONL field of a prompt (its tokens carry no loss)."""
    response_key: str = Field("response", min_length=1, max_length=128)
    """finetune: the JSONL field of a response (its tokens carry the loss)."""
    messages_key: str = Field("messages", min_length=1, max_length=128)
    """finetune: the JSONL field of a chat ([{role, content}, ...]; loss on assistant turns only)."""
    chat_template: str | None = Field(None, max_length=2048)
    """finetune: how chats and prompt/response pairs become text: a built-in template's name, or the
    URL of a tokenizer_config.json whose `chat_template` (Jinja) is used. None: the built-in default."""

    @field_validator("split")
    @classmethod
    def _split(cls, v: str) -> str:
        parts = v.split(",")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"data.split={v!r} must be comma-separated numbers such as '98,2,0'") from None
        if len(nums) != 3 or any(n < 0 for n in nums) or nums[0] <= 0:
            raise ValueError(f"data.split={v!r} needs 3 non-negative parts with a positive train part")
        return v

    @model_validator(mode="after")
    def _sources(self, info: ValidationInfo) -> DataSpec:
        report_rules(
            info,
            [
                _rule(field, f"{field} needs a path or a dataset name")
                for field, src in self.sources()
                if src.path is None and src.dataset is None
            ],
        )
        return self

    def sources(self) -> list[tuple[str, DataSource]]:
        """Every source with its field: data.train.N, then data.valid.N."""
        return [(f"data.train.{i}", s) for i, s in enumerate(self.train)] + [
            (f"data.valid.{i}", s) for i, s in enumerate(self.valid)
        ]

    @property
    def split_fractions(self) -> tuple[float, float, float]:
        nums = [float(p) for p in self.split.split(",")]
        total = sum(nums)
        return nums[0] / total, nums[1] / total, nums[2] / total
