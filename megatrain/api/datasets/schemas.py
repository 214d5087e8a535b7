"""Request and response shapes of /v1/datasets."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from megatrain.spec import NAME_PATTERN, TokenizerSpec

RecordFormat = Literal["text", "chat", "prompt_completion", "preference"]


class DatasetOptions(BaseModel):
    """How a corpus becomes an indexed dataset: the query of an upload, part of a URL registration."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN)
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    """A TokenizerSpec, or its shorthand: byte, hf:URL, tiktoken:NAME, sentencepiece:URL."""
    json_key: str = Field("text", min_length=1, max_length=128)
    """The JSONL field holding each document's text."""
    append_eod: bool = True
    """End every document with the tokenizer's end-of-document token (Megatron's --append-eod)."""
    record_format: RecordFormat = "text"
    """text: a document's text under json_key, preprocessed into an index. chat (OpenAI's
    `messages`, `weight` per assistant turn), prompt_completion (`prompt`, `completion`) or
    preference (OpenAI's `input`, `preferred_output`, `non_preferred_output`): records a fine-tune
    (preference: a dpo job) reads as they are; each line is checked at upload, and the dataset is
    ready at once (uploads only)."""


class DatasetCreate(DatasetOptions):
    """POST /v1/datasets with a JSON body: register a JSONL file already in storage."""

    source_url: str = Field(..., min_length=1, max_length=2048)
    """file:///abs/path or s3://bucket/key of a .jsonl (optionally .gz or .zst) file the tenant may
    read: the same rule as a job's data paths."""


class DatasetPublic(BaseModel):
    """A dataset as every dataset endpoint returns it."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    shared: bool
    """Registered by the operator for every tenant (read-only to tenants)."""
    state: str
    """pending (waiting for a worker) → processing → ready | failed."""
    state_reason: str
    path: str
    """The indexed dataset's prefix (PREFIX.bin, PREFIX.idx): what a JobSpec naming it reads, unless
    the job reads records (a record format; kind dpo, or a fine-tune whose json_key is
    data.prompt_key): then `records_url`, else `source_url`."""
    source_url: str
    uploaded: bool
    tokenizer: dict[str, Any]
    json_key: str
    append_eod: bool
    record_format: str
    records_url: str | None
    """Record formats: the records in the engine's shape, which jobs read (source_url is the file
    as uploaded)."""
    filename: str | None
    documents: int | None
    tokens: int | None
    vocab_size: int | None
    input_bytes: int | None
    output_bytes: int | None
    attempt: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class DatasetList(BaseModel):
    items: list[DatasetPublic]
