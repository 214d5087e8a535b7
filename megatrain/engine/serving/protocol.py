"""OpenAI's chat completions, completions and embeddings, as the model server reads and answers them.

Requests are validated into pydantic models (unknown fields are ignored, as OpenAI-compatible
servers do; the ones we cannot honour are refused by name when set to anything but their
default). Answers and stream chunks are built here as plain dicts in OpenAI's shapes (`object`
chat.completion / chat.completion.chunk / text_completion, a list of `embedding`s, `usage`,
`logprobs`), and every error as
`{"error": {"message", "type", "param", "code"}}` with OpenAI's status codes, so that the `openai`
package raises its own exception classes.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatrain.engine.serving.batcher import TokenLogprob

MAX_N = 16
MAX_STOP = 4


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., min_length=1, max_length=512)

    def refuse_unsupported(self) -> None:
        """ApiError 400 for a field set to what this server cannot honour."""


class _Request(_Body):
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    adapter: str | None = Field(None, max_length=4096)
    """megatrain's extension (set by the API): the LoRA checkpoint folder whose adapters answer."""

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise ApiError(400, f"stop takes at most {MAX_STOP} sequences", "stop")
        return tuple(stops)

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported by this server (leave it 0)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server", "logit_bias")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self, index: int) -> dict[str, str]:
        """{role, content} as chat templates take them: text parts joined; developer is system."""
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise ApiError(400, "only text content parts are supported", f"messages[{index}].content")
            content = "".join(p.text or "" for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    chat_template: str | None = Field(None, max_length=2048)
    """megatrain's extension (set by the API): the fine-tuned job's data.chat_template, which
    renders the chat as its training data was; None: the server's own."""
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise ApiError(400, "tools are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format other than text is not supported", "response_format")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported by this server", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", "suffix")
        if self.best_of not in (None, 1, self.n or 1):
            raise ApiError(400, "best_of is not supported by this server", "best_of")


class EmbeddingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: Literal["mean", "cls"] = "mean"
    """megatrain's extension: the mean over the input's tokens (sentence-transformers'), or [CLS]'s."""
    normalize: bool = True
    """megatrain's extension: L2-normalised (unit length, as OpenAI's embeddings are)."""
    truncate: bool = False
    """megatrain's extension: an input longer than the model reads is cut (else refused, as OpenAI does)."""
    adapter: str | None = Field(None, max_length=4096)
    """Set by the API for a LoRA model: an encoder holds none, so it is refused."""

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a text or one list of ids (a flat list of ids is one input)."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(x, int) for x in given):
            return [list(given)]  # type: ignore[arg-type]
        return list(given)  # type: ignore[arg-type]


def parse(model: type[_Body], data: Any) -> Any:
    """`data` as a request of type `model`; ApiError 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        raise ApiError(400, f"{param}: {err.get('msg', 'invalid value')}", param) from None
    request.refuse_unsupported()
    return request


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(kind: str, rid: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model,
            "system_fingerprint": "megatrain"}  # fmt: skip


def chat_logprobs(items: Sequence[TokenLogprob], text_of: Any) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {content: [{token, logprob, bytes, top_logprobs}]}."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            entry(i.token, i.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in i.top]} for i in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[TokenLogprob], text_of: Any, offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [text_of(i.token) for i in items]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [i.logprob for i in items],
        "top_logprobs": [{text_of(t): lp for t, lp in i.top} for i in items],
        "text_offset": offsets,
    }


def embedding_list(
    vectors: torch.Tensor, encoding_format: str, model: str, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's embeddings answer for vectors (N, C): floats, or each vector's little-endian float32
    bytes in base64 (what the `openai` package asks for by default, and decodes)."""
    rows = vectors.to(torch.float32).cpu()
    if encoding_format == "base64":
        encoded: list[Any] = [base64.b64encode(r.numpy().astype("<f4").tobytes()).decode() for r in rows]
    else:
        encoded = rows.tolist()
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
